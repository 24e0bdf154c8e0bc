"""The Whisper encoder's self-attention kernel on the CPU (engines/whisper.py): torch's SDPA or
a per-head oneDNN loop compute the same attention, and `encoder_attention_kernel` times the two
once per shape and dtype (SDPA was 1.1-1.2x faster in the whole encoder on an Intel Xeon, the
loop 1.13x in fp32 and 1.57x in bf16 on an AMD EPYC), so `build_whisper` gives every encoder
layer the one this CPU runs faster."""
from __future__ import annotations

import math

import pytest
import torch
from whisper_random import random_dims, random_state

from engines import whisper
from engines.fast_linear import onednn_linear_available


def reference_attention(q, k, v, n_head):
    """softmax(q k^T / sqrt(d_head)) v per head, written out."""
    b, t, d = q.shape
    dh = d // n_head
    heads = [x.view(b, t, n_head, dh).transpose(1, 2) for x in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(dh)
    return (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(b, t, d)


def test_both_kernels_compute_multi_head_attention():
    if not onednn_linear_available(torch.float32):
        pytest.skip("the loop kernel needs oneDNN's linear ops, which this torch build lacks")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 64, generator=g) for _ in range(3))
    want = reference_attention(q, k, v, 4)
    for kernel in whisper.ATTENTION_KERNELS:
        torch.testing.assert_close(whisper.full_attention(q, k, v, 4, kernel), want, atol=1e-5, rtol=1e-5)


def test_an_unknown_kernel_is_an_error():
    q = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="attention kernel 'flash' is not one of sdpa, loop"):
        whisper.full_attention(q, q, q, 2, "flash")


def fake_kernels(monkeypatch, clock, seconds: dict[str, float]) -> None:
    """full_attention stand-in on the fake clock: a run of a kernel takes `seconds[kernel]` and
    is recorded in clock.runs."""
    monkeypatch.setattr(whisper, "full_attention", lambda q, k, v, n_head, kernel: clock.spend(kernel, seconds[kernel]))


@pytest.mark.parametrize("sdpa_seconds, kernel", [(0.5, "sdpa"), (0.79, "sdpa"), (0.81, "loop"), (1.5, "loop")])
def test_sdpa_is_taken_only_where_it_beats_the_loop_by_the_margin(monkeypatch, fake_clock, sdpa_seconds, kernel):
    """Alone, SDPA's lead overstates its lead inside the encoder, so it must take under
    SDPA_MARGIN (0.8) of the loop's time; each kernel runs a warm-up and 2 timed rounds."""
    fake_kernels(monkeypatch, fake_clock, {"loop": 1.0, "sdpa": sdpa_seconds})
    monkeypatch.setattr(whisper, "onednn_linear_available", lambda dtype: True)
    whisper.encoder_attention_kernel.cache_clear()
    try:
        assert whisper.encoder_attention_kernel(torch.float32, 64, 4, 30) == kernel
        assert sorted(fake_clock.runs) == ["loop"] * 3 + ["sdpa"] * 3
    finally:
        whisper.encoder_attention_kernel.cache_clear()


def test_without_onednn_for_the_dtype_it_is_sdpa_untimed(monkeypatch, fake_clock):
    fake_kernels(monkeypatch, fake_clock, {"loop": 0.1, "sdpa": 1.0})
    monkeypatch.setattr(whisper, "onednn_linear_available", lambda dtype: False)
    whisper.encoder_attention_kernel.cache_clear()
    try:
        assert whisper.encoder_attention_kernel(torch.float32, 64, 4, 30) == "sdpa" and fake_clock.runs == []
    finally:
        whisper.encoder_attention_kernel.cache_clear()


def test_the_real_probe_names_a_kernel_and_runs_once_per_shape():
    whisper.encoder_attention_kernel.cache_clear()
    try:
        first = whisper.encoder_attention_kernel(torch.float32, 64, 4, 300)
        assert first in whisper.ATTENTION_KERNELS
        assert whisper.encoder_attention_kernel(torch.float32, 64, 4, 300) == first
        assert whisper.encoder_attention_kernel.cache_info().hits == 1
    finally:
        whisper.encoder_attention_kernel.cache_clear()


def test_build_whisper_gives_every_encoder_layer_the_probed_kernel_and_the_encoder_states_agree(monkeypatch):
    dims = random_dims(width=64, heads=4)
    dims = type(dims)(**{**vars(dims), "n_audio_layer": 2})
    mel = torch.randn(1, dims.n_mels, 2 * dims.n_audio_ctx, generator=torch.Generator().manual_seed(2))
    asked, states = [], {}
    kernels = ["sdpa", "loop"] if onednn_linear_available(torch.float32) else ["sdpa"]
    for kernel in kernels:
        def probe(dtype, d, n_head, frames, kernel=kernel):
            asked.append((dtype, d, n_head, frames))
            return kernel
        monkeypatch.setattr(whisper, "encoder_attention_kernel", probe)
        model = whisper.build_whisper(dims, {k: v.clone() for k, v in random_state(dims).items()}, "cpu")
        assert [layer.attn.kernel for layer in model.encoder.layers] == [kernel] * 2
        with torch.inference_mode():
            states[kernel] = model.encoder(mel)
    assert asked == [(torch.float32, 64, 4, 1500)] * len(kernels)
    if len(states) == 2:
        torch.testing.assert_close(states["loop"], states["sdpa"], atol=1e-4, rtol=1e-4)


def small_encoder_and_mel(windows: int, seed: int) -> tuple[whisper.AudioEncoder, torch.Tensor]:
    """A two-layer random encoder (Whisper's 1500 frames, width 64) and seeded log-mel windows."""
    dims = random_dims(width=64, heads=4)
    dims = type(dims)(**{**vars(dims), "n_audio_layer": 2})
    model = whisper.build_whisper(dims, random_state(dims), "cpu")
    mel = torch.randn(windows, dims.n_mels, 2 * dims.n_audio_ctx, generator=torch.Generator().manual_seed(seed))
    return model.encoder, mel


def test_the_encoder_layers_get_a_contiguous_residual_stream_and_the_states_of_the_plain_formula():
    """The conv front end is channel-first; the positions are added while transposing, so the
    residual stream is [B, T, d] contiguous (else every add keeps the conv's strides and every
    LayerNorm copies its input first) and the states are those of `conv.mT + pos`."""
    enc, mel = small_encoder_and_mel(windows=2, seed=3)
    seen = []
    for layer in enc.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.inference_mode():
        states = enc(mel)
        x = torch.nn.functional.gelu(enc.conv2(torch.nn.functional.gelu(enc.conv1(mel)))).mT + enc.pos
        for layer in enc.layers:
            x = layer(x)
        plain = enc.ln(x)
    assert seen[:2] == [True, True]
    torch.testing.assert_close(states, plain, atol=1e-5, rtol=1e-5)


def test_on_the_cpu_the_encoder_runs_a_few_windows_at_a_time_with_the_states_of_the_whole_batch(monkeypatch):
    """Blocks of BLOCK_WINDOWS windows keep each block's activations under glibc's mmap
    threshold (reused, not faulted in fresh per layer); every window is encoded alone anyway."""
    enc, mel = small_encoder_and_mel(windows=5, seed=4)
    rows = []
    enc.layers[0].register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    with torch.inference_mode():
        blocked = enc(mel)
        block = whisper.BLOCK_WINDOWS
        monkeypatch.setattr(whisper, "BLOCK_WINDOWS", 5)
        whole = enc(mel)
    assert rows == [min(block, 5 - r) for r in range(0, 5, block)] + [5]
    assert len(rows) > 2
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
