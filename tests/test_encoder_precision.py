"""The encoder in a reduced compute precision: bf16 on the CPU (oneDNN-packed bf16 linears) and
fp16 / bf16 on CUDA (`gpu` marker), against NeMo's fp32 encoder outputs on the fixtures.

Errors are relative L2 over a file's valid encodings, ||got - want|| / ||want||. Measured on
the CPU: bf16 0.90-1.14 % (every offline fixture, single files and padded batches alike);
fp16 0.10-0.13 % (run unpacked on the CPU for the estimate only: the CPU rejects fp16). The CPU
bound sits a little above; the CUDA bounds (not yet measured on a GPU) leave more room, for
cuBLAS's reduced-precision split-K reductions (on by default for fp16 and bf16). fp32 itself
is unchanged (tests/test_encoder.py: NeMo within 1e-3).
"""
from __future__ import annotations

import pytest
import torch
from conftest import OFFLINE_VARIANTS, ROOT, Reference, needs_shared

from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig, LayerNorm
from engines.fast_linear import PackedLinear, onednn_linear_available
from engines.streaming_encoder import CacheAwareEncoder, chunk_features, chunk_plan
from transcribe.features import FeatureConfig

CPU_BF16_BOUND = 1.5e-2
CUDA_BOUND = {torch.bfloat16: 2e-2, torch.float16: 5e-3}

needs_cpu_bf16 = pytest.mark.skipif(not onednn_linear_available(torch.bfloat16),
                                    reason="no bf16 in this CPU's hardware (AVX512_BF16 / AMX / Arm BF16)")


def load(variant: str, dtype: torch.dtype, device: str = "cpu") -> ConformerEncoder:
    with NemoArchive(Reference(variant).nemo) as archive:
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        state = sub_state_dict(archive.state_dict(), "encoder")
    return ConformerEncoder.from_state(cfg, state, dtype=dtype, device=device, pack_linears=device == "cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), torch.as_tensor(want).double()
    return float((got - want).norm() / want.norm())


def padded_batch(ref: Reference, pad_value: float = 0.0, device: str = "cpu", width: int | None = None,
                 noise: float = 0.0):
    """Every fixture file's features as one batch `width` frames wide (default: the longest),
    padded with pad_value + noise * N(0, 1)."""
    feats = [torch.from_numpy(ref.array("features", i)) for i in range(len(ref.files))]
    lengths = torch.tensor([f.shape[1] for f in feats])
    shape = (len(feats), feats[0].shape[0], width or int(lengths.max()))
    batch = pad_value + noise * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for i, f in enumerate(feats):
        batch[i, :, : f.shape[1]] = f
    return batch.to(device), lengths.to(device)


def assert_matches_nemo(ref: Reference, files: list[int], out: torch.Tensor, lengths: torch.Tensor,
                        bound: float) -> None:
    """Rows of `out` are fixture files `files`: fp32 (the decoder and joint stay fp32), NeMo's
    lengths, each row's valid frames within `bound` of NeMo's encodings."""
    assert out.dtype == torch.float32
    assert lengths.tolist() == [ref.files[i]["encoder_frames"] for i in files]
    for row, (i, n) in enumerate(zip(files, lengths.tolist())):
        err = rel_err(out[row, :, :n], ref.array("encoder", i))
        assert err < bound, f"{ref.dir.name} file {i}: relative L2 error {err:.4f} >= {bound}"


# --- CPU ------------------------------------------------------------------------------------


@needs_cpu_bf16
def test_bf16_matches_nemo_per_file_and_batched(reference: Reference):
    enc, bound = load(reference.dir.name, torch.bfloat16), CPU_BF16_BOUND
    with torch.inference_mode():
        for i in range(len(reference.files)):
            feats = torch.from_numpy(reference.array("features", i))
            assert_matches_nemo(reference, [i], *enc(feats[None], torch.tensor([feats.shape[1]])), bound)
        # The padding is loud noise: the bf16 masks (MASK_VALUE rounds to -9984) must hide it.
        out, lengths = enc(*padded_batch(reference, noise=10.0))
    assert_matches_nemo(reference, list(range(len(reference.files))), out, lengths, bound)


@needs_shared
@needs_cpu_bf16
def test_bf16_runs_on_packed_bf16_linears_with_fp32_norms():
    enc = load("tdt_tiny", torch.bfloat16)
    assert enc.dtype == torch.bfloat16 and enc.pos_enc.pe.dtype == torch.bfloat16
    packed = [m for m in enc.modules() if isinstance(m, PackedLinear)]
    # Per layer: 2 feed-forwards x 2, q/k/v/out/pos, 2 pointwise convs; subsampling: 2 pointwise + out.
    assert len(packed) == 11 * enc.cfg.n_layers + 3
    assert all(m.packed.dtype == torch.bfloat16 for m in packed)
    assert not any(isinstance(m, torch.nn.Linear) for m in enc.modules())
    assert all(layer.self_attn.onednn for layer in enc.layers)  # position scores by oneDNN bf16 GEMMs
    norms = [m for m in enc.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 5 * enc.cfg.n_layers and all(isinstance(m, LayerNorm) for m in norms)
    assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    others = [p for n, p in enc.named_parameters() if ".norm_" not in n]
    assert others and all(p.dtype == torch.bfloat16 for p in others)  # convs, biases u/v: bf16


@needs_shared
def test_unsupported_dtypes_fail_naming_dtype_and_device(monkeypatch):
    with pytest.raises(ValueError, match="dtype float16 is not supported on device cpu"):
        load("tdt_tiny", torch.float16)
    with pytest.raises(ValueError, match="dtype float64 is not supported"):
        load("tdt_tiny", torch.float64)
    monkeypatch.setattr("engines.precision.onednn_linear_available", lambda dtype: False)
    with pytest.raises(ValueError, match="bfloat16 is not supported on device cpu: this CPU has no bf16"):
        load("tdt_tiny", torch.bfloat16)


@needs_shared
@needs_cpu_bf16
def test_bf16_export_is_refused(tmp_path):
    from engines.encoder_onnx import export_encoder

    with NemoArchive(Reference("tdt_tiny").nemo) as archive:
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        state = sub_state_dict(archive.state_dict(), "encoder")
    enc = ConformerEncoder.from_state(cfg, state, pack_linears=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="export an fp32 encoder"):
        export_encoder(enc, tmp_path / "encoder.onnx")


@needs_shared
@needs_cpu_bf16
def test_bf16_cache_aware_streaming_follows_fp32():
    """The streaming step shares the layers: caches in bf16, encodings out in fp32, and a whole
    stream of chunks (errors carried through the caches) stays within the bf16 bound."""
    streams = {dt: CacheAwareEncoder(load("rnnt_streaming_tiny", dt)) for dt in (torch.float32, torch.bfloat16)}
    feats = torch.randn(streams[torch.float32].encoder.cfg.feat_in, 1200, generator=torch.Generator().manual_seed(0))
    runs = {}
    for dtype, stream in streams.items():
        caches = stream.initial_caches(1)
        assert caches.att.dtype == caches.conv.dtype == dtype
        outs = []
        for span in chunk_plan(feats.shape[1], stream.cfg):
            x = chunk_features(feats, span, stream.cfg)
            drop = torch.tensor([0 if span.first else stream.cfg.drop_extra])
            out, n, caches = stream.step(x[None], torch.tensor([x.shape[1]]), drop, caches)
            assert out.dtype == torch.float32
            outs.append(out[0, : int(n[0])])
        runs[dtype] = torch.cat(outs)
    assert runs[torch.float32].shape[0] > 100  # many chunks, so the caches carried errors along
    assert rel_err(runs[torch.bfloat16], runs[torch.float32]) < CPU_BF16_BOUND


@needs_shared
@needs_cpu_bf16
def test_bench_script_reports_every_cpu_dtype(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("encoder_precision", ROOT / "bench" / "encoder_precision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(Reference("tdt_tiny").nemo), "--batch", "2", "--seconds", "3",
                       "--rounds", "1", "--json", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["fp32", "bf16"] and rows["fp32"]["rel_err_vs_fp32"] == 0
    assert 1e-3 < rows["bf16"]["rel_err_vs_fp32"] < CPU_BF16_BOUND and rows["bf16"]["speedup_vs_fp32"] > 0


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_shared
@pytest.mark.parametrize("backend", ["torch", "cuda-graphs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_reduced_precision_matches_nemo(dtype, backend):
    from engines.encoder_backend import BackendOptions, feature_profiles, feature_width, make_backend

    for variant in OFFLINE_VARIANTS:
        ref = Reference(variant)
        with NemoArchive(ref.nemo) as archive:
            fcfg = FeatureConfig.from_nemo(archive.config["preprocessor"])
        enc = load(variant, dtype, "cuda")
        assert enc.dtype == dtype and all(p.is_cuda for p in enc.parameters())
        profiles = feature_profiles(fcfg, BackendOptions(max_batch=8))
        run = make_backend(backend, enc, profiles, fcfg.pad_value)
        run.reserve(8)  # cuda-graphs: captures every bucket, casts included
        width = feature_width(max(f["feature_frames"] for f in ref.files), fcfg.pad_to)
        feats, lengths = padded_batch(ref, fcfg.pad_value, "cuda", width)
        with torch.inference_mode():
            assert_matches_nemo(ref, list(range(len(ref.files))), *run(feats, lengths), CUDA_BOUND[dtype])
            for i in (0, 3):  # one file alone: the smallest bucket
                one = run(feats[i : i + 1, :, : ref.files[i]["feature_frames"]], lengths[i : i + 1])
                assert_matches_nemo(ref, [i], *one, CUDA_BOUND[dtype])


# ---- choosing the dtype: engine, loader, CLI -------------------------------------------------

def test_resolve_dtype_names_and_errors():
    from engines.precision import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32  # NeMo's exact outputs by default
    assert resolve_dtype("fp32", "cpu") == resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="dtype 'half' is not supported"):
        resolve_dtype("half", "cpu")
    with pytest.raises(ValueError, match="float16 is not supported on device cpu"):
        resolve_dtype("fp16", "cpu")


@needs_shared
@needs_cpu_bf16
def test_engine_runs_its_encoder_in_the_requested_dtype():
    from engines.parakeet import ParakeetEngine
    from transcribe.audio import load_audio

    ref = Reference("tdt_tiny")
    engines = {d: ParakeetEngine.from_nemo(ref.nemo, "cpu", dtype=d) for d in ("auto", "bf16")}
    assert "encoder torch float32" in engines["auto"].runtime
    assert "encoder torch bfloat16" in engines["bf16"].runtime
    assert engines["bf16"].encoder.dtype == torch.bfloat16
    audio = [load_audio(ref.audio_path(i), 16000) for i in range(3)]
    feats = [torch.from_numpy(engines["auto"].frontend(a)) for a in audio]
    x, n = engines["auto"]._batch(feats)
    want, _ = engines["auto"].encoder_backend(x, n)
    got, _ = engines["bf16"].encoder_backend(x, n)
    assert got.dtype == torch.float32 and 0 < rel_err(got, want) < CPU_BF16_BOUND
    assert len(engines["bf16"].transcribe(audio)) == 3


@needs_cpu_bf16
def test_loader_passes_the_dtype_to_whisper():
    from engines.loader import load_engine
    from engines.whisper_weights import WhisperWeightsError, bundled_base_dir

    try:
        bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    assert load_engine("whisper-base", "cpu", dtype="bf16").runtime == "encoder bfloat16, decoder float32 eager, language en"
    with pytest.raises(ValueError, match="encoder dtype float16 is not supported on device cpu"):
        load_engine("whisper-base", "cpu", dtype="float16")


@needs_shared
@pytest.mark.parametrize("model, dtype, code, message", [
    ("tdt_tiny", "bogus", 2, "--dtype 'bogus': expected one of auto, float32"),
    ("tdt_tiny", "float16", 1, "cannot run on this device: encoder dtype float16 is not supported on device cpu"),
    ("whisper-base", "float16", 1, "cannot run on this device: encoder dtype float16 is not supported on device cpu"),
])
def test_cli_dtype_errors(model, dtype, code, message, tmp_path):
    import os
    import subprocess
    import sys

    ref = Reference("tdt_tiny")
    model = str(ref.nemo) if model == "tdt_tiny" else model
    p = subprocess.run([sys.executable, "-m", "transcribe.cli", str(ref.audio_path(0)), "--model",
                        model, "--dtype", dtype, "--out", str(tmp_path), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == code and message in p.stderr, p.stderr[-2000:]
