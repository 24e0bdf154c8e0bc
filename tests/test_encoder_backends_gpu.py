"""The fast encoder backends against the eager encoder on NeMo's fixtures: CUDA graphs, TensorRT
(fp32 and fp16) and torch.compile. All need a CUDA device (`gpu` marker: skipped without one),
except the CPU torch.compile check, which is opt-in because compiling takes minutes on 2 cores."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import OFFLINE_VARIANTS, Reference, needs_shared

from engines.encoder_backend import BackendOptions
from engines.parakeet import ParakeetEngine
from transcribe.audio import load_audio


def _pieces(ref: Reference):
    return [load_audio(ref.audio_path(i), 16000) for i in range(len(ref.files))]


def _features(ref: Reference):
    return [torch.from_numpy(ref.array("features", i)) for i in range(len(ref.files))]


def _assert_close_on_valid_frames(got, want, lengths, tol):
    assert got.shape == want.shape
    for i, n in enumerate(lengths.tolist()):
        assert (got[i, :, :n].float() - want[i, :, :n].float()).abs().max().item() < tol


@pytest.mark.gpu
@needs_shared
@pytest.mark.parametrize("variant", OFFLINE_VARIANTS)
def test_cuda_graphs_tokens_identical_to_eager(variant):
    ref = Reference(variant)
    eager = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="torch")
    graphs = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="cuda-graphs")
    backend = graphs.encoder_backend
    assert backend.name == "cuda-graphs" and graphs.bucket_edges_s == eager.bucket_edges_s
    graphs.reserve(8)  # startup: every bucket of up to 8 rows, largest first, one pool
    assert set(backend.graphs) == set(backend.buckets(8))
    pieces = _pieces(ref)
    for batch, files in ((pieces, ref.files), (pieces[2:5], ref.files[2:5]), (pieces[:1], ref.files[:1])):
        want, got = eager.transcribe(batch), graphs.transcribe(batch)
        assert [r.tokens for r in got] == [r.tokens for r in want] == [f["tokens"] for f in files]
    assert set(backend.graphs) == set(backend.buckets(8))  # nothing captured after startup
    feats, flen = graphs._batch(_features(ref)[2:5])
    with torch.inference_mode():
        got, got_len = backend(feats, flen)
        want, want_len = graphs.encoder(feats, flen)
    assert torch.equal(got_len, want_len)
    _assert_close_on_valid_frames(got, want, want_len, 1e-3)


@pytest.mark.gpu
@needs_shared
def test_cuda_graphs_fallbacks():
    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="cuda-graphs",
                                      backend_options=BackendOptions(max_batch=2))
    backend = engine.encoder_backend
    with torch.inference_mode():
        # Wider than the widest bucket: the eager encoder, bit for bit.
        x = torch.randn(2, engine.feature_cfg.features, engine.profiles[-1].frames + 50, device="cuda")
        n = torch.tensor([x.shape[2], 300], device="cuda")
        assert torch.equal(backend(x, n)[0], engine.encoder(x, n)[0])
        # More rows than max_batch: chunks of 2 rows through the graphs, lazily captured.
        feats, flen = engine._batch(_features(ref))
        got, got_len = backend(feats, flen)
        want, want_len = engine.encoder(feats, flen)
    assert torch.equal(got_len, want_len) and backend.graphs
    _assert_close_on_valid_frames(got, want, want_len, 1e-3)


@pytest.mark.gpu
@needs_shared
def test_cuda_graphs_that_disagree_with_eager_turn_off(monkeypatch, caplog):
    """A capture whose replay of the check batch disagrees (forced here) turns the graphs off:
    logged once, every later batch runs in eager torch, bit for bit."""
    import logging

    from engines import encoder_cudagraph

    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="cuda-graphs",
                                      backend_options=BackendOptions(max_batch=2))
    backend = engine.encoder_backend
    monkeypatch.setattr(encoder_cudagraph, "disagreement", lambda *a: "relative error 1.00e+00 against eager")
    with caplog.at_level(logging.WARNING, logger="transcribe"), torch.inference_mode():
        engine.reserve(2)
        feats, flen = engine._batch(_features(ref)[:2])
        got, got_len = backend(feats, flen)
        want, want_len = engine.encoder(feats, flen)
    assert backend.off is not None and not backend.graphs
    assert torch.equal(got, want) and torch.equal(got_len, want_len)
    lines = [r.getMessage() for r in caplog.records if "cuda-graphs encoder" in r.getMessage()]
    assert len(lines) == 1 and "relative error" in lines[0] and "eager torch from now on" in lines[0]


@pytest.mark.gpu
@needs_shared
@pytest.mark.parametrize("precision,variants", [("fp32", ["tdt_tiny"]), ("fp16", OFFLINE_VARIANTS)])
def test_tensorrt_matches_eager(precision, variants, tmp_path):
    pytest.importorskip("tensorrt")
    for variant in variants:
        ref = Reference(variant)
        opts = BackendOptions(max_batch=8, precision=precision, cache_dir=str(tmp_path))
        engine = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="tensorrt", backend_options=opts)
        assert engine.encoder_backend.name == "tensorrt"
        results = engine.transcribe(_pieces(ref))
        assert [r.tokens for r in results] == [f["tokens"] for f in ref.files], (variant, precision)
        feats, flen = engine._batch(_features(ref))
        with torch.inference_mode():
            got, got_len = engine.encoder_backend(feats, flen)
            want, want_len = engine.encoder(feats, flen)
        assert torch.equal(got_len, want_len)
        _assert_close_on_valid_frames(got, want, want_len, 2e-3 if precision == "fp32" else 5e-2)
    plans = sorted(p.name for p in tmp_path.glob("*.plan"))
    assert len(plans) == len(variants)
    # A second load is served from the cache (no new engine file).
    ParakeetEngine.from_nemo(Reference(variants[0]).nemo, "cuda", encoder_backend="tensorrt", backend_options=opts)
    assert sorted(p.name for p in tmp_path.glob("*.plan")) == plans


@pytest.mark.gpu
@needs_shared
def test_a_tensorrt_engine_that_fails_its_startup_check_is_not_used(monkeypatch, tmp_path):
    pytest.importorskip("tensorrt")
    from engines import encoder_tensorrt

    ref = Reference("tdt_tiny")
    opts = BackendOptions(max_batch=2, precision="fp16", cache_dir=str(tmp_path))
    engine = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="tensorrt", backend_options=opts)
    backend = engine.encoder_backend
    with torch.inference_mode():
        engine.reserve(2)
        assert backend.off is None  # the real check passes on a sound engine
        monkeypatch.setattr(encoder_tensorrt, "check_profiles", lambda *a: "profile 0 (2 s): relative error nan")
        backend.reserve(2)
        feats, flen = engine._batch(_features(ref)[:2])
        got, got_len = backend(feats, flen)
        want, want_len = engine.encoder(feats, flen)
    assert backend.off == "profile 0 (2 s): relative error nan"
    assert torch.equal(got, want) and torch.equal(got_len, want_len)


@pytest.mark.gpu
@needs_shared
def test_compile_tokens_identical_to_eager_on_cuda():
    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cuda", encoder_backend="compile")
    engine.reserve(len(ref.files))  # compiles and checks every profile against eager
    assert engine.encoder_backend.off is None
    assert [r.tokens for r in engine.transcribe(_pieces(ref))] == [f["tokens"] for f in ref.files]


@needs_shared
@pytest.mark.skipif(os.environ.get("TRANSCRIBE_SLOW_TESTS") != "1",
                    reason="slow: torch.compile of the encoder on a 2-core CPU takes ~2.5 min (TRANSCRIBE_SLOW_TESTS=1)")
def test_compile_matches_eager_on_cpu():
    ref = Reference("tdt_tiny")
    eager = ParakeetEngine.from_nemo(ref.nemo, "cpu")
    compiled = ParakeetEngine.from_nemo(ref.nemo, "cpu", encoder_backend="compile")
    feats, flen = eager._batch(_features(ref))
    with torch.inference_mode():
        got, got_len = compiled.encoder_backend(feats, flen)
        want, want_len = eager.encoder(feats, flen)
    assert torch.equal(got_len, want_len)
    _assert_close_on_valid_frames(got, want, want_len, 1e-4)
    assert [r.tokens for r in compiled.transcribe(_pieces(ref))] == [f["tokens"] for f in ref.files]
