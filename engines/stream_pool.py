"""One preallocated pool of `max_streams` streaming slots: encoder caches + decoder state.

A slot holds everything a stream carries from one chunk to the next:

    att   [L, S, C, D]   attention caches        h, c      [Lr, S, H]  prediction-net LSTM state
    conv  [L, S, K-1, D] depthwise-conv caches   pred_out  [S, J]      projected last prediction
    att_len [S]          valid attention cache   frames    [S]         encoder frames decoded so far

`step` batches any set of slots, whatever their positions: it gathers their rows by index,
runs one `CacheAwareEncoder.step` (each row attends over its own valid cache only) and the
offline decoder's label-looping stages continuing from each row's own LSTM state and last
label, then scatters the rows back. Slots are handed out by `acquire` and returned by
`release`, which also resets them, so a finished, failed or vanished stream leaves no state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engines.decode_stages import DecodeState, Hypothesis, collect, run_label_looping
from engines.streaming_encoder import CacheAwareEncoder, EncoderCaches
from engines.transducer import TransducerDecoder


@dataclass(frozen=True)
class ChunkInput:
    """One stream's chunk: features [n_mels, F] (pre-encode cache frames first), `first` when
    this is the stream's first chunk (no pre-encode cache, nothing dropped)."""

    slot: int
    features: Tensor
    first: bool


class PoolExhausted(RuntimeError):
    """All `max_streams` slots are in use."""


class StreamPool:
    """Slot-indexed state for up to `max_streams` concurrent streams; see the module docstring."""

    def __init__(self, encoder: CacheAwareEncoder, decoder: TransducerDecoder, max_streams: int):
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.encoder, self.decoder = encoder, decoder
        self.max_streams = max_streams
        dcfg = decoder.config
        if dcfg.is_tdt:
            raise ValueError("streaming decoding supports RNN-T transducers only (this checkpoint is TDT)")
        ref = next(iter(decoder.joint.parameters()))
        self.device, self.dtype = ref.device, ref.dtype
        init = encoder.initial_caches(max_streams, self.device, self.dtype)
        self.att, self.conv, self.att_len = init.att, init.conv, init.att_len
        with torch.inference_mode():
            self._sos = self._prime()  # (h, c, pred_out) after the blank (SOS) symbol, batch 1
        h0, c0, g0 = self._sos
        self.h = h0.repeat(1, max_streams, 1)
        self.c = c0.repeat(1, max_streams, 1)
        self.pred_out = g0.repeat(max_streams, 1)
        self.frames = torch.zeros(max_streams, dtype=torch.int64, device=self.device)
        self._free = list(range(max_streams - 1, -1, -1))  # pop() hands out slot 0 first

    def _prime(self) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.decoder.config
        sos = torch.full((1,), cfg.blank_id, dtype=torch.long, device=self.device)
        hc0 = torch.zeros(cfg.pred_rnn_layers, 1, cfg.pred_hidden, dtype=self.dtype, device=self.device)
        out, (h, c) = self.decoder.prediction.step(sos, (hc0, hc0.clone()))
        return h, c, self.decoder.joint.pred(out)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A fresh slot index; PoolExhausted when all are taken (callers queue and retry)."""
        if not self._free:
            raise PoolExhausted(f"all {self.max_streams} stream slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Reset the slot and return it (idempotent: a slot already free is left alone)."""
        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} is outside the pool (0..{self.max_streams - 1})")
        if slot in self._free:
            return
        self._reset(slot)
        self._free.append(slot)

    def _reset(self, slot: int) -> None:
        h0, c0, g0 = self._sos
        self.att[:, slot].zero_()
        self.conv[:, slot].zero_()
        self.att_len[slot] = 0
        self.h[:, slot] = h0[:, 0]
        self.c[:, slot] = c0[:, 0]
        self.pred_out[slot] = g0[0]
        self.frames[slot] = 0

    @torch.inference_mode()
    def step(self, chunks: Sequence[ChunkInput]) -> list[Hypothesis]:
        """Encode and decode one chunk for each of `chunks` (distinct slots) in one batch.

        Returns per chunk the NEW tokens, with `frames` counted from the stream's start."""
        if not chunks:
            return []
        idx = torch.tensor([ch.slot for ch in chunks], dtype=torch.int64, device=self.device)
        feats, lengths = _pad([ch.features for ch in chunks], self.device)
        drop = torch.tensor([0 if ch.first else self.encoder.cfg.drop_extra for ch in chunks],
                            dtype=torch.int64, device=self.device)
        caches = EncoderCaches(self.att.index_select(1, idx), self.conv.index_select(1, idx),
                               self.att_len.index_select(0, idx))
        enc, enc_len, nxt = self.encoder.step(feats, lengths, drop, caches)
        self.att.index_copy_(1, idx, nxt.att)  # same as: att[:, idx] = nxt.att
        self.conv.index_copy_(1, idx, nxt.conv)
        self.att_len.index_copy_(0, idx, nxt.att_len)
        hyps = self._decode(idx, enc, enc_len)
        offsets = self.frames.index_select(0, idx).tolist()
        self.frames.index_add_(0, idx, enc_len)  # same as: frames[idx] += enc_len
        return [Hypothesis(h.tokens, [f + off for f in h.frames], h.durations) for h, off in zip(hyps, offsets)]

    def _decode(self, idx: Tensor, enc: Tensor, enc_len: Tensor) -> list[Hypothesis]:
        """Label-looping stages over enc [B, T, D], continuing each row's decoder state."""
        dec = self.decoder
        enc_proj = dec.joint.enc(enc)  # [B, T, J]
        state = continue_state(enc_proj, enc_len, self.h.index_select(1, idx), self.c.index_select(1, idx),
                               self.pred_out.index_select(0, idx), dec.config.blank_id, dec.config.max_symbols)
        run_label_looping(state, dec.prediction, dec.joint, dec.config)
        self.h.index_copy_(1, idx, state.h)  # same as: h[:, idx] = state.h
        self.c.index_copy_(1, idx, state.c)
        self.pred_out.index_copy_(0, idx, state.pred_out)
        return collect(state, with_durations=False)


def continue_state(enc_proj: Tensor, lengths: Tensor, h: Tensor, c: Tensor, pred_out: Tensor,
                   blank_id: int, max_symbols: int) -> DecodeState:
    """A `DecodeState` over a new chunk that starts from each row's previous decoder state
    (LSTM h, c [Lr, B, H] and projected prediction pred_out [B, J] after its last label)
    instead of priming with SOS. enc_proj [B, T, J], lengths [B] valid frames."""
    B, T, _ = enc_proj.shape
    dev = enc_proj.device
    lengths = lengths.to(device=dev, dtype=torch.long)
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    no = torch.zeros(B, dtype=torch.bool, device=dev)
    capacity = T * max_symbols + 1
    return DecodeState(
        enc_proj=enc_proj, lengths=lengths, last_frame=(lengths - 1).clamp(min=0),
        batch_idx=torch.arange(B, device=dev), duration_table=torch.zeros(0, dtype=torch.long, device=dev),
        time=zeros.clone(), safe_time=zeros.clone(), label_time=zeros.clone(),
        labels=torch.full((B,), blank_id, dtype=torch.long, device=dev), step_durations=zeros.clone(),
        active=lengths > 0, active_prev=no.clone(), advance=no.clone(), found=no.clone(),
        pred_out=pred_out, h=h, c=c,
        tokens=torch.zeros(B, capacity, dtype=torch.long, device=dev),
        frames=torch.zeros(B, capacity, dtype=torch.long, device=dev),
        durations=torch.zeros(B, capacity, dtype=torch.long, device=dev),
        count=zeros.clone(), last_emit_frame=torch.full_like(zeros, -1), same_frame_count=zeros.clone(),
    )


def _pad(features: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """[n_mels, F_i] -> zero-padded [B, n_mels, max F] and lengths [B] (int64)."""
    lengths = torch.tensor([f.shape[1] for f in features], dtype=torch.int64)
    batch = torch.zeros(len(features), features[0].shape[0], max(int(lengths.max()), 1), device=device)
    for i, f in enumerate(features):
        batch[i, :, : f.shape[1]] = f
    return batch, lengths.to(device)
