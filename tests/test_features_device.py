"""Log-mel features on the engine's device (`features_on="device"`): the workers ship audio
through the slab and the engine computes `LogMel` on the padded batch. Same features (1e-5),
tokens, texts and word times as features computed per piece in the workers."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import ROOT, SPEECH, Reference, needs_shared
from engines.parakeet import ParakeetEngine
from transcribe.audio import load_audio
from transcribe.audio_frontend import AudioFrontend, resolve_features_on
from transcribe.segmenting import split_long

SR = 16000
LONG = SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"  # 72 s: cut into pieces


def _pieces(ref: Reference) -> list[np.ndarray]:
    """The fixture's files (2.8-15 s) and the pieces of them all joined (60 s, cut at a pause as
    the workers cut long files): real speech of many lengths, the longest near 40 s."""
    files = [load_audio(ref.audio_path(i), SR) for i in range(len(ref.files))]
    return files + [p for _, p in split_long(np.concatenate(files), SR, 40.0)]


@torch.inference_mode()
def _padded_features(engine: ParakeetEngine, pieces: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's input for one batch of `pieces`, as the engine builds it."""
    return engine._encoder_input([torch.from_numpy(engine.frontend(p)) for p in pieces])


def test_auto_means_workers_and_bad_names_fail():
    assert resolve_features_on("auto") == "workers"
    assert [resolve_features_on(n) for n in ("workers", "device")] == ["workers", "device"]
    with pytest.raises(ValueError, match="'gpu'.*auto, workers, device"):
        resolve_features_on("gpu")


def test_audio_frontend_slot_holds_the_longest_piece():
    fe = AudioFrontend(SR, 40.0)
    assert fe.n_mels * fe.max_frames == 40 * SR  # segmenting.PieceCutter's longest piece
    audio = np.arange(5, dtype=np.float32)
    out = fe(audio)
    assert out.shape == (1, 5) and out.dtype == np.float32 and np.shares_memory(out, audio)


@needs_shared
def test_device_features_equal_worker_features_and_tokens(reference: Reference):
    workers = ParakeetEngine.from_nemo(reference.nemo, "cpu", features_on="workers")
    device = ParakeetEngine.from_nemo(reference.nemo, "cpu", features_on="device")
    assert isinstance(device.frontend, AudioFrontend) and device.logmel is not None
    pieces = _pieces(reference)
    want, want_n = _padded_features(workers, pieces)
    got, got_n = _padded_features(device, pieces)
    assert got.shape == want.shape and torch.equal(got_n, want_n)  # same widths: same encoder buckets
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for a, b in zip(workers.transcribe(pieces), device.transcribe(pieces)):
        assert a.tokens == b.tokens and a.text == b.text
        assert [(w.word, w.start, w.end) for w in a.words] == [(w.word, w.start, w.end) for w in b.words]
    assert device.stage_seconds["features"] > 0


@needs_shared
def test_pipeline_with_device_features_writes_the_same_transcripts(tmp_path):
    """Files of several lengths (several buckets), a 72 s file cut into two pieces, and a file
    of exactly 40 s (one piece filling a whole slab slot), through workers, slab and batcher."""
    from transcribe.inputs import discover
    from transcribe.pipeline import run

    ref = Reference("tdt_tiny")
    inp = tmp_path / "in"
    inp.mkdir()
    for i in (0, 1, 2, 6):
        (inp / ref.audio_path(i).name).write_bytes(ref.audio_path(i).read_bytes())
    (inp / LONG.name).symlink_to(LONG)
    (inp / "jfk.flac").symlink_to(SPEECH / "jfk" / "jfk.flac")  # 44.1 kHz: resampled in the worker
    sf.write(inp / "exactly_40s.flac", np.resize(load_audio(LONG, SR), 40 * SR), SR)
    docs = {}
    for mode in ("workers", "device"):
        engine = ParakeetEngine.from_nemo(ref.nemo, "cpu", features_on=mode)
        stats = run(engine, discover([str(inp)]), tmp_path / mode, ["json"], batch_seconds=60.0, workers=1)
        assert (stats.files_ok, stats.files_failed) == (7, 0)
        assert ("features" in stats.stage_seconds) == (mode == "device")
        docs[mode] = {p.name: json.loads(p.read_text()) for p in (tmp_path / mode).glob("*.json")}
    assert len(docs["device"]) == 7 and docs["device"] == docs["workers"]
    assert docs["device"][LONG.stem + ".json"]["words"][-1]["start"] > 40.0  # the second piece's words


@pytest.mark.parametrize("command", ["transcribe", "bench"])
def test_cli_rejects_a_bad_features_on_with_exit_2(command, tmp_path):
    args = ([] if command == "transcribe" else ["bench"]) + [str(tmp_path), "--features-on", "gpu"]
    p = subprocess.run([sys.executable, "-m", "transcribe.cli", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == 2 and "--features-on 'gpu': expected one of auto, workers, device" in p.stderr


def test_whisper_takes_features_on_workers_only():
    from engines.loader import load_engine

    with pytest.raises(ValueError, match="'device' is for Parakeet models"):
        load_engine("whisper-base", "cpu", features_on="device")


@needs_shared
@pytest.mark.gpu
def test_cuda_device_features_equal_cpu_worker_features_and_tokens():
    """Both engines on CUDA, so the tokens compare where the features are computed, not the
    encoder's arithmetic on two kinds of device."""
    ref = Reference("tdt_tiny")
    workers = ParakeetEngine.from_nemo(ref.nemo, "cuda", features_on="workers")
    device = ParakeetEngine.from_nemo(ref.nemo, "cuda", features_on="device")
    for engine in (workers, device):
        engine.reserve(16)  # the pinned host batch
    pieces = _pieces(ref)
    want, want_n = _padded_features(workers, pieces)  # per piece on the CPU, as in a worker
    got, got_n = _padded_features(device, pieces)
    assert got.is_cuda and got.shape == want.shape and torch.equal(got_n, want_n)
    # fixtures/README.md: features within 1e-3 (cuFFT and pocketfft round apart; the log of a
    # quiet frame's power magnifies it: 3 of 3.2M values differed by 1.3e-4 on the H100)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert [r.tokens for r in device.transcribe(pieces)] == [r.tokens for r in workers.transcribe(pieces)]
