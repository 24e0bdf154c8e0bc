"""One preallocated pool of `max_streams` cache-aware streaming slots: encoder caches + decoder state.

A slot holds everything a stream carries from one chunk to the next:

    att   [L, S, C, D]   attention caches        decoder state (h, c, pred_out, time_jump,
    conv  [L, S, K-1, D] depthwise-conv caches   frames): `engines.slot_pool.DecoderSlots`
    att_len [S]          valid attention cache

`step` batches any set of slots, whatever their positions: it gathers their rows by index,
runs one `CacheAwareEncoder.step` (each row attends over its own valid cache only) and the
offline decoder's label-looping stages continuing from each row's own decoder state (RNN-T or
TDT), then scatters the rows back. With `attention_kernel="triton"` (picked by "auto" on CUDA)
the attention caches are not gathered: the fused Triton kernel reads them by slot and updates
them in place (`CacheAwareEncoder.step_in_pool`). Before the pool picks the kernel, one seeded
step through it must match the gather path's (`kernel_disagrees`, which also compiles it); if it
fails to build later, at runtime, the pool falls back to the gather path for good, with one
warning. Slots are handed out by `acquire` and returned by `release`, which also resets them,
so a finished, failed or vanished stream leaves no state.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engines.cpu_threads import decoder_threads, fastest_threads
from engines.decode_stages import Hypothesis
from engines.encoder_backend import FUSED_CHECK_RTOL, relative_error
from engines.slot_pool import DecoderSlots, PoolExhausted, SlotPool
from engines.stage_times import StageTimes
from engines.stream_attention_triton import KernelUnavailable, kernel_unusable, triton_available
from engines.streaming_encoder import CacheAwareEncoder, EncoderCaches
from engines.transducer import TransducerDecoder

__all__ = ["ChunkInput", "PoolExhausted", "StreamPool", "pad_features"]

log = logging.getLogger("transcribe")
ATTENTION_KERNELS = ("auto", "triton", "torch")
STEP_THREADS_BATCH = 2  # chunks in the step that measures encoder_step_threads: a real-time server's usual step


@dataclass(frozen=True)
class ChunkInput:
    """One stream's chunk: features [n_mels, F] (pre-encode cache frames first), `first` when
    this is the stream's first chunk (no pre-encode cache, nothing dropped)."""

    slot: int
    features: Tensor
    first: bool


class StreamPool(SlotPool):
    """Slot-indexed state for up to `max_streams` concurrent streams; see the module docstring."""

    def __init__(self, encoder: CacheAwareEncoder, decoder: TransducerDecoder, max_streams: int,
                 attention_kernel: str = "auto"):
        """attention_kernel: "torch" (gather the caches, `CacheAwareEncoder.step`), "triton" (the
        fused kernel; ValueError if it cannot run here: it needs CUDA, or TRITON_INTERPRET=1 for
        CPU tensors, and plain nn.Linear attention weights) or "auto" (triton on CUDA when it can
        run, else torch). The choice is `self.attention_kernel`."""
        super().__init__(max_streams)
        self.encoder = encoder
        # A chunk step decodes at most valid_out_len encoder frames a stream (the decoder's
        # graphs, on CUDA, are built for that now).
        self.dec = DecoderSlots(decoder, max_streams, encoder.cfg.valid_out_len)
        self.device = self.dec.device
        self.stage_seconds = StageTimes(self.device)  # per step: batch, encoder, decoder
        init = encoder.initial_caches(max_streams, self.device)  # in the encoder's compute dtype
        self.att, self.conv, self.att_len = init.att, init.conv, init.att_len
        self.attention_kernel = self._pick_kernel(attention_kernel)
        self.encoder_threads = encoder_step_threads(encoder, self.device)

    def _pick_kernel(self, request: str) -> str:
        if request not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {request!r}")
        if request == "torch":
            return "torch"
        on_cuda = torch.device(self.device).type == "cuda"
        if request == "auto" and not on_cuda:  # auto never picks the interpreter: the CPU path stays as is
            log.debug("streaming attention: torch (the fused kernel is for CUDA)")
            return "torch"
        reason = (kernel_unusable([layer.self_attn for layer in self.encoder.encoder.layers], self.device,
                                  self.att.dtype)
                  or kernel_disagrees(self.encoder, self.device))
        if reason is None:
            log.info("streaming attention: fused Triton kernel (%s)", "auto" if request == "auto" else "requested")
            return "triton"
        if request == "triton":
            raise ValueError(f"attention_kernel='triton' cannot run: {reason}")
        level = logging.WARNING if triton_available() else logging.INFO  # no triton: an expected setup
        log.log(level, "streaming attention: torch, the fused Triton kernel is off: %s", reason)
        return "torch"

    def _reset(self, slot: int) -> None:
        self.att[:, slot].zero_()
        self.conv[:, slot].zero_()
        self.att_len[slot] = 0
        self.dec.reset(slot)

    @torch.inference_mode()
    def step(self, chunks: Sequence[ChunkInput]) -> list[Hypothesis]:
        """Encode and decode one chunk for each of `chunks` (distinct slots) in one batch.

        Returns per chunk the NEW tokens, with `frames` counted from the stream's start."""
        if not chunks:
            return []
        t = time.perf_counter()
        # The gathers and pads of a step are tens of KB: on the CPU more threads only add an
        # OpenMP barrier to each, which on a loaded machine waits for a descheduled thread (100
        # real-time 60 s streams on the 2-core VM: this stage 2.6-2.7 s with both, 0.36-0.39 s with one).
        with decoder_threads(self.device, 1):
            idx = torch.tensor([ch.slot for ch in chunks], dtype=torch.int64, device=self.device)
            feats, lengths = pad_features([ch.features for ch in chunks], self.device)
            drop = torch.tensor([0 if ch.first else self.encoder.cfg.drop_extra for ch in chunks],
                                dtype=torch.int64, device=self.device)
            att_len = self.att_len.index_select(0, idx)
        t = self.stage_seconds.lap("batch", t)
        if self.attention_kernel == "triton":
            try:
                enc, enc_len, new_len = self.encoder.step_in_pool(feats, lengths, drop, self.att, self.conv,
                                                                  idx, att_len)
            except KernelUnavailable as e:  # raised before any cache write: redo the step gathered
                log.warning("fused Triton streaming attention failed, using torch from now on: %s", e)
                self.attention_kernel = "torch"
            else:
                self.att_len.index_copy_(0, idx, new_len)
                return self._decode(idx, enc, enc_len, self.stage_seconds.lap("encoder", t))
        with decoder_threads(self.device, 1):
            caches = EncoderCaches(self.att.index_select(1, idx), self.conv.index_select(1, idx), att_len)
        with decoder_threads(self.device, self.encoder_threads):
            enc, enc_len, nxt = self.encoder.step(feats, lengths, drop, caches)
        with decoder_threads(self.device, 1):
            self.att.index_copy_(1, idx, nxt.att)  # same as: att[:, idx] = nxt.att
            self.conv.index_copy_(1, idx, nxt.conv)
            self.att_len.index_copy_(0, idx, nxt.att_len)
        return self._decode(idx, enc, enc_len, self.stage_seconds.lap("encoder", t))

    def _decode(self, idx: Tensor, enc: Tensor, enc_len: Tensor, t: float) -> list[Hypothesis]:
        hyps = self.dec.decode(idx, enc, enc_len)
        self.stage_seconds.lap("decoder", t)
        return hyps


def encoder_step_threads(encoder: CacheAwareEncoder, device: torch.device | str,
                         batch: int = STEP_THREADS_BATCH) -> int | None:
    """The CPU intra-op thread count for encoder steps (None on CUDA: unchanged), measured once
    at startup as the decoder's is (`engines.cpu_threads.fastest_threads`): all threads only if
    they run a seeded step of `batch` later chunks at least 15 % faster than one. A real-time
    server's step holds a chunk or two: on the 2-core VM the tiny cache-aware model ran such a
    step as fast with one thread (4.7 ms either way at 1 chunk, 1.05x at 2), and with two its
    100-stream load lost to one thread in 4 of 4 paired runs on a busy machine (final p95
    330-702 ms against 222-362), the event loop sharing the cores. A big model's step, whose
    GEMMs do gain from threads, keeps them."""
    if torch.device(device).type != "cpu":
        return None
    cfg = encoder.cfg
    gen = torch.Generator().manual_seed(0)
    width = cfg.pre_encode_cache[1] + cfg.chunk_frames[1]
    features = torch.randn(batch, encoder.encoder.cfg.feat_in, width, generator=gen)
    lengths = torch.full((batch,), width, dtype=torch.int64)
    drop = torch.full((batch,), cfg.drop_extra, dtype=torch.int64)

    @torch.inference_mode()
    def step() -> None:
        caches = encoder.initial_caches(batch, device)  # scratch: the pool's own are not touched
        caches.att_len.fill_(cfg.att_cache)
        encoder.step(features, lengths, drop, caches)

    return fastest_threads(step)


@torch.inference_mode()
def kernel_disagrees(encoder: CacheAwareEncoder, device: torch.device | str) -> str | None:
    """One seeded step through the fused kernel (`step_in_pool`) and through the gather path
    (`step`) on scratch caches of 3 rows -> why they differ (encodings, next attention and conv
    caches, next valid lengths), or None. The rows cover every mask: a later chunk over a full
    attention cache, a later chunk a third shorter over half a cache, and a stream's first chunk
    over an empty one. The kernels are built (JIT-compiled) here, at startup, rather than in the
    first real step. The pool's own caches are not touched."""
    cfg = encoder.cfg
    gen = torch.Generator(device=device).manual_seed(0)
    caches = encoder.initial_caches(3, device)
    caches.att[:, :2].normal_(generator=gen)
    caches.conv[:, :2].normal_(generator=gen)
    caches.att_len.copy_(torch.tensor([cfg.att_cache, cfg.att_cache // 2, 0]))
    n_mels = encoder.encoder.cfg.feat_in
    later, first = cfg.pre_encode_cache[1] + cfg.chunk_frames[1], cfg.chunk_frames[0]
    widths = (later, later - cfg.chunk_frames[1] // 3, first)
    features, lengths = pad_features([torch.randn(n_mels, w, generator=gen, device=device) for w in widths], device)
    drop = torch.tensor([cfg.drop_extra, cfg.drop_extra, 0], device=device)
    want, want_len, nxt = encoder.step(features, lengths, drop, caches)
    att, conv = caches.att.clone(), caches.conv.clone()
    try:
        got, got_len, got_att_len = encoder.step_in_pool(features, lengths, drop, att, conv,
                                                          torch.arange(3, device=device), caches.att_len)
    except KernelUnavailable as e:
        return f"the fused kernel failed to build: {e}"
    if not (torch.equal(got_len, want_len) and torch.equal(got_att_len, nxt.att_len)):
        return (f"the fused step's valid lengths {got_len.tolist()}, {got_att_len.tolist()} differ from the "
                f"gather path's {want_len.tolist()}, {nxt.att_len.tolist()}")
    valid = (torch.arange(want.shape[1], device=device)[None, :] < want_len[:, None])[:, :, None]
    rtol = FUSED_CHECK_RTOL[caches.att.dtype]  # the kernel's fp32 dots run in IEEE fp32
    for name, err in (("encodings", relative_error(got, want, valid)), ("attention caches", relative_error(att, nxt.att)),
                      ("conv caches", relative_error(conv, nxt.conv))):
        if not err <= rtol:  # NaN too
            return f"the fused step's {name} differ from the gather path's: relative error {err:.2e} (tolerance {rtol:.0e})"
    return None


def pad_features(features: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """[n_mels, F_i] -> zero-padded [B, n_mels, max F] and lengths [B] (int64)."""
    lengths = torch.tensor([f.shape[1] for f in features], dtype=torch.int64)
    batch = torch.zeros(len(features), features[0].shape[0], max(int(lengths.max()), 1), device=device)
    for i, f in enumerate(features):
        batch[i, :, : f.shape[1]] = f
    return batch, lengths.to(device)
