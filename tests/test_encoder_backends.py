"""Encoder backends behind one interface: bucket profiles and edges, padding a batch to a bucket
(the CUDA-graph replay, run eagerly on the CPU), the TensorRT engine cache, export-engine.
GPU-only paths (CUDA graphs, TensorRT, torch.compile on CUDA) carry the `gpu` marker."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import Reference, needs_shared

from engines.encoder_backend import (BucketProfile, batch_sizes, bucket_edges, check_profiles, disagreement,
                                     fill_check_batch, in_chunks, length_blocks, make_profiles, pick_bucket,
                                     pick_profile, resolve_backend, run_padded)
from engines.encoder_tensorrt_build import EngineSpec, atomic_write_bytes, default_cache_dir, model_digest
from engines.parakeet import BUCKET_EDGES_S, CPU_BLOCK_SECONDS, ParakeetEngine
from engines.transducer import TransducerDecoder
from transcribe.audio import load_audio


@pytest.fixture(scope="module")
def engine_and_ref(reference: Reference):
    return ParakeetEngine.from_nemo(reference.nemo, "cpu"), reference


def _features(engine, ref):
    return [torch.from_numpy(ref.array("features", i)) for i in range(len(ref.files))]


def _tokens(engine, enc, elen):
    if engine.kind == "ctc" and isinstance(engine.decoder, TransducerDecoder):
        return [h.tokens for h in engine.decoder.decode_ctc(enc, elen)]
    return [h.tokens for h in engine.decoder.decode(enc, elen)]


class EagerBuckets:
    """What CudaGraphEncoder does around a replay (profile, chunks, bucket, pad, slice), with
    the eager encoder in place of the graph: the padding logic, testable on the CPU."""

    def __init__(self, engine):
        self.encoder, self.profiles, self.pad = engine.encoder, engine.profiles, engine.feature_cfg.pad_value
        self.buckets: list[tuple[int, int]] = []

    def __call__(self, features, lengths):
        p = pick_profile(self.profiles, features.size(2))
        return in_chunks(self._replay, features, lengths, p.max_batch)

    def _replay(self, features, lengths):
        bucket = pick_bucket(self.profiles, features.size(0), features.size(2))
        self.buckets.append(bucket)
        return run_padded(self.encoder, features, lengths, bucket, self.pad)


def test_torch_backend_is_the_eager_encoder(engine_and_ref):
    engine, ref = engine_and_ref
    assert engine.encoder_backend.name == "torch" and engine.encoder_backend.encoder is engine.encoder
    feats, flen = engine._batch(_features(engine, ref))
    with torch.inference_mode():
        got, got_len = engine.encoder_backend(feats, flen)
        want, want_len = engine.encoder(feats, flen)
    assert torch.equal(got, want) and torch.equal(got_len, want_len)


def test_bucket_edges_come_from_the_profiles(engine_and_ref):
    engine, _ = engine_and_ref
    assert engine.bucket_edges_s == bucket_edges(engine.profiles) == BUCKET_EDGES_S
    sr = engine.sample_rate
    for prev, p in zip((None,) + engine.profiles[:-1], engine.profiles):
        assert p.frames == engine._width(engine.frontend.frames(int(p.seconds * sr)))  # what _batch pads to
        assert p.min_frames == (1 if prev is None else prev.frames + 1)  # profiles tile the widths
        assert p.max_batch == max(1, min(64, int(300 // p.seconds)))  # Batcher.capacity's rule
    assert engine.profiles[-1].frames == engine._width(engine.frontend.max_frames)
    custom = make_profiles(lambda s: int(s * 100), (1.0, 3.0), max_batch=4, batch_seconds=6.0)
    assert bucket_edges(custom) == (1.0, 3.0) and [p.max_batch for p in custom] == [4, 2]


def test_bucket_selection_smallest_that_fits():
    profiles = make_profiles(lambda s: int(s * 100), (2.0, 4.0, 8.0), max_batch=16, batch_seconds=64.0)
    assert [(p.frames, p.min_frames, p.max_batch) for p in profiles] == [(200, 1, 16), (400, 201, 16), (800, 401, 8)]
    assert batch_sizes(16) == (1, 2, 4, 8, 16) and batch_sizes(12) == (1, 2, 4, 8, 12) and batch_sizes(1) == (1,)
    assert batch_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64) and batch_sizes(50) == (1, 2, 4, 8, 16, 32, 48, 50)
    assert pick_bucket(profiles, 3, 150) == (4, 200)
    assert pick_bucket(profiles, 1, 200) == (1, 200)
    assert pick_bucket(profiles, 9, 201) == (16, 400)
    assert pick_bucket(profiles, 5, 700) == (8, 800)
    assert pick_bucket(profiles, 9, 700) is None  # more rows than the profile: callers chunk
    assert pick_bucket(profiles, 1, 801) is None and pick_profile(profiles, 801) is None  # eager fallback
    with pytest.raises(ValueError, match="increasing"):
        make_profiles(lambda s: 10, (4.0, 2.0))
    with pytest.raises(ValueError, match="min_frames"):
        BucketProfile(1.0, 10, 1, min_frames=11)


@pytest.mark.parametrize("rows", [slice(None), slice(2, 5)], ids=["all", "three_short"])
def test_padded_bucket_gives_eager_outputs_and_identical_tokens(engine_and_ref, rows):
    engine, ref = engine_and_ref
    feats, flen = engine._batch(_features(engine, ref)[rows])
    b, _, w = feats.shape
    pad = engine.feature_cfg.pad_value
    bucket = pick_bucket(engine.profiles, b, w)
    with torch.inference_mode():
        want, want_len = engine.encoder(feats, flen)
        # The bucket the replay would use, and one with extra rows and frames on top.
        for n_rows, width in (bucket, (bucket[0] + 3, bucket[1] + 37)):
            assert n_rows >= b and width >= w
            got, got_len = run_padded(engine.encoder, feats, flen, (n_rows, width), pad)
            assert got.shape == want.shape and torch.equal(got_len, want_len)
            for i, n in enumerate(want_len.tolist()):
                assert (got[i, :, :n] - want[i, :, :n]).abs().max() < 1e-4
            assert _tokens(engine, got, got_len) == _tokens(engine, want, want_len) == [f["tokens"] for f in ref.files[rows]]
    if rows.start == 2:  # three short pieces: the bucket pads both axes
        assert bucket[0] == 4 and bucket[1] > w


def test_bucketed_engine_reproduces_nemo_end_to_end(engine_and_ref):
    engine, ref = engine_and_ref
    pieces = [load_audio(ref.audio_path(i), 16000) for i in range(len(ref.files))]
    eager = engine.encoder_backend
    engine.encoder_backend = buckets = EagerBuckets(engine)
    try:
        batched = engine.transcribe(pieces)
        alone = [engine.transcribe([p])[0] for p in pieces]
    finally:
        engine.encoder_backend = eager
    assert all(bucket is not None for bucket in buckets.buckets)
    for f, r, r1 in zip(ref.files, batched, alone):
        assert r.tokens == r1.tokens == f["tokens"], f["audio"]
        assert r.text == f["transcribe_text"]


def test_length_blocks_fill_a_budget_longest_first():
    width = lambda n: n + 1  # noqa: E731
    # widths 10, 10 fill 20; then 6 + 4 + 3 rows padded to 6: 18
    assert length_blocks([5, 9, 2, 9, 3], width, 20) == [[1, 3], [0, 4, 2]]
    assert length_blocks([50, 1], width, 20) == [[0], [1]]  # wider than the budget: a block alone
    assert length_blocks([], width, 20) == []


def test_on_the_cpu_the_encoder_runs_a_batch_in_length_sorted_blocks_with_one_calls_outputs(engine_and_ref,
                                                                                              monkeypatch):
    """The eager CPU encoder takes a batch in blocks of rows sorted by length, each cut to the
    width its longest row needs and within the block budget (here about 2.5 middle pieces, to
    split the fixture's few pieces). Every row's encoding equals the whole batch's in one call,
    in the batch's row order, and the decoder gives NeMo's tokens from it."""
    engine, ref = engine_and_ref
    assert engine.block_frames == engine._width(engine.frontend.frames(int(CPU_BLOCK_SECONDS * engine.sample_rate)))
    feats, flen = engine._batch(_features(engine, ref))
    middle = sorted(engine._width(n) for n in flen.tolist())[len(flen) // 2]
    budget = 5 * middle // 2
    backend, calls = engine.encoder_backend, []

    def spy(f, n):
        calls.append((f.size(0), f.size(2), n.tolist()))
        return backend(f, n)

    monkeypatch.setattr(engine, "encoder_backend", spy)
    monkeypatch.setattr(engine, "block_frames", budget)
    with torch.inference_mode():
        got, got_len = engine._encode(feats, flen)
        want, want_len = backend(feats, flen)
    assert len(calls) > 2 and sorted(n for _, _, lens in calls for n in lens) == sorted(flen.tolist())
    firsts = [lens[0] for _, _, lens in calls]
    assert firsts == sorted(firsts, reverse=True)  # blocks longest first
    for rows, width, lens in calls:
        assert lens == sorted(lens, reverse=True) and width == engine._width(lens[0])
        assert rows == 1 or rows * width <= budget
    assert got.shape == want.shape and torch.equal(got_len, want_len)
    for i, n in enumerate(want_len.tolist()):
        assert (got[i, :, :n] - want[i, :, :n]).abs().max() < 1e-4
    assert _tokens(engine, got, got_len) == [f["tokens"] for f in ref.files]


def test_only_the_eager_cpu_encoder_runs_in_blocks(reference):
    assert ParakeetEngine.from_nemo(reference.nemo, "cpu", encoder_backend="compile").block_frames is None


@needs_shared
def test_batches_beyond_a_profile_run_in_chunks():
    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cpu")
    feats, flen = engine._batch(_features(engine, ref))
    with torch.inference_mode():
        want, want_len = engine.encoder(feats, flen)
        got, got_len = in_chunks(engine.encoder, feats, flen, 2)
    assert torch.equal(got_len, want_len)
    for i, n in enumerate(want_len.tolist()):
        assert (got[i, :, :n] - want[i, :, :n]).abs().max() < 1e-4


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == "torch" and resolve_backend("auto", "cuda:0") == "cuda-graphs"
    assert resolve_backend("compile", "cpu") == "compile" and resolve_backend("tensorrt", "cuda") == "tensorrt"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("cuda-graphs", "cpu")
    with pytest.raises(ValueError, match="'onnx'"):
        resolve_backend("onnx", "cpu")


@needs_shared
def test_bad_backend_fails_before_loading(tmp_path):
    from engines.loader import load_engine

    with pytest.raises(ValueError, match="'bogus'"):
        ParakeetEngine.from_nemo(tmp_path / "missing.nemo", "cpu", encoder_backend="bogus")
    with pytest.raises(ValueError, match="Whisper"):
        load_engine("whisper-base", "cpu", encoder_backend="cuda-graphs")
    engine = load_engine(str(Reference("tdt_tiny").nemo), "cpu", encoder_backend="torch")
    assert engine.encoder_backend.name == "torch"


# ---- TensorRT engine cache (pure host code) -------------------------------------------------

def _spec(**changes) -> EngineSpec:
    base = EngineSpec("ab" * 32, "NVIDIA H100 80GB HBM3", (9, 0), "10.9.0", "fp16",
                      make_profiles(lambda s: int(s * 100) + 1, (2.0, 4.0)), 128)
    return dataclasses.replace(base, **changes)


def test_cache_key_changes_with_each_component_only():
    key = _spec().key()
    assert key == _spec().key() and len(key) == 64  # stable
    others = [_spec(model_digest="cd" * 32), _spec(gpu_name="NVIDIA A100-SXM4-80GB"), _spec(capability=(8, 0)),
              _spec(trt_version="10.10.0"), _spec(precision="bf16"), _spec(precision="fp32"), _spec(n_mels=80),
              _spec(profiles=make_profiles(lambda s: int(s * 100) + 1, (2.0, 4.0), max_batch=8)),
              _spec(profiles=make_profiles(lambda s: int(s * 100) + 1, (2.0, 5.0)))]
    keys = {s.key() for s in others}
    assert len(keys) == len(others) and key not in keys
    assert _spec().path("/c").parent.as_posix() == "/c" and _spec().path("/c").name.startswith("encoder-fp16-")
    with pytest.raises(ValueError, match="int8"):
        _spec(precision="int8")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "transcribe" / "trt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "transcribe" / "trt"
    # export-engine --cache-dir elsewhere: runs find it when this names it
    monkeypatch.setenv("TRANSCRIBE_TRT_CACHE", str(tmp_path / "engines"))
    assert default_cache_dir() == tmp_path / "engines"


def test_atomic_write_never_leaves_a_partial_entry(monkeypatch, tmp_path):
    path = tmp_path / "cache" / "encoder.plan"
    atomic_write_bytes(path, b"old engine")
    assert path.read_bytes() == b"old engine"

    def killed(fd):
        raise KeyboardInterrupt  # a build stopped between the write and the rename

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, b"new engine, half written")
    assert path.read_bytes() == b"old engine"
    assert [p.name for p in path.parent.iterdir()] == ["encoder.plan"]  # no temp file left


def test_model_digest_is_remembered_per_file_version(tmp_path):
    model, cache = tmp_path / "m.nemo", tmp_path / "cache"
    model.write_bytes(b"weights v1" * 1000)
    digest = model_digest(model, cache)
    assert digest == hashlib.sha256(model.read_bytes()).hexdigest()
    (memo,) = (cache / "digests").iterdir()
    memo.write_text("remembered")  # a second call reads the memo instead of hashing again
    assert model_digest(model, cache) == "remembered"
    model.write_bytes(b"weights v2" * 1000)
    os.utime(model, ns=(1, 1))
    assert model_digest(model, cache) == hashlib.sha256(model.read_bytes()).hexdigest()


# ---- transcribe export-engine ----------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "transcribe.cli", "export-engine", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def _has_tensorrt() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt") is not None


@needs_shared
def test_export_engine_onnx_only_matches_torch(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from engines.encoder_onnx import run_session

    ref = Reference("tdt_tiny")
    out = tmp_path / "enc.onnx"
    p = _cli("--model", str(ref.nemo), "--onnx-only", "--onnx", str(out), "--cache-dir", str(tmp_path / "c"))
    assert p.returncode == 0, p.stderr
    assert str(out) in p.stderr and [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []
    from transcribe.writers import FILE_MODE
    assert out.stat().st_mode & 0o777 == FILE_MODE  # as readable as any file the user writes, not mkstemp's 0600
    p = _cli("--model", str(ref.nemo), "--onnx-only", "--onnx", str(tmp_path))  # a folder: refused up front
    assert p.returncode == 2 and "names a folder, not a file" in p.stderr
    (tmp_path / "afile").write_text("")  # places that cannot be written: a message, not a traceback
    for where in (("--cache-dir", str(tmp_path / "afile")), ("--onnx", str(tmp_path / "afile" / "e.onnx"))):
        p = _cli("--model", str(ref.nemo), "--onnx-only", *where)
        assert p.returncode == 1 and f"cannot write {tmp_path / 'afile'}" in p.stderr, (where, p.stderr)
        assert "Traceback" not in p.stderr
    engine = ParakeetEngine.from_nemo(ref.nemo, "cpu")
    feats, flen = engine._batch(_features(engine, ref))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got, got_len = run_session(session, feats.numpy(), flen.numpy())
    with torch.inference_mode():
        want, want_len = engine.encoder(feats, flen)
    assert got_len.tolist() == want_len.tolist()
    for i, n in enumerate(want_len.tolist()):
        assert np.abs(got[i, :, :n] - want[i, :, :n].numpy()).max() < 1e-4


@needs_shared
def test_export_engine_says_why_it_cannot_load_a_model(tmp_path):
    """An encoder we cannot build is a load error (exit 1), said before anything is exported;
    with no model named it exports the default Parakeet, never the bundled whisper-base the
    runs fall back to (it has no encoder to export), and its absence is the error."""
    import io
    import tarfile

    import yaml

    with tarfile.open(Reference("tdt_tiny").nemo) as src, tarfile.open(tmp_path / "sq.nemo", "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name.endswith("model_config.yaml"):
                cfg = yaml.safe_load(data)
                cfg["encoder"]["_target_"] = "nemo.collections.asr.modules.SqueezeformerEncoder"
                data = yaml.safe_dump(cfg).encode()
                member.size = len(data)
            dst.addfile(member, None if data is None else io.BytesIO(data))
    out = tmp_path / "e.onnx"
    p = _cli("--model", str(tmp_path / "sq.nemo"), "--onnx-only", "--onnx", str(out))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"cannot load model: {tmp_path / 'sq.nemo'}: encoder._target_='nemo.collections.asr.modules.SqueezeformerEncoder'" \
        in p.stderr  # the file named: the model may come from $TRANSCRIBE_MODEL or the default
    assert not out.exists()
    env = {k: v for k, v in os.environ.items() if k != "TRANSCRIBE_MODEL"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty_hub"))
    p = subprocess.run([sys.executable, "-m", "transcribe.cli", "export-engine", "--onnx-only", "--onnx", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 1, p.stderr
    assert "cannot load model: parakeet-tdt-0.6b-v2: not in the Hugging Face cache" in p.stderr
    assert "whisper" not in p.stderr


@needs_shared
@pytest.mark.skipif(_has_tensorrt(), reason="tensorrt is installed here")
def test_export_engine_without_tensorrt_exits_1_naming_the_extra(tmp_path):
    model = str(Reference("tdt_tiny").nemo)
    p = _cli("--model", model, "--cache-dir", str(tmp_path / "c"))
    assert p.returncode == 1
    assert "`tensorrt` package" in p.stderr and "pip install 'transcribe[tensorrt]'" in p.stderr
    # An ONNX asked for is still written before the engine part fails.
    p = _cli("--model", model, "--cache-dir", str(tmp_path / "c"), "--onnx", str(tmp_path / "e.onnx"))
    assert p.returncode == 1 and (tmp_path / "e.onnx").stat().st_size > 0
    assert "transcribe[tensorrt]" in p.stderr
    assert _cli("--model", model, "--precision", "int8").returncode == 2
    # no --max-batch: no run takes one, so an engine built with another value was never found
    p = _cli("--model", model, "--max-batch", "8")
    assert p.returncode == 2 and "No such option" in p.stderr


def test_the_self_check_batch_and_its_comparison(engine_and_ref):
    """What the GPU backends check themselves with at startup (`encoder_cudagraph._capture`,
    `TensorRTEncoder.reserve`), on the CPU: a seeded batch with rows of different lengths, and a
    comparison over valid frames that passes eager against itself and catches output that
    ignores the lengths (masks baked in at capture) or is not finite."""
    engine, _ = engine_and_ref
    w = engine.profiles[0].frames
    feats, lens = torch.empty(4, engine.feature_cfg.features, w), torch.empty(4, dtype=torch.long)
    fill_check_batch(feats, lens)
    again = torch.empty_like(feats)
    fill_check_batch(again, torch.empty_like(lens))
    assert torch.equal(feats, again) and lens.tolist()[0] == w and lens.tolist()[-1] == (w + 1) // 2
    assert len(set(lens.tolist())) == 4 and 0.9 < float(feats.std()) < 1.1
    with torch.inference_mode():
        enc, elen = (t.clone() for t in engine.encoder(feats, lens))  # [B, D, T'], as backends return
        assert disagreement(enc, elen, enc.clone(), elen.clone()) is None
        assert disagreement(enc + 1e-6 * torch.randn_like(enc), elen, enc, elen) is None
        junk = enc.clone()
        for row, n in enumerate(elen.tolist()):
            junk[row, :, n:] = float("nan")  # past each row's length: never read
        assert disagreement(junk, elen, enc, elen) is None
        junk[0, 0, 0] = float("inf")
        assert disagreement(junk, elen, enc, elen).startswith("relative error")
        unmasked, ulen = engine.encoder(feats, torch.full_like(lens, w))
        assert "output lengths" in disagreement(unmasked, ulen, enc, elen)
        why = disagreement(unmasked, elen, enc, elen)  # right lengths, masks ignored
        assert why is not None and why.startswith("relative error")


def test_check_profiles_names_the_first_profile_that_disagrees(engine_and_ref):
    """TensorRT's startup check, with the eager encoder standing in for the engine: exact
    passes; an engine whose error grows with the width fails at the first profile past the
    tolerance, named with its seconds."""
    engine, _ = engine_and_ref
    profiles = engine.profiles[:3]

    def run(i, features, lengths):
        enc, n = engine.encoder(features, lengths)
        return enc * (1 + 0.03 * i), n  # profile 0 exact, 1 off by 3 %, 2 by 6 %

    with torch.inference_mode():
        assert check_profiles(lambda i, f, n: engine.encoder(f, n), engine.encoder, profiles, 1e-3) is None
        assert check_profiles(run, engine.encoder, profiles, 5e-2) == \
            f"profile 2 ({profiles[2].seconds:g} s): relative error 6.00e-02 against eager (tolerance 5e-02)"


class StandInCompile:
    """torch.compile's stand-in for `TorchEncoder`: the eager encoder, off by `scale`, or raising."""

    def __init__(self, scale: float = 1.0, error: Exception | None = None):
        self.scale, self.error, self.calls = scale, error, 0

    def __call__(self, module, dynamic):
        def compiled(features, lengths, static):
            self.calls += 1
            if self.error is not None:
                raise self.error
            enc, n = module(features, lengths, static=static)
            return enc * self.scale, n
        return compiled


@needs_shared
@pytest.mark.parametrize("stand_in, why", [
    (StandInCompile(), None),
    (StandInCompile(scale=1.01), "profile 0 (2 s): relative error 1.00e-02 against eager (tolerance 1e-03)"),
    (StandInCompile(error=RuntimeError("BackendCompilerFailed: simulated")),
     "it failed to compile: RuntimeError: BackendCompilerFailed: simulated"),
], ids=["faithful", "off_by_1_percent", "fails_to_compile"])
def test_compile_backend_checks_itself_at_startup(stand_in, why, monkeypatch, caplog):
    """`reserve()` compiles and checks every profile's seeded batch against eager; a compile that
    fails or disagrees is turned off with the reason logged, and the encoder runs eagerly."""
    monkeypatch.setattr(torch, "compile", stand_in)
    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cpu", encoder_backend="compile")
    backend = engine.encoder_backend
    with caplog.at_level("WARNING", logger="transcribe"):
        engine.reserve(4)
    assert backend.off == why
    assert stand_in.calls == (len(engine.profiles) if why is None else 1)
    assert [r.message for r in caplog.records if "compile encoder" in r.message] == \
        ([] if why is None else [f"compile encoder: {why}; the encoder runs in eager torch from now on"])
    feats, flen = engine._batch(_features(engine, ref)[:2])
    calls = stand_in.calls
    with torch.inference_mode():
        got, got_len = backend(feats, flen)
        want, want_len = engine.encoder(feats, flen)
    assert stand_in.calls == calls + (why is None)  # the compiled encoder runs only while it is on
    assert torch.equal(got_len, want_len) and torch.equal(got, want)
