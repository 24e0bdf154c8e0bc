"""The encoder as a TensorRT engine (built and cached by `engines.encoder_tensorrt_build`).

One engine holds one optimization profile per length bucket (`BucketProfile`), in the order
of the backend's profiles. A call picks the narrowest profile whose width range holds the
batch, makes it active (only when it changes), sets the input shapes, binds torch tensors by
address and enqueues the engine on a stream of its own that waits for torch's current stream,
which then waits for it: no host sync, and the result is ordered with the torch work before and
after it. (Not torch's default stream itself: enqueueV3 on the legacy default stream makes
TensorRT add cudaStreamSynchronize calls, and says so in a warning.) Batches wider than the
widest profile run in the eager torch encoder (logged once); batches with more rows than the
profile's max_batch run as chunks of max_batch rows.

At `reserve()` (startup) every profile runs a seeded check batch against the eager encoder
(`encoder_backend.check_profiles`, tolerance by precision); an engine that disagrees (an fp16
overflow, say) is not used: the encoder runs in eager torch, logged once with the profile and
the error.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from engines.choices import EngineBuildError
from engines.conformer import ConformerEncoder
from engines.encoder_backend import (ENGINE_CHECK_RTOL, BucketProfile, FallbackLog, bucket_edges, check_profiles,
                                     in_chunks, pick_profile, turned_off)
from engines.encoder_onnx import INPUTS, OUTPUTS
from engines.encoder_tensorrt_build import ensure_engine, import_tensorrt

log = logging.getLogger(__name__)


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int64: torch.int64}
    if dtype not in table:
        raise ValueError(f"TensorRT engine tensor type {dtype} has no torch equivalent here")
    return table[dtype]


def aligned(t: Tensor) -> Tensor:
    """`t`, copied when its address is not a multiple of 256 bytes, which TensorRT requires of
    every tensor address (setTensorAddress): a chunk of rows (`in_chunks`) is a view into its
    batch, at any offset."""
    return t if t.data_ptr() % 256 == 0 else t.clone()


class TensorRTEncoder:
    """A deserialized encoder engine behind the backend interface; `encoder` is the eager
    fallback for shapes beyond the profiles."""

    name = "tensorrt"

    def __init__(self, engine_path: str | os.PathLike, profiles: Sequence[BucketProfile], encoder: ConformerEncoder,
                 precision: str = "fp16"):
        trt = import_tensorrt()
        self.precision = precision
        self.off: str | None = None  # why the engine is not used (its startup check disagreed)
        self._trt = trt
        self.encoder = encoder
        self.device = encoder.pos_enc.pe.device
        if self.device.type != "cuda":
            raise ValueError(f"encoder backend 'tensorrt' needs the encoder on a CUDA device, not {self.device}")
        self.profiles = tuple(profiles)
        self.bucket_edges_s = bucket_edges(self.profiles)
        self.engine_path = Path(engine_path)
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with torch.cuda.device(self.device):
            self._engine = self._runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
            if self._engine is None:
                raise EngineBuildError(f"TensorRT could not load {self.engine_path}: delete it to rebuild")
            if self._engine.num_optimization_profiles != len(self.profiles):
                raise ValueError(f"{self.engine_path} has {self._engine.num_optimization_profiles} profiles, "
                                 f"expected {len(self.profiles)}")
            self._context = self._engine.create_execution_context()
            self._stream = torch.cuda.Stream(self.device)
        names = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)}
        if names != set(INPUTS + OUTPUTS):
            raise ValueError(f"{self.engine_path} has tensors {sorted(names)}, expected {sorted(INPUTS + OUTPUTS)}: "
                             "delete it to rebuild")
        self._dtypes = {n: _torch_dtype(trt, self._engine.get_tensor_dtype(n)) for n in INPUTS + OUTPUTS}
        self._active: int | None = None  # the context's optimization profile
        self._fallback = FallbackLog(self.name)

    @classmethod
    def from_nemo(cls, nemo_path: str | os.PathLike, encoder: ConformerEncoder, profiles: Sequence[BucketProfile],
                  precision: str = "fp16", cache_dir: str | os.PathLike | None = None) -> "TensorRTEncoder":
        """Load the cached engine for this model and GPU, building it first (minutes) if missing."""
        device = encoder.pos_enc.pe.device
        path, built = ensure_engine(nemo_path, profiles, encoder.cfg.feat_in, precision, cache_dir, device)
        log.info("TensorRT encoder engine %s %s", "built:" if built else "from cache:", path)
        return cls(path, profiles, encoder, precision)

    @torch.inference_mode()
    def reserve(self, max_items: int) -> None:
        """Startup: check every profile against the eager encoder (the engine itself was built or
        loaded when this backend was made)."""
        why = check_profiles(self._run, self.encoder, self.profiles, ENGINE_CHECK_RTOL[self.precision])
        if why is not None:
            self.off = turned_off(f"{self.name} encoder {self.engine_path}", why)

    def __call__(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, n_mels, W] float32, lengths [B] int64 -> ([B, D, T'] float32, [B] int64)."""
        if self.off is not None:
            return self.encoder(features, lengths)
        p = pick_profile(self.profiles, features.size(2))
        if p is None:
            self._fallback(features.shape, f"is wider than the widest profile ({self.profiles[-1].frames} frames)")
            return self.encoder(features, lengths)
        return in_chunks(lambda f, n: self._run(self.profiles.index(p), f, n), features, lengths, p.max_batch)

    def _run(self, profile: int, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            # Converted on the current stream, before the engine's stream waits for it.
            inputs = {"features": aligned(features.to(self._dtypes["features"]).contiguous()),
                      "lengths": aligned(lengths.to(self._dtypes["lengths"]).contiguous())}
            self._stream.wait_stream(current)
            outputs = self._enqueue(profile, inputs, self._stream.cuda_stream)
            # Later work on the current stream (reading the outputs, reusing the freed inputs'
            # memory, which torch's allocator hands out in that stream's order) waits for the engine.
            current.wait_stream(self._stream)
        encoded, encoded_lengths = outputs["encoded"], outputs["encoded_lengths"]
        return encoded.float(), encoded_lengths.to(torch.int64)

    def _enqueue(self, profile: int, inputs: dict[str, Tensor], stream: int) -> dict[str, Tensor]:
        """Bind `inputs` and fresh outputs and enqueue the engine on `stream` (no host sync)."""
        ctx = self._context
        if profile != self._active:
            if not ctx.set_optimization_profile_async(profile, stream):
                raise RuntimeError(f"TensorRT refused optimization profile {profile}")
            self._active = profile
        for name, t in inputs.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(f"TensorRT rejected {name} shape {list(t.shape)} for profile {profile}")
        # Output shapes follow from the input shapes on the host. Allocated for the current
        # stream and written on the engine's: nothing else touches them before it has waited.
        outputs = {n: torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=self._dtypes[n], device=self.device)
                   for n in OUTPUTS}
        for name, t in {**inputs, **outputs}.items():
            if not ctx.set_tensor_address(name, t.data_ptr()):
                raise RuntimeError(f"TensorRT refused the address of {name}")
        if not ctx.execute_async_v3(stream):
            raise RuntimeError("TensorRT failed to enqueue the encoder engine")
        return outputs
