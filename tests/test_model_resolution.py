"""Model resolution: registry names through a pre-filled Hugging Face cache (offline), the
--model > $TRANSCRIBE_MODEL > cached Parakeet > bundled Whisper order, and Whisper end to end."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NEMO_REF, SPEECH, Reference, needs_shared
from engines.checkpoint import CheckpointError, resolve_checkpoint
from engines.loader import BUNDLED, DEFAULT_PARAKEET, choose_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo_id: str, filename: str, source: Path, **extra: Path) -> Path:
    """The layout huggingface_hub writes: refs/main -> snapshot folder holding the files
    (`extra`: more files of the repo, keyword = file name with '_' for '.')."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True)
    shutil.copy(source, snap / filename)
    for key, path in extra.items():
        shutil.copy(path, snap / key.replace("_", "."))
    return snap / filename


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSCRIBE_MODEL", raising=False)
    return cache


@needs_shared
def test_registry_name_resolves_from_a_prefilled_cache_offline(hf_cache):
    want = fill_cache(hf_cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", NEMO_REF / "tdt_tiny" / "model.nemo")
    assert resolve_checkpoint("parakeet-tdt-0.6b-v2").resolve() == want.resolve()
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache and offline"):
        resolve_checkpoint("parakeet-tdt-0.6b-v3")
    with pytest.raises(CheckpointError, match="unknown model 'nope'.*parakeet-tdt-0.6b-v2.*whisper-base, whisper-base.en"):
        resolve_checkpoint("nope")
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        resolve_checkpoint(str(hf_cache / "gone.nemo"))
    for gone in (str(hf_cache / "gone.pt"), "base.safetensors", "models/whisper"):  # paths, not misspelt names
        with pytest.raises(CheckpointError, match=f"^{gone}: no such file or folder$"):
            resolve_checkpoint(gone)
    with pytest.raises(CheckpointError, match=r"a folder holding no checkpoint \(a Whisper folder holds model.bin"):
        resolve_checkpoint(str(hf_cache))  # an unpacked checkpoint, an empty Whisper folder, or a typo


def test_an_unreadable_cache_is_one_error_naming_hf_home(tmp_path, monkeypatch):
    """HF_HOME set to a regular file: huggingface_hub's token read raised NotADirectoryError
    through every caller (a traceback for a run without --model); now a CheckpointError that
    names the setting, which the default order takes as a cache miss."""
    import huggingface_hub.constants as c

    home = tmp_path / "hf_home"
    home.write_text("")
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", home / "hub"), ("HF_TOKEN_PATH", home / "token")):
        monkeypatch.setattr(c, name, str(value))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("TRANSCRIBE_MODEL", raising=False)
    with pytest.raises(CheckpointError, match=rf"^parakeet-tdt-0.6b-v2: cannot read the Hugging Face cache "
                                              rf"\(HF_HOME={home}\): \[Errno 20\] Not a directory"):
        resolve_checkpoint("parakeet-tdt-0.6b-v2")
    assert choose_model(None) == BUNDLED


@needs_shared
def test_resolution_order(hf_cache, monkeypatch):
    assert choose_model("x.nemo") == "x.nemo"
    monkeypatch.setenv("TRANSCRIBE_MODEL", "from-env.nemo")
    assert choose_model(None) == "from-env.nemo"
    monkeypatch.delenv("TRANSCRIBE_MODEL")
    assert choose_model(None) == BUNDLED  # empty cache, offline
    fill_cache(hf_cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", NEMO_REF / "tdt_tiny" / "model.nemo")
    assert choose_model(None) == DEFAULT_PARAKEET


def _cli(args, env_extra):
    env = {k: v for k, v in os.environ.items() if k != "TRANSCRIBE_MODEL"}
    env.update(HF_HUB_OFFLINE="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "transcribe.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


@needs_shared
def test_cli_runs_a_cached_registry_model(tmp_path):
    cache = tmp_path / "hub"
    ref = Reference("tdt_tiny")
    fill_cache(cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", ref.nemo)
    audio = ref.audio_path(0)
    p = _cli([str(audio), "--out", str(tmp_path / "o")], {"HF_HUB_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr
    row = json.loads((tmp_path / "o" / "results.jsonl").read_text())
    assert row["model"] == DEFAULT_PARAKEET and row["text"] == ref.files[0]["transcribe_text"]


@needs_shared
def test_default_falls_back_to_bundled_whisper_and_transcribes_real_speech(tmp_path):
    p = _cli([str(SPEECH / "jfk"), "--out", str(tmp_path / "o")], {"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert p.returncode == 0, p.stderr
    assert "using the bundled whisper-base" in p.stderr
    row = json.loads((tmp_path / "o" / "results.jsonl").read_text())
    assert row["model"] == "whisper-base"
    assert "ask not what your country can do for you" in row["text"].lower()
    doc = json.loads((tmp_path / "o" / "jfk.json").read_text())
    assert doc["segments"] and 9.0 < doc["segments"][-1]["end"] <= 11.0


def test_whisper_registry_name_loads_hf_safetensors_from_the_cache(hf_cache, tmp_path):
    """`--model whisper-large-v3` resolves through the same checkpoint module: a (tiny, random)
    model in Hugging Face's layout, pre-filled in the cache, loads offline and transcribes."""
    import numpy as np

    from engines.loader import load_engine
    from engines.whisper import WhisperDims
    from engines.whisper_weights import bundled_base_dir
    from test_whisper_weights import hf_state, openai_state, write_safetensors

    dims = WhisperDims(n_mels=128, n_audio_state=64, n_audio_head=2, n_audio_layer=1,
                       n_text_state=64, n_text_head=2, n_text_layer=1)  # large-v3's 128 mels
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", hf_state(openai_state(dims)))
    (src / "config.json").write_text(json.dumps({"encoder_attention_heads": 2, "decoder_attention_heads": 2}))
    snapshot = fill_cache(hf_cache, "openai/whisper-large-v3", "model.safetensors", src / "model.safetensors",
                          config_json=src / "config.json", tokenizer_json=bundled_base_dir()[1] / "tokenizer.json").parent

    engine = load_engine("whisper-large-v3", "cpu")
    assert engine.name == "whisper-large-v3" and engine.decoder.model.dims == dims
    assert engine.frontend.n_mels == 128
    (r,) = engine.transcribe([np.zeros(16000, dtype=np.float32)])
    assert isinstance(r.text, str)
    assert engine.decoder.aligner.heads == {0: [0, 1]}  # no generation_config.json: OpenAI's default heads
    # The repo's generation_config.json lists the alignment heads: fetched and read when there
    (snapshot / "generation_config.json").write_text(json.dumps({"alignment_heads": [[0, 1]]}))
    assert load_engine("whisper-large-v3", "cpu").decoder.aligner.heads == {0: [1]}


@needs_shared
def test_network_is_probed_only_on_a_cache_miss(hf_cache, monkeypatch):
    """A local .nemo and a cached registry model load without any connection attempt, even
    with offline mode off; a cache miss with the hub unreachable fails at once, clearly."""
    import engines.checkpoint as ck
    from engines.loader import load_engine

    monkeypatch.delenv("HF_HUB_OFFLINE")
    attempts = []

    def refuse(request, timeout=None):
        attempts.append(request.full_url)
        raise ck.urllib.error.URLError("network unreachable")

    monkeypatch.setattr(ck.urllib.request, "urlopen", refuse)
    nemo = NEMO_REF / "tdt_tiny" / "model.nemo"
    assert load_engine(str(nemo), "cpu").name == str(nemo)
    fill_cache(hf_cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", nemo)
    assert load_engine("parakeet-tdt-0.6b-v2", "cpu").name == "parakeet-tdt-0.6b-v2"
    assert attempts == []
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache and the hub is unreachable"):
        resolve_checkpoint("parakeet-tdt-0.6b-v3")
    assert len(attempts) == 1


def test_a_hub_that_accepts_connections_but_never_answers_is_unreachable(monkeypatch):
    """A connection accepted was taken for an answer: behind a firewall or a dead mirror that
    never replies, a registry model took 399 s to fail (huggingface_hub's retries) and a run
    without --model hung instead of taking the bundled Whisper. The probe wants an HTTP answer
    (any status) within its timeout; a server that gives one is reachable."""
    import socket
    import threading
    import time

    import engines.checkpoint as ck

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    port = silent.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    assert not ck.hub_reachable(timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    silent.close()

    answering = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = answering.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{answering.getsockname()[1]}")
    assert ck.hub_reachable(timeout_s=2.0)
    answering.close()

@needs_shared
def test_a_checkpoint_cut_short_is_a_clear_error(tmp_path):
    """A .nemo cut short (a download or copy that stopped) raised tarfile's ReadError, a
    traceback; a damaged weights member raised torch's. Both name the file and what to do."""
    from engines.checkpoint import NemoArchive

    whole = (NEMO_REF / "tdt_tiny" / "model.nemo").read_bytes()
    for cut in (100_000, len(whole) - 100_000):
        (tmp_path / "cut.nemo").write_bytes(whole[:cut])
        with pytest.raises(CheckpointError, match=r"cut\.nemo: the archive is cut short or damaged .*download or copy it again"):
            NemoArchive(tmp_path / "cut.nemo")
    start = whole.index(b"PK\x03\x04")  # the weights' zip inside the tar, damaged in its middle
    damaged = bytearray(whole)
    damaged[start + 200_000:start + 260_000] = bytes(60_000)
    (tmp_path / "damaged.nemo").write_bytes(bytes(damaged))
    with NemoArchive(tmp_path / "damaged.nemo") as archive:
        with pytest.raises(CheckpointError, match=r"damaged\.nemo: its weights cannot be read"):
            archive.state_dict()
    pickled = whole.index(b"\x80\x02", whole.index(b"data.pkl"))  # the weights' pickled index
    damaged = bytearray(whole)
    damaged[pickled:pickled + 2] = b"\xff\xff"
    (tmp_path / "damaged.nemo").write_bytes(bytes(damaged))
    with NemoArchive(tmp_path / "damaged.nemo") as archive:
        with pytest.raises(CheckpointError, match=r"index is damaged or holds more than tensors") as caught:
            archive.state_dict()
    assert "weights_only" not in str(caught.value)  # not torch's advice to run the file's code


@needs_shared
def test_a_damaged_copy_in_the_cache_says_how_to_fetch_it_anew(hf_cache, tmp_path):
    """A download cut short sits in the Hugging Face cache, and huggingface_hub hands it back on
    every run: "download it again" alone left the user to find the cache folder (and to know that
    removing the snapshot's link is not enough). The error names the repo's folder to remove; a
    file of the user's own gets no such line."""
    from engines.loader import load_engine

    cut = tmp_path / "cut.nemo"
    cut.write_bytes((NEMO_REF / "tdt_tiny" / "model.nemo").read_bytes()[:10_000])
    fill_cache(hf_cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", cut)
    repo = hf_cache / "models--nvidia--parakeet-tdt-0.6b-v2"
    with pytest.raises(CheckpointError, match=rf"cut short or damaged.*It is the Hugging Face cache's copy of "
                                              rf"parakeet-tdt-0.6b-v2: if it is damaged, remove {re.escape(str(repo))} "
                                              "and run again to fetch it anew$"):
        load_engine("parakeet-tdt-0.6b-v2", "cpu")
    with pytest.raises(CheckpointError, match=r"cut\.nemo: the archive is cut short or damaged .*copy it again$"):
        load_engine(str(cut), "cpu")
    from engines.whisper_weights import bundled_base_dir

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00")  # a Whisper download cut short
    (src / "config.json").write_text(json.dumps({"encoder_attention_heads": 2, "decoder_attention_heads": 2}))
    fill_cache(hf_cache, "openai/whisper-small", "model.safetensors", src / "model.safetensors",
               config_json=src / "config.json", tokenizer_json=bundled_base_dir()[1] / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*cache's copy of whisper-small: if it is damaged, "
                                              r"remove .*models--openai--whisper-small and run again"):
        load_engine("whisper-small", "cpu")


def test_a_whisper_checkpoint_is_known_by_a_tilde_path(tmp_path, monkeypatch):
    """A quoted `~/w.pt` names the checkpoint that `load_engine` would load, so a command that
    takes Parakeet models only refuses it as Whisper before loading (stream, serve,
    export-engine), as it refuses the expanded path."""
    from engines.loader import is_whisper

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "w.pt").write_bytes(b"not loaded")
    (tmp_path / "ct2").mkdir()
    (tmp_path / "ct2" / "model.bin").write_bytes(b"not loaded")
    assert is_whisper("~/w.pt") and is_whisper("~/ct2") and is_whisper(str(tmp_path / "w.pt"))
    assert not is_whisper("~/missing.pt") and not is_whisper("~/m.nemo")


def test_a_whisper_download_fetches_the_alignment_heads_when_the_repo_has_them(monkeypatch, tmp_path):
    """The registry's Whisper repos keep their alignment heads in generation_config.json, which
    was never fetched: word times came from OpenAI's default heads (up to 0.14 s off). It is
    fetched beside the weights, and a repo or an older cache without it still loads."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    import engines.checkpoint as ck

    asked = []

    def fake_download(repo_id, filename, local_files_only=False, etag_timeout=None):
        asked.append((filename, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        if filename == "generation_config.json" and repo_id.endswith("tiny.en"):
            raise EntryNotFoundError("no such file in the repo")
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(ck, "hub_reachable", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("whisper-tiny", "whisper-tiny.en"):
        asked.clear()
        assert resolve_checkpoint(name) == tmp_path / "model.safetensors"
        assert ("generation_config.json", False) in asked, asked


def test_a_file_that_is_no_archive_is_one_line_naming_it(tmp_path):
    """tarfile's error lists each compression it tried, a line each: the message was five lines."""
    from engines.checkpoint import NemoArchive

    (tmp_path / "text.nemo").write_text("hello\n")
    with pytest.raises(CheckpointError, match=r"text\.nemo: not a \.nemo \(tar\) archive") as e:
        NemoArchive(tmp_path / "text.nemo")
    assert "\n" not in str(e.value)


@needs_shared
def test_a_hugging_face_repo_id_or_snapshot_folder_is_the_model_it_names(hf_cache):
    """`--model nvidia/parakeet-tdt-0.6b-v2` (what NeMo and HF users type) and the snapshot folder
    holding its .nemo were both refused as no such file / a folder holding no checkpoint."""
    from engines.loader import checked_model

    want = fill_cache(hf_cache, "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", NEMO_REF / "tdt_tiny" / "model.nemo")
    assert resolve_checkpoint("nvidia/parakeet-tdt-0.6b-v2").resolve() == want.resolve()
    # One name for both spellings: results.jsonl records it and a rerun compares it.
    assert checked_model("nvidia/Parakeet-TDT-0.6b-v2") == "parakeet-tdt-0.6b-v2"
    assert checked_model("openai/whisper-base") == BUNDLED and checked_model("openai/whisper-tiny") == "whisper-tiny"
    assert resolve_checkpoint(str(want.parent)) == want
    shutil.copy(want, want.parent / "copy.nemo")
    with pytest.raises(CheckpointError, match=r"a folder holding 2 \.nemo files \(copy\.nemo, parakeet-tdt-0\.6b-v2\.nemo\)"):
        resolve_checkpoint(str(want.parent))


def test_a_misspelt_or_foreign_model_name_gets_a_guess():
    """faster-whisper's and openai-whisper's names (`base`, `large-v3`) and a typo got the list of
    twenty names and no hint; the likely one is now said first. A name like none gets none."""
    for typed, meant in [("base", "whisper-base"), ("Large-V3", "whisper-large-v3"), ("tiny.en", "whisper-tiny.en"),
                         ("parakeet-tdt-0.6b-v2x", "parakeet-tdt-0.6b-v2"), ("parakeet-tdt-06b-v3", "parakeet-tdt-0.6b-v3")]:
        with pytest.raises(CheckpointError, match=rf"unknown model '{re.escape(typed)}' \(did you mean {re.escape(meant)}\?\)"):
            resolve_checkpoint(typed)
    with pytest.raises(CheckpointError, match=r"unknown model 'zzz': pass"):
        resolve_checkpoint("zzz")
