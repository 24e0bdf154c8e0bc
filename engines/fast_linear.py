"""Linear layers with weights pre-packed for oneDNN, for fp32 or bf16 CPU inference.

Why: on the AMD EPYC (Zen 5) machines we measure on, PyTorch's default fp32 GEMM (MKL) runs
at ~40-75 GFLOP/s per 2 cores, while oneDNN's matmul on a weight reordered once into its
blocked layout reaches ~100-190 GFLOP/s on the same shapes: the encoder is >90% GEMM, so this
is its biggest single speed-up (on an Intel Xeon with AVX-512, MKL's fp32 GEMM already runs at
~220-300 GFLOP/s per 2 cores and packing changes nothing). On an AVX2-only AMD EPYC (Zen 3)
MKL wins at encoder sizes instead (FastConformer's [rows, 1024 -> 4096 -> 1024] feed-forward
pair 1.15-1.24x faster than packed from 256 to 3000 rows), while packed still wins at a
streaming step's few rows (2x at 8 rows): so FastConformer's fp32 encoder layers are packed
only where `packing_pays` times it faster for an offline batch. (Whisper base's encoder timed
a tie there, 3.21 s plain against 3.26 s packed for 2 windows: it stays packed.)

Results equal `F.linear` up to fp32 rounding (~1e-6). A bf16 weight packs the same way;
oneDNN accumulates in fp32 and rounds the output to bf16. Whether bf16 is faster depends on
the CPU, not only on its flags: ~1.9x on the Zen 5 EPYC, but 0.55x on an Intel Xeon with
AVX512_BF16 and no AMX (~165 GFLOP/s against fp32's ~300), so `bf16_gemm_pays` times both
once before anything picks bf16 by itself.

The packed weight is an opaque `torch._mkldnn` tensor held as a plain attribute (not a
parameter or buffer: `state_dict`, `.to()` and ONNX export cannot handle it), so a packed model
is for inference only; build an unpacked one for export.
"""
from __future__ import annotations

import functools
import logging
import platform
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.cpu_threads import best_seconds

log = logging.getLogger("transcribe")

# Rows per GEMM the packed layout is tuned for; measured insensitive between 256 and 1500.
M_HINT = 512
# oneDNN post-ops fused into the GEMM (swish = SiLU), with the algorithm argument each takes:
# "none" selects GELU's exact erf form (nn.GELU's default, which Whisper uses).
ACTIVATIONS = {"none": "", "relu": "", "swish": "", "gelu": "none"}
# ... and each as the separate op an unpacked linear is followed by.
PLAIN_ACTIVATIONS = {"none": lambda x: x, "relu": F.relu, "swish": F.silu, "gelu": F.gelu}


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


# The GEMM `bf16_gemm_pays` times: the shape of a Whisper-base / FastConformer feed-forward
# layer over ~1000 rows (2.1 GFLOP, ~10-20 ms a run on 2 cores), and the fraction of fp32's time
# bf16 must beat: when the two are close, fp32 (exact, the reference) is the choice.
PROBE_SHAPE = (1024, 512, 2048)  # rows, in_features, out_features
PROBE_MARGIN = 0.85


def probe_gemm(dtype: torch.dtype) -> Callable[[], object]:
    """One packed PROBE_SHAPE linear in `dtype`, as a callable to time (the weight packed and
    the first run made here, outside any timing)."""
    rows, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.randn(n, k, generator=gen).to(dtype), None)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    layer(x)
    return lambda: layer(x)


@functools.cache
def bf16_gemm_pays(rounds: int = 3) -> bool:
    """Whether bf16 packed linears run in under PROBE_MARGIN of fp32's time on this CPU, as
    timed once per process (~0.1 s; fp32 and bf16 interleaved, best of `rounds` each:
    cpu_threads.best_seconds). False where oneDNN cannot compute bf16 here at all."""
    if not (onednn_linear_available(torch.float32) and onednn_linear_available(torch.bfloat16)):
        return False
    best = best_seconds({dtype: probe_gemm(dtype) for dtype in (torch.float32, torch.bfloat16)}, rounds)
    pays = best[torch.bfloat16] < PROBE_MARGIN * best[torch.float32]
    log.debug("bf16 packed GEMM %.1f ms, fp32 %.1f ms: bf16 %s", 1e3 * best[torch.bfloat16],
              1e3 * best[torch.float32], "pays" if pays else "does not pay")
    return pays


# The GEMMs `packing_pays` times: an encoder's feed-forward pair over ENCODER_ROWS rows (an
# offline encoder block runs hundreds to thousands). Packing is dropped only where F.linear
# needs under PACKING_MARGIN of packed's time: within 5 % either is as good, and packing was
# the only path before the probe (on the Zen 5 EPYC it is 2-3x faster). On the Zen 3 EPYC the
# probe measured F.linear at 0.88-0.92 of packed's time, the whole 618M encoder at 0.81.
ENCODER_ROWS = 512
PACKING_MARGIN = 0.95


def probe_pair(in_features: int, hidden: int, rows: int, activation: str) -> dict[str, Callable[[], object]]:
    """A feed-forward pair x [rows, in_features] -> hidden -> `activation` -> in_features as
    "packed" (PackedLinear, the activation fused) and "plain" (F.linear, then the activation),
    as callables to time (each run once here: oneDNN primitive creation and MKL's first-call
    setup stay outside any timing)."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(hidden, in_features, generator=gen), torch.randn(in_features, hidden, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    p1, p2 = PackedLinear(w1, None, activation), PackedLinear(w2, None)
    act = PLAIN_ACTIVATIONS[activation]
    runs = {"packed": lambda: p2(p1(x)), "plain": lambda: F.linear(act(F.linear(x, w1)), w2)}
    with torch.inference_mode():
        for run in runs.values():
            run()
    return runs


@functools.cache
def packing_pays(in_features: int, hidden: int, activation: str, rows: int = ENCODER_ROWS, rounds: int = 3) -> bool:
    """Whether an fp32 encoder's linears run faster packed for oneDNN than through F.linear
    (MKL) on this CPU, timed once per process and shape over `probe_pair` (packed and plain
    interleaved, best of `rounds`: cpu_threads.best_seconds; ~0.65 s for the 618M model's
    1024 -> 4096 on 2 Zen 3 cores). True unless F.linear needs under PACKING_MARGIN of packed's
    time; False where oneDNN packs no fp32 here."""
    if not onednn_linear_available(torch.float32):
        return False
    with torch.inference_mode():
        best = best_seconds(probe_pair(in_features, hidden, rows, activation), rounds)
    pays = not best["plain"] < PACKING_MARGIN * best["packed"]
    log.debug("fp32 GEMMs [%d, %d -> %d -> %s -> %d]: packed %.1f ms, F.linear %.1f ms: %s", rows, in_features,
              hidden, activation, in_features, 1e3 * best["packed"], 1e3 * best["plain"],
              "packed" if pays else "F.linear")
    return pays


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
