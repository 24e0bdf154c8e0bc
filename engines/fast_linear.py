"""Linear layers with weights pre-packed for oneDNN, for fp32 CPU inference.

Why: on the AMD EPYC (Zen 5) machines we measure on, PyTorch's default fp32 GEMM (MKL) runs
at ~40-75 GFLOP/s per 2 cores, while oneDNN's matmul on a weight reordered once into its
blocked layout reaches ~100-190 GFLOP/s on the same shapes: the encoder is >90% GEMM, so this
is its biggest single speed-up. Results equal `F.linear` up to fp32 rounding (~1e-6).

The packed weight is an opaque `torch._mkldnn` tensor held as a plain attribute (not a
parameter or buffer: `state_dict`, `.to()` and ONNX export cannot handle it), so a packed model
is for inference only; build an unpacked one for export.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

# Rows per GEMM the packed layout is tuned for; measured insensitive between 256 and 1500.
M_HINT = 512
ACTIVATIONS = ("none", "relu", "swish")  # oneDNN post-ops fused into the GEMM (swish = SiLU)


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops and they compute a linear."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    w, x = torch.randn(8, 16), torch.randn(3, 16)
    try:
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, M_HINT), None, "none", [], "")
    except RuntimeError:  # e.g. a build whose oneDNN lacks the CPU's ISA
        return False
    return bool(torch.allclose(y, x @ w.t(), atol=1e-5))


class PackedLinear(nn.Module):
    """y = act(x @ W.T + b) for x [..., in_features] (fp32, CPU) with W packed for oneDNN."""

    def __init__(self, weight: Tensor, bias: Tensor | None, activation: str = "none"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), M_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.activation, [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


def packable(module: nn.Module) -> bool:
    """A CPU fp32 nn.Linear, or kernel-1 Conv1d / 1x1 Conv2d (a linear over channels), on a
    capable build."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if any(k != 1 for k in module.kernel_size + module.stride) or module.groups != 1 or any(module.padding):
            return False
    elif not isinstance(module, nn.Linear):
        return False
    w = module.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and onednn_linear_available()


def pack(module: nn.Module, activation: str = "none") -> nn.Module:
    """`module` as a PackedLinear when `packable`, else unchanged (activation then not fused)."""
    if not packable(module):
        return module
    weight = module.weight.flatten(1)  # [N, K] for Linear, kernel-1 Conv1d and 1x1 Conv2d alike
    return PackedLinear(weight, module.bias, activation)


def apply_linear(module: nn.Module, x: Tensor) -> Tensor:
    """x [..., C] through a linear-like module: kernel-1 Conv1d weights are used as a linear
    on channel-last input (no transposes); anything else is called."""
    if isinstance(module, nn.Conv1d):
        return nn.functional.linear(x, module.weight.squeeze(-1), module.bias)
    return module(x)
