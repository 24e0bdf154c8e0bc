"""The names and defaults the engine options take (--encoder-backend, --decoder-mode, --dtype,
export-engine's --precision and batch profile), in a module that imports no torch: the command
line checks an option as typed before anything heavier is imported, so a typo is answered at
once rather than after torch's seconds of import.
"""
from __future__ import annotations

from enum import Enum


class DeviceError(ValueError):
    """An option this machine's device cannot run (a CUDA-only encoder backend or dtype on the
    CPU, bf16 on a CPU without it in hardware): said as it is, not as a model that cannot load."""


class EngineBuildError(RuntimeError):
    """TensorRT could not parse the ONNX, build the encoder engine or load a cached one (the GPU
    lacks bf16, the builder ran out of memory, a damaged .plan): said as one error line."""


# Chunked streaming of offline-trained models: NeMo's script defaults (chunk_secs=2,
# left_context_secs=10, right_context_secs=2), also its README's recommended "streaming with 4 s
# latency" setting for offline-trained Parakeet.
DEFAULT_CHUNK_MS, DEFAULT_LEFT_MS, DEFAULT_RIGHT_MS = 2000, 10000, 2000
# The most audio one window (left + chunk + right) may hold: each step re-encodes it, with
# attention quadratic in it, and offline pieces are 40 s at most. A left context of 1e12 ms
# walked every chunk position at startup until the machine ran out of memory.
MAX_WINDOW_MS = 300_000

ENCODER_BACKENDS = ("auto", "torch", "compile", "cuda-graphs", "tensorrt")
# Encoder backends of chunked streaming (`transcribe serve`): its windows are short and their
# shapes few, so TensorRT's engine build and torch.compile's are not offered there.
STREAM_BACKENDS = ("auto", "torch", "cuda-graphs")

# The encoder's compute dtypes by name (engines/precision.py maps them to torch dtypes), and the
# short names `transcribe export-engine --precision` uses, accepted by --dtype as well.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES, *DTYPE_ALIASES)
# A TensorRT engine's precision (export-engine --precision, a key of its cache): those short names.
PRECISIONS = ("fp32", "fp16", "bf16")

# Rows per batch a profile allows: the pipeline's default budget (`--batch-seconds 300`) over
# the bucket's edge, capped at DEFAULT_MAX_BATCH (the same rule as `Batcher.capacity`). Bigger
# batches run as several bucket-sized chunks (engines/encoder_backend.py).
DEFAULT_MAX_BATCH = 64
DEFAULT_BATCH_SECONDS = 300.0


class DecodeMode(str, Enum):
    """How a decoder loop runs (engines/decode_modes.py): the best one available is `auto`."""
    AUTO = "auto"
    FULL_GRAPH = "full-graph"
    UNROLLED = "unrolled"
    EAGER = "eager"
