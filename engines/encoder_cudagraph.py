"""The encoder as CUDA graphs, one per (batch, width) bucket, all in one memory pool.

Why: a FastConformer layer is ~40 kernels, so a small batch spends much of its time in
launches; a replayed graph launches them all at once. Pattern (nano-vllm `capture_cudagraph`):

- Buckets: for every length profile (`BucketProfile`: width W = its frames) the batch sizes
  1, 2, 4, 8, 16, 32, 48, ... up to its max_batch (`encoder_backend.batch_sizes`).
- Static buffers, allocated once for the largest bucket and viewed per bucket: features
  [b, n_mels, W], lengths [b], encoded [b, T', D] and encoded lengths [b]. A call copies its
  batch in, padded to the smallest bucket that fits (`encoder_backend.fill_bucket`: pad value,
  extra rows length 0), replays, and returns views of the outputs sliced back to its rows and
  frames (the same [B, D, T'] layout as eager: [B, T', D] memory, transposed). The views stay
  valid until the next call.
- One pool (`torch.cuda.graph_pool_handle`), captured largest first: graphs replay one at a
  time, so each graph's temporaries reuse the blocks of the largest; the outputs are copied
  into the static buffers inside the graph, so no graph keeps pool memory alive after capture.
- Captured at `reserve()` (startup, every bucket up to the pipeline's batch size), else lazily
  on a bucket's first use. Widths beyond the widest profile run eagerly (logged once); batches
  above a profile's max_batch run as chunks of max_batch rows.
- Checked at capture: the warm-up runs a seeded batch with varied lengths eagerly, the new graph
  replays it, and the two outputs must agree (`encoder_backend.disagreement`). A capture that
  fails or disagrees turns the graphs off: the encoder runs in eager torch from then on, logged
  once with the reason.

The forward is captured with `static=True` (`ConformerEncoder.forward`): no `.item()`, no
length checks on the host, masks always built. A reduced-precision encoder (bf16/fp16) is
captured the same way: its input and output casts are part of the forward, so of the graph.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from engines.conformer import ConformerEncoder
from engines.decode_modes import graph_capture, warm_up
from engines.encoder_backend import (BucketProfile, FallbackLog, batch_sizes, bucket_edges, disagreement,
                                     fill_bucket, fill_check_batch, in_chunks, output_frames, pick_bucket,
                                     pick_profile, turned_off)


class CudaGraphEncoder:
    """`ConformerEncoder` replayed from CUDA graphs (see the module docstring)."""

    name = "cuda-graphs"

    def __init__(self, encoder: ConformerEncoder, profiles: Sequence[BucketProfile], pad_value: float):
        device = encoder.pos_enc.pe.device
        if device.type != "cuda":
            raise ValueError(f"encoder backend 'cuda-graphs' needs the encoder on a CUDA device, not {device}")
        self.encoder, self.device, self.pad_value = encoder, device, pad_value
        self.profiles = tuple(profiles)
        self.bucket_edges_s = bucket_edges(self.profiles)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None  # one graph_pool_handle() for every graph, made at the first capture
        self._buffers: dict[str, Tensor] | None = None
        self._fallback = FallbackLog(self.name)
        self.off: str | None = None  # why the graphs are not used (a capture failed or disagreed)

    def buckets(self, max_items: int | None = None) -> list[tuple[int, int]]:
        """Every (batch, width) bucket, largest first; batch sizes capped at `max_items`."""
        out = []
        for p in self.profiles:
            sizes = batch_sizes(p.max_batch)
            cap = p.max_batch if max_items is None else min(p.max_batch, max_items)
            top = next(b for b in sizes if b >= cap)  # the bucket a batch of `cap` rows replays
            out += [(b, p.frames) for b in sizes if b <= top]
        return sorted(set(out), key=lambda k: (k[0] * k[1], k), reverse=True)

    @torch.inference_mode()
    def reserve(self, max_items: int) -> None:
        """Capture, at startup, every bucket a batch of up to `max_items` pieces can use."""
        for key in self.buckets(max_items):
            if self._graph(key) is None:
                return

    def __call__(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, n_mels, W] float32, lengths [B] int64 -> ([B, D, T'], [B] int64)."""
        b, _, w = features.shape
        p = pick_profile(self.profiles, w)
        if p is None:
            self._fallback(features.shape, f"is wider than the widest bucket ({self.profiles[-1].frames} frames)")
            return self.encoder(features, lengths)
        return in_chunks(self._replay, features, lengths, p.max_batch)

    def _replay(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        b, _, w = features.shape
        key = pick_bucket(self.profiles, b, w)
        graph = self._graph(key)
        if graph is None:
            return self.encoder(features, lengths)
        feats, lens, enc, elen = self._views(key)
        fill_bucket(feats, lens, features, lengths, self.pad_value)
        graph.replay()
        return enc[:b, : output_frames(self.encoder, w)].transpose(1, 2), elen[:b]

    def _views(self, key: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Contiguous views of the shared static buffers shaped for bucket `key`."""
        if self._buffers is None:
            self._buffers = self._allocate()
        rows, width = key
        n_mels, d = self.encoder.cfg.feat_in, self.encoder.cfg.d_model
        t = output_frames(self.encoder, width)
        buf = self._buffers
        return (buf["features"][: rows * n_mels * width].view(rows, n_mels, width), buf["lengths"][:rows],
                buf["encoded"][: rows * t * d].view(rows, t, d), buf["encoded_lengths"][:rows])

    def _allocate(self) -> dict[str, Tensor]:
        """Flat static buffers big enough for every bucket (outside the graph pool)."""
        keys = self.buckets()
        rows = max(b for b, _ in keys)
        n_mels, d = self.encoder.cfg.feat_in, self.encoder.cfg.d_model
        feats = max(b * n_mels * w for b, w in keys)
        enc = max(b * d * output_frames(self.encoder, w) for b, w in keys)
        # float32 whatever the encoder's compute dtype: its forward casts the features in and the
        # encodings out, so those casts are captured in the graph and the buffers keep the
        # backend interface (fp32 in, fp32 out); they are small next to the activations.
        # Normal tensors, not inference tensors: writable in place with inference mode on or off.
        with torch.inference_mode(False):
            return {"features": torch.empty(feats, dtype=torch.float32, device=self.device),
                    "lengths": torch.empty(rows, dtype=torch.int64, device=self.device),
                    "encoded": torch.empty(enc, dtype=torch.float32, device=self.device),
                    "encoded_lengths": torch.empty(rows, dtype=torch.int64, device=self.device)}

    def _graph(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph | None:
        """The graph of bucket `key`, captured (and checked) now if it was not yet; None once
        the graphs are off."""
        if self.off is not None:
            return None
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        try:
            graph, why = self._capture(key)
        except RuntimeError as e:  # torch's error type for a refused capture
            graph, why = None, f"capture failed ({e})"
        if why is not None:
            self.off = turned_off(f"{self.name} encoder", f"bucket {key}: {why}")
            self.graphs.clear()
            return None
        self.graphs[key] = graph
        return graph

    def _capture(self, key: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, str | None]:
        """Capture bucket `key` -> (graph, None), or (graph, why) when its replay of the check
        batch disagrees with the eager warm-up's output."""
        feats, lens, enc, elen = self._views(key)
        fill_check_batch(feats, lens)

        def step() -> None:
            out, out_len = self.encoder(feats, lens, static=True)
            enc.copy_(out.transpose(1, 2))
            elen.copy_(out_len)

        # Warm up on a side stream (cuBLAS/cuDNN handles and workspaces, lazy inits), as the
        # torch.cuda.graphs docs require, then capture into the shared pool.
        warm_up(self.device, step)
        want, want_len = enc.clone(), elen.clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the pipeline's pool thread keeps running during a lazy capture; its
        # (CUDA-free) work must not be able to invalidate this thread's capture.
        with graph_capture(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        enc.zero_()
        elen.zero_()
        graph.replay()
        return graph, disagreement(enc.transpose(1, 2), elen, want.transpose(1, 2), want_len)
