"""The encoder in PyTorch: eager (`torch`), or through `torch.compile` (`compile`).

Eager is the reference every other backend is tested against. On the CPU it keeps the
oneDNN-packed linears (`engines.fast_linear`), which is where the CPU time goes; on CUDA it
runs cuBLAS/cuDNN kernels one op at a time.

`compile` is for CUDA: Inductor fuses the elementwise work around the GEMMs (masks, SiLU,
GLU, residual adds, layer norms), which on a GPU is a real share of the encoder's time. It
needs plain `nn.Linear`s (dynamo cannot trace the opaque oneDNN weight tensors), so on the CPU
it gives up the packed GEMMs that make the eager CPU path fast: there it is only for
experiments. Shapes are marked dynamic (batch and width vary per bucket), so one compiled
graph serves every bucket instead of one recompilation per shape; the first call of a new
shape family still pays a compile (tens of seconds for a 0.6B model). `reserve` compiles at
startup, on a seeded check batch per profile, and checks the compiled encoder against eager
(`encoder_backend.check_profiles`): one that fails to compile or disagrees is turned off, and
the encoder runs eagerly, logged once with the reason.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from engines.conformer import ConformerEncoder
from engines.encoder_backend import FUSED_CHECK_RTOL, BucketProfile, bucket_edges, check_profiles, turned_off
from engines.fast_linear import PackedLinear


class TorchEncoder:
    """`ConformerEncoder` behind the backend interface (`engines.encoder_backend.EncoderBackend`)."""

    def __init__(self, encoder: ConformerEncoder, profiles: Sequence[BucketProfile], compile: bool = False):
        self.encoder = encoder
        self.profiles = tuple(profiles)
        self.bucket_edges_s = bucket_edges(self.profiles)
        self.name = "compile" if compile else "torch"
        self._compiled = None
        self.off: str | None = None  # compile: why the compiled encoder is not used
        if compile:
            if any(isinstance(m, PackedLinear) for m in encoder.modules()):
                raise ValueError("encoder backend 'compile' needs plain linears: build the encoder with "
                                 "pack_linears=False (torch.compile cannot trace oneDNN-packed weights)")
            # dynamic=True: batch and width change per bucket; static=True: no host syncs or
            # data-dependent branches, so the forward is one graph without breaks.
            self._compiled = torch.compile(encoder, dynamic=True)

    def __call__(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, n_mels, W] float, lengths [B] int64 -> ([B, D, T'], [B] int64)."""
        if self._compiled is None:
            return self.encoder(features, lengths)
        return self._compiled(features, lengths, static=True)

    @torch.inference_mode()
    def reserve(self, max_items: int) -> None:
        """compile: compile now and check each profile's seeded batch against eager (see the
        module docstring; dynamic shapes keep it to the one compile the first call makes anyway).
        Eager needs no warm-up."""
        if self._compiled is None:
            return
        compiled = self._compiled
        try:
            why = check_profiles(lambda _, f, n: compiled(f, n, static=True), self.encoder, self.profiles,
                                 FUSED_CHECK_RTOL[self.encoder.dtype])
        except Exception as e:  # dynamo / Inductor raise many types (BackendCompilerFailed, Unsupported, ...)
            why = f"it failed to compile: {type(e).__name__}: {e}"
        if why is not None:
            self._compiled, self.off = None, turned_off(f"{self.name} encoder", why)
