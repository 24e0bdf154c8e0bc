"""FastConformer's convolutional front end: 2-D striding convolutions that cut time (and the
mel axis) by 2 per stage, then one linear layer to d_model.

Module and parameter names follow NeMo's `ConvSubsampling` (`conv.<i>`, `out`) so NeMo's
state dict loads as is. Two layouts are supported:

- `striding`: per stage Conv2d(3x3, stride 2) + ReLU (stage 1: 1 -> C channels, then C -> C).
- `dw_striding`: stage 1 Conv2d(1 -> C, 3x3, stride 2) + ReLU, later stages a depthwise
  Conv2d(3x3, stride 2) + pointwise Conv2d(1x1) + ReLU.

`causal` (NeMo's `causal_downsampling`) pads (kernel-1, stride-1) = (2, 1) on the left/right of
both the time and the mel axis instead of (1, 1).

Padded frames of a batch are zeroed before every strided convolution, as NeMo's
`MaskedConvSequential` does, so a file padded into a batch gives the same valid frames as alone.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from engines.fast_linear import PackedLinear, pack, packable

KERNEL = 3  # every strided conv of both layouts is 3x3, stride 2
STRIDE = 2
SUPPORTED = ("dw_striding", "striding")


def conv_paddings(causal: bool) -> tuple[int, int]:
    """(left, right) zero padding of each strided conv, on the time and the mel axis alike."""
    return (KERNEL - 1, STRIDE - 1) if causal else ((KERNEL - 1) // 2, (KERNEL - 1) // 2)


def subsampled_lengths(lengths: Tensor, factor: int, causal: bool) -> Tensor:
    """Frame counts after subsampling: NeMo's `calc_length`, in exact integer arithmetic.

    lengths: [B] input frames (any integer dtype) -> [B] int64 output frames. Each stage maps
    L -> floor((L + left + right - kernel) / stride) + 1; NeMo computes it in float32, which
    agrees for every length below 2**24 frames.
    """
    left, right = conv_paddings(causal)
    out = lengths.to(torch.int64)
    for _ in range(_stages(factor)):
        out = torch.div(out + (left + right - KERNEL), STRIDE, rounding_mode="floor") + 1
    return out


def _stages(factor: int) -> int:
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"encoder.subsampling_factor={factor!r} is not supported (supported: powers of 2 from 2)")
    return factor.bit_length() - 1


class ConvSubsampling(nn.Module):
    """[B, T, feat_in] log-mel frames -> [B, T', d_model], T' = subsampled_lengths(T)."""

    def __init__(self, kind: str, factor: int, feat_in: int, d_model: int, channels: int, causal: bool):
        super().__init__()
        if kind not in SUPPORTED:
            raise ValueError(f"encoder.subsampling={kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
        self.kind = kind
        self.factor = factor
        self.causal = causal
        self.padding = conv_paddings(causal)
        n = _stages(factor)
        layers: list[nn.Module] = []
        # Index of each strided conv inside `conv`: a stage runs from one to the next.
        self._stage_starts: list[int] = []
        # Symmetric padding goes into the conv (one fused op); causal padding is applied by hand.
        pad = 0 if causal else self.padding[0]
        in_ch = 1
        for i in range(n):
            self._stage_starts.append(len(layers))
            if kind == "dw_striding" and i > 0:
                layers.append(nn.Conv2d(channels, channels, KERNEL, STRIDE, pad, groups=channels))
                layers.append(nn.Conv2d(channels, channels, 1))
            else:
                layers.append(nn.Conv2d(in_ch, channels, KERNEL, STRIDE, pad))
            layers.append(nn.ReLU(inplace=True))
            in_ch = channels
        self.conv = nn.Sequential(*layers)
        freq = feat_in
        for _ in range(n):
            freq = (freq + sum(self.padding) - KERNEL) // STRIDE + 1
        self.out = nn.Linear(channels * freq, d_model)

    def forward(self, x: Tensor, lengths: Tensor, masked: bool = True) -> tuple[Tensor, Tensor]:
        """x: [B, T, feat_in], lengths: [B] valid frames -> ([B, T', d_model], [B] int64).

        masked=False skips zeroing padded frames: only correct when no row is padded.
        """
        x = x.unsqueeze(1)  # [B, 1, T, F]: a one-channel image
        out_lengths = lengths.to(torch.int64)
        ends = self._stage_starts[1:] + [len(self.conv)]
        left, right = self.padding
        for stage, (start, end) in enumerate(zip(self._stage_starts, ends)):
            if masked:
                # Stage 0's input may be the caller's features (a view when no cast was needed):
                # masked into a copy. Later inputs are this module's own ReLU outputs: masked in
                # place, unless autograd records them (ReLU's backward needs its output intact).
                x = _mask_padding(x, out_lengths, in_place=stage > 0 and not x.requires_grad)
            if self.causal:
                x = nn.functional.pad(x, (left, right, left, right))
            for layer in self.conv[start:end]:
                if isinstance(layer, PackedLinear):  # a 1x1 conv as a GEMM over channels-last memory
                    x = layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
                else:
                    x = layer(x)
            out_lengths = torch.div(out_lengths + (left + right - KERNEL), STRIDE, rounding_mode="floor") + 1
        b, c, t, f = x.shape
        # NeMo flattens (channel, mel) with channel major: [B, T', C * F'].
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, out_lengths


def pack_pointwise(sub: ConvSubsampling) -> None:
    """Swap dw_striding's 1x1 convs (+ their ReLU) for oneDNN-packed GEMMs with fused ReLU, and
    the output linear for a packed one: ~2x faster than the 1x1 conv. Inference only; expects
    channels-last activations (weights stored channels-last, see fuse_for_inference)."""
    for i, layer in enumerate(sub.conv):
        if (isinstance(layer, nn.Conv2d) and layer.kernel_size == (1, 1) and isinstance(sub.conv[i + 1], nn.ReLU)
                and packable(layer)):
            sub.conv[i] = pack(layer, "relu")
            sub.conv[i + 1] = nn.Identity()
    sub.out = pack(sub.out)


def _mask_padding(x: Tensor, lengths: Tensor, in_place: bool) -> Tensor:
    """x [B, C, T, F] times a [B, 1, T, 1] mask of 1 on valid frames and 0 on padding.

    A multiply, as NeMo's mask (NaN or inf in the padding stays NaN), so in place or not the
    result is bit-identical. in_place=True writes into x instead of a second full-size activation
    per stage; on a CPU that copy, when the allocator hands it fresh pages (4 x 18 s in fp32:
    237 MB), made the whole subsampling ~1.5x slower. Neither form syncs with the host, so both
    run under torch.compile, CUDA graphs and ONNX tracing.
    """
    valid = torch.arange(x.size(2), device=lengths.device)[None, :] < lengths[:, None]
    keep = valid.to(x.dtype)[:, None, :, None]
    if not in_place:
        return x * keep
    return x.mul_(keep)  # same as: x[~valid] = 0 (over C and F), NaN and inf aside
