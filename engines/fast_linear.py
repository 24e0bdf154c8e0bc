"""Linear layers with weights pre-packed for oneDNN, for fp32 or bf16 CPU inference.

Why: on the AMD EPYC (Zen 5) machines we measure on, PyTorch's default fp32 GEMM (MKL) runs
at ~40-75 GFLOP/s per 2 cores, while oneDNN's matmul on a weight reordered once into its
blocked layout reaches ~100-190 GFLOP/s on the same shapes: the encoder is >90% GEMM, so this
is its biggest single speed-up. Results equal `F.linear` up to fp32 rounding (~1e-6). A bf16
weight packs the same way and runs ~1.9x faster again on a CPU with native bf16 (avx512_bf16
/ AMX): oneDNN accumulates in fp32 and rounds the output to bf16.

The packed weight is an opaque `torch._mkldnn` tensor held as a plain attribute (not a
parameter or buffer: `state_dict`, `.to()` and ONNX export cannot handle it), so a packed model
is for inference only; build an unpacked one for export.
"""
from __future__ import annotations

import functools
import platform

import torch
from torch import Tensor, nn

# Rows per GEMM the packed layout is tuned for; measured insensitive between 256 and 1500.
M_HINT = 512
# oneDNN post-ops fused into the GEMM (swish = SiLU), with the algorithm argument each takes:
# "none" selects GELU's exact erf form (nn.GELU's default, which Whisper uses).
ACTIVATIONS = {"none": "", "relu": "", "swish": "", "gelu": "none"}


# Weight dtypes oneDNN packs, with the tolerance of the self-test (bf16 rounds the output).
PACKABLE_DTYPES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic in hardware: x86 AVX512_BF16 (every AMX CPU has it
    too), or Arm's BF16 extension. Not oneDNN's `_is_mkldnn_bf16_supported` alone, which on x86
    also says yes for plain AVX-512, where oneDNN emulates bf16: no speed-up to be had there."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # Arm: cpuinfo's BF16 flag


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's packed linear ops and they compute a linear in
    `dtype` on this CPU (bf16: only with native_bf16)."""
    ops = torch.ops.mkldnn
    if not (dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not native_bf16():
        return False
    w, x = torch.randn(8, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
    try:
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, M_HINT), None, "none", [], "")
    except RuntimeError:  # e.g. a build whose oneDNN lacks the CPU's ISA
        return False
    tol = PACKABLE_DTYPES[dtype]
    return bool(torch.allclose(y.float(), x.float() @ w.float().t(), atol=tol, rtol=tol))


class PackedLinear(nn.Module):
    """y = act(x @ W.T + b) for x [..., in_features] on the CPU, W packed for oneDNN; x and y
    are in W's dtype (fp32 or bf16)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, activation: str = "none"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.out_features, self.in_features = weight.shape
        self.activation, self.dtype = activation, weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), M_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.activation, [],
                                                  ACTIVATIONS[self.activation])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


def packable(module: nn.Module) -> bool:
    """A CPU nn.Linear, or kernel-1 Conv1d / 1x1 Conv2d (a linear over channels), whose weight
    dtype oneDNN packs on this build and CPU (onednn_linear_available)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if any(k != 1 for k in module.kernel_size + module.stride) or module.groups != 1 or any(module.padding):
            return False
    elif not isinstance(module, nn.Linear):
        return False
    w = module.weight
    return w.device.type == "cpu" and onednn_linear_available(w.dtype)


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
