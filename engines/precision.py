"""Which compute dtypes the encoder supports on which device, checked before a model is built.

CPU: float32, and bfloat16 on a CPU with bf16 in hardware, whose oneDNN-packed bf16 linears
run ~1.9x faster than fp32 on an AMD EPYC but slower on an Intel Xeon without AMX
(engines.fast_linear.bf16_gemm_pays times them where a caller picks the dtype itself); no float16 (oneDNN has no fast fp16 GEMM on
the CPUs we target). CUDA: float32, float16, and bfloat16 from compute capability 8.0
(Ampere) on, the first with bf16 tensor cores.
"""
from __future__ import annotations

import torch

from engines.choices import DTYPE_ALIASES, DTYPE_CHOICES, DTYPE_NAMES, DeviceError
from engines.fast_linear import onednn_linear_available

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def check_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """ValueError naming the dtype and device when the encoder cannot compute in `dtype` there."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES.values():
        raise ValueError(f"encoder dtype {name} is not supported (supported: {', '.join(DTYPES)})")
    if dtype == torch.float32:
        return
    if device.type == "cpu":
        if dtype == torch.bfloat16 and onednn_linear_available(torch.bfloat16):
            return
        why = ("this CPU has no bf16 in hardware (AVX512_BF16 / AMX / Arm BF16) for oneDNN" if dtype == torch.bfloat16
               else "the CPU encoder computes in float32 or bfloat16 only")
        raise DeviceError(f"encoder dtype {name} is not supported on device {device}: {why}; use float32")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if dtype == torch.bfloat16 and major < 8:
            raise DeviceError(f"encoder dtype {name} is not supported on device {device} (compute capability "
                             f"{major}.{minor}; bf16 needs 8.0 or newer): use float16 or float32")
        return
    raise DeviceError(f"encoder dtype {name} is not supported on device {device} (only float32 is)")


def check_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """ValueError unless a key/value cache can be stored in `dtype` on `device`: a cache is only
    written and read by attention (SDPA), never multiplied by oneDNN's packed GEMMs, so a CPU
    without bf16 in hardware still holds a bf16 cache (torch computes its attention in software;
    whether that pays is `engines.whisper.cross_cache_dtype`'s to time)."""
    if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return
    check_dtype(dtype, device)

TRT_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_dtype(name: str, device: torch.device | str, auto: torch.dtype = torch.float32) -> torch.dtype:
    """`--dtype` -> the encoder's compute dtype on `device` (ValueError when unknown or
    unsupported there); `auto` -> the caller's `auto`. Parakeet's is float32 everywhere: it
    reproduces NeMo's outputs exactly, and reduced precision stays opt-in until it is measured on
    real weights (WER) and on a GPU -- bf16 gave different greedy tokens on 17 of 32 random-weight
    fixture files (near ties). Whisper's is float16 on CUDA and bfloat16 on CPUs whose bf16
    GEMMs time faster than fp32's (engines/whisper_engine.py)."""
    key = DTYPE_ALIASES.get(name, name)
    if key == "auto":
        return auto
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPE_CHOICES)})")
    check_dtype(DTYPES[key], device)
    return DTYPES[key]
