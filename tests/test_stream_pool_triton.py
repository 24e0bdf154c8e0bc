"""`StreamPool(attention_kernel="triton")`: the fused kernel wired into the cache-aware pool
(`CacheAwareEncoder.step_in_pool`) gives the same tokens as the gather path ("torch").

Without a GPU the kernels run in Triton's interpreter, in a subprocess (TRITON_INTERPRET=1 is
read when triton is imported; see tests/test_stream_attention_triton.py). The kernel needs plain
nn.Linear attention weights, so these pools use an encoder loaded without oneDNN packing.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from conftest import needs_shared, needs_triton, run_in_triton_interpreter
from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig
from engines.stream_pool import ChunkInput, StreamPool, kernel_disagrees
from engines.streaming_encoder import CacheAwareEncoder, chunk_features, chunk_plan

pytestmark = needs_shared
ROOT = Path(__file__).resolve().parents[1]


def _parts(device: str = "cpu", n_files: int = 3):
    """(CacheAwareEncoder with plain nn.Linear weights, transducer decoder, [n_mels, N]
    features of the first n_files fixture files)."""
    import json

    import soundfile as sf

    from conftest import NEMO_REF
    from engines.parakeet import ParakeetEngine
    from streaming_fixtures import VARIANT
    from transcribe.streaming.scheduler import StreamingModel

    model = StreamingModel(ParakeetEngine.from_nemo(VARIANT / "model.nemo", device=device))
    encoder = model.engine.encoder  # unpacked off the CPU
    if device == "cpu":  # the CPU engine packs its linears for oneDNN: load a plain copy
        with NemoArchive(VARIANT / "model.nemo") as archive:
            encoder = ConformerEncoder.from_state(EncoderConfig.from_nemo(archive.config["encoder"]),
                                                  sub_state_dict(archive.state_dict(), "encoder"), pack_linears=False)
    meta = json.loads((VARIANT / "reference.json").read_text())
    feats = []
    for f in meta["files"][:n_files]:
        audio = torch.from_numpy(sf.read(str((NEMO_REF / f["audio"]).resolve()), dtype="float32")[0])
        feats.append(model.logmel(audio[None], torch.tensor([audio.shape[0]]))[0][0])
    return CacheAwareEncoder(encoder), model.engine.decoder, feats


def _run(pool: StreamPool, feats: list[torch.Tensor]) -> tuple[list[list[int]], int]:
    """Stream i starts at step 2i on slot S-1-i (streams batched at different positions, slots
    not in order). Returns (tokens per stream, widest batch)."""
    cfg = pool.encoder.cfg
    plans = [chunk_plan(f.shape[1], cfg) for f in feats]
    slots = [pool.acquire() for _ in range(pool.max_streams)][::-1]
    tokens, widest, step = [[] for _ in feats], 0, 0
    while any(step - 2 * i < len(p) for i, p in enumerate(plans)):
        todo = [(i, plans[i][step - 2 * i]) for i in range(len(feats)) if 0 <= step - 2 * i < len(plans[i])]
        chunks = [ChunkInput(slots[i], chunk_features(feats[i], span, cfg).to(pool.device), span.first)
                  for i, span in todo]
        for (i, _), hyp in zip(todo, pool.step(chunks)):
            tokens[i] += hyp.tokens
        widest, step = max(widest, len(chunks)), step + 1
    return tokens, widest


def check_pool_tokens(device: str, n_files: int) -> None:
    enc, dec, feats = _parts(device, n_files)
    want, widest = _run(StreamPool(enc, dec, n_files + 1, attention_kernel="torch"), feats)
    fused = StreamPool(enc, dec, n_files + 1, attention_kernel="triton")
    got, _ = _run(fused, feats)
    assert fused.attention_kernel == "triton"  # no fallback happened
    assert widest > 1 and any(want)
    assert got == want


def interpreted_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (see the module docstring)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(2)
    check_pool_tokens("cpu", n_files=3)
    print("interpreted pool tokens equal torch")


@needs_triton
def test_pool_kernel_in_triton_interpreter_equals_torch():
    assert "interpreted pool tokens equal torch" in run_in_triton_interpreter("test_stream_pool_triton", "interpreted_checks")


@pytest.fixture(scope="module")
def cpu_parts():
    return _parts("cpu", n_files=3)


def test_kernel_selection_on_cpu(cpu_parts):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: an explicit triton request is honoured on the CPU")
    enc, dec, _ = cpu_parts
    assert StreamPool(enc, dec, 2).attention_kernel == "torch"  # auto: the kernel is for CUDA
    with pytest.raises(ValueError, match="needs CUDA"):
        StreamPool(enc, dec, 2, attention_kernel="triton")
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        StreamPool(enc, dec, 2, attention_kernel="cuda")


def test_in_pool_step_and_fallback_keep_tokens(cpu_parts, monkeypatch, caplog):
    """`step_in_pool` with the dispatchers' torch paths (no triton needed) equals the gather
    path; a kernel that fails to build mid-step (layer 2 of a later step) leaves the pool's
    caches untouched, the step is redone gathered and the pool stays on torch, warned once."""
    import engines.stream_attention_triton as sat

    enc, dec, feats = cpu_parts
    want, _ = _run(StreamPool(enc, dec, 4, attention_kernel="torch"), feats)
    attend, shift = sat.fused_cache_attention, sat.shift_cache_by_index_
    monkeypatch.setattr(sat, "shift_cache_by_index_", lambda *a, use_triton: shift(*a, use_triton=False))
    monkeypatch.setattr(sat, "fused_cache_attention", lambda *a, use_triton, **kw: attend(*a, use_triton=False, **kw))
    pool = StreamPool(enc, dec, 4, attention_kernel="torch")
    pool.attention_kernel = "triton"  # as if picked on CUDA
    assert _run(pool, feats)[0] == want

    calls, seen = [0], {}

    def failing(*a, use_triton, **kw):
        calls[0] += 1
        if calls[0] == 3 * enc.n_layers + 1:  # the 4th step begins: the pool before it
            seen.update(att=pool.att.clone(), conv=pool.conv.clone(), att_len=pool.att_len.clone())
        if calls[0] == 3 * enc.n_layers + 2:  # its 2nd layer fails
            raise sat.KernelUnavailable("attn_kernel: CompilationError: simulated")
        return attend(*a, use_triton=False, **kw)

    monkeypatch.setattr(sat, "fused_cache_attention", failing)
    real_step = enc.step

    def gathered(*a):  # the redo (first call): the pool must be as before the failed step
        if seen.get("checked"):
            return real_step(*a)
        seen["checked"] = True
        assert torch.equal(pool.att, seen["att"]) and torch.equal(pool.conv, seen["conv"])
        assert torch.equal(pool.att_len, seen["att_len"])
        return real_step(*a)

    pool = StreamPool(enc, dec, 4, attention_kernel="torch")
    pool.attention_kernel = "triton"
    monkeypatch.setattr(enc, "step", gathered)
    with caplog.at_level(logging.WARNING, logger="transcribe"):
        assert _run(pool, feats)[0] == want
    assert pool.attention_kernel == "torch" and seen
    assert sum("using torch from now on" in r.message for r in caplog.records) == 1


def test_startup_check_catches_a_wrong_or_unbuildable_kernel(cpu_parts, monkeypatch):
    """`kernel_disagrees` runs the in-pool step (here the dispatchers' torch paths, made wrong
    the ways a kernel could be) against the gather path; a pool asked for the kernel refuses
    it with the reason, its own caches untouched."""
    import engines.stream_attention_triton as sat
    import engines.stream_pool as sp

    enc, dec, _ = cpu_parts
    attend, shift = sat.fused_cache_attention, sat.shift_cache_by_index_

    def use(attention=None, shift_rows=None):
        def fused(attn, x, cache, idx, *a, use_triton, **kw):
            return attend(attn, x, cache, attention(idx) if attention else idx, *a, use_triton=False, **kw)

        def shifted(cache, idx, new, length, use_triton):
            shift(cache, shift_rows(idx) if shift_rows else idx, new, length, use_triton=False)
        monkeypatch.setattr(sat, "fused_cache_attention", fused)
        monkeypatch.setattr(sat, "shift_cache_by_index_", shifted)

    use()
    assert kernel_disagrees(enc, "cpu") is None  # a faithful kernel passes
    use(attention=lambda idx: idx.flip(0))  # reads another stream's slot
    assert "encodings differ from the gather path's: relative error" in kernel_disagrees(enc, "cpu")
    use(shift_rows=lambda idx: idx.roll(1))  # writes the new frames into other slots
    assert "attention caches differ" in kernel_disagrees(enc, "cpu")

    def unbuildable(*a, **kw):
        raise sat.KernelUnavailable("attn_kernel: CompilationError: simulated")
    monkeypatch.setattr(sat, "fused_cache_attention", unbuildable)
    assert kernel_disagrees(enc, "cpu") == "the fused kernel failed to build: attn_kernel: CompilationError: simulated"

    use(attention=lambda idx: idx.flip(0))
    monkeypatch.setattr(sp, "kernel_unusable", lambda *a: None)  # as on CUDA
    with pytest.raises(ValueError, match="attention_kernel='triton' cannot run: the fused step's encodings differ"):
        StreamPool(enc, dec, 2, attention_kernel="triton")
    use()
    pool = StreamPool(enc, dec, 2, attention_kernel="triton")
    assert pool.attention_kernel == "triton"
    assert not pool.att.any() and not pool.conv.any() and not pool.att_len.any()  # checked on scratch caches


@pytest.mark.gpu
def test_pool_kernel_on_cuda_equals_torch():
    """The compiled kernel in the pool on CUDA: auto picks it, tokens equal the gather path."""
    pytest.importorskip("triton")
    enc, dec, _ = _parts("cuda", n_files=1)
    assert StreamPool(enc, dec, 2).attention_kernel == "triton"
    check_pool_tokens("cuda", n_files=6)
