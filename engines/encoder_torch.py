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
shape family still pays a compile (tens of seconds for a 0.6B model).
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from engines.conformer import ConformerEncoder
from engines.encoder_backend import BucketProfile, bucket_edges
from engines.fast_linear import PackedLinear


class TorchEncoder:
    """`ConformerEncoder` behind the backend interface (`engines.encoder_backend.EncoderBackend`)."""

    def __init__(self, encoder: ConformerEncoder, profiles: Sequence[BucketProfile], compile: bool = False):
        self.encoder = encoder
        self.profiles = tuple(profiles)
        self.bucket_edges_s = bucket_edges(self.profiles)
        self.name = "compile" if compile else "torch"
        self._compiled = None
        if compile:
            if any(isinstance(m, PackedLinear) for m in encoder.modules()):
                raise ValueError("encoder backend 'compile' needs plain linears: build the encoder with "
                                 "pack_linears=False (torch.compile cannot trace oneDNN-packed weights)")
            import torch

            # dynamic=True: batch and width change per bucket; static=True: no host syncs or
            # data-dependent branches, so the forward is one graph without breaks.
            self._compiled = torch.compile(encoder, dynamic=True)

    def __call__(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, n_mels, W] float, lengths [B] int64 -> ([B, D, T'], [B] int64)."""
        if self._compiled is None:
            return self.encoder(features, lengths)
        return self._compiled(features, lengths, static=True)

    def reserve(self, max_items: int) -> None:
        """Nothing to prepare: eager needs no warmup, and compiling at startup would only move the
        first call's compile time."""
