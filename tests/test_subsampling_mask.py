"""ConvSubsampling's padding mask: masking in place (stages after the first) gives bit for bit
what the out-of-place multiply gave, and never writes into the caller's features."""
from __future__ import annotations

import pytest
import torch

from engines import subsampling
from engines.fast_linear import packable
from engines.subsampling import ConvSubsampling, pack_pointwise

FEAT_IN, D_MODEL, CHANNELS = 80, 64, 16


def make(kind: str, factor: int, causal: bool, dtype: torch.dtype, fused: bool) -> ConvSubsampling:
    """Random weights; `fused`: stored channels-last with packed GEMMs, as fuse_for_inference does."""
    torch.manual_seed(0)
    sub = ConvSubsampling(kind, factor, FEAT_IN, D_MODEL, CHANNELS, causal).eval().requires_grad_(False).to(dtype)
    if fused:
        sub.to(memory_format=torch.channels_last)
        if packable(sub.out):
            pack_pointwise(sub)
    return sub


def padded_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, F] with loud noise past each row's length (what the mask must hide)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([203, 150, 97, 1])
    x = torch.randn(len(lengths), int(lengths.max()), FEAT_IN, generator=gen)
    valid = torch.arange(x.size(1))[None, :] < lengths[:, None]
    x = torch.where(valid[:, :, None], x, 50 * torch.randn(x.shape, generator=gen))
    return x.to(dtype), lengths


ORIGINAL = subsampling._mask_padding


def out_of_place(x: torch.Tensor, lengths: torch.Tensor, in_place: bool) -> torch.Tensor:
    """The mask as it was before stages masked in place: always a product into a new tensor."""
    return ORIGINAL(x, lengths, in_place=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("kind,factor,causal", [("dw_striding", 8, False), ("dw_striding", 8, True),
                                                ("striding", 4, False), ("dw_striding", 16, False)])
def test_in_place_mask_is_bit_identical(kind, factor, causal, dtype, fused, monkeypatch):
    sub = make(kind, factor, causal, dtype, fused)
    x, lengths = padded_batch(dtype)
    before = x.clone()
    with torch.inference_mode():
        got, got_len = sub(x, lengths)
    assert torch.equal(x, before), "the caller's features were written to"
    monkeypatch.setattr(subsampling, "_mask_padding", out_of_place)
    with torch.inference_mode():
        want, want_len = sub(x, lengths)
    assert torch.equal(got_len, want_len)
    assert torch.equal(got, want)


def test_mask_zeroes_exactly_the_padded_frames():
    x = torch.rand(3, 4, 7, 5).contiguous(memory_format=torch.channels_last) + 1
    lengths = torch.tensor([7, 3, 0])
    want = x.clone()
    want[1, :, 3:] = 0
    want[2] = 0
    out = subsampling._mask_padding(x, lengths, in_place=True)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, want)
    y = torch.rand(3, 1, 7, 5)
    copy = subsampling._mask_padding(y, lengths, in_place=False)
    assert copy.data_ptr() != y.data_ptr() and torch.equal(copy, y * (want != 0)[:, :1])


def test_autograd_still_works():
    """With autograd recording, the mask stays out of place: ReLU's backward needs its output."""
    torch.manual_seed(0)
    sub = ConvSubsampling("dw_striding", 8, FEAT_IN, D_MODEL, CHANNELS, False)
    x, lengths = padded_batch(torch.float32)
    with torch.no_grad():
        want, _ = sub(x, lengths)
    got, _ = sub(x, lengths)
    got.sum().backward()
    assert torch.equal(got.detach(), want)
    assert all(p.grad is not None for p in sub.parameters())
