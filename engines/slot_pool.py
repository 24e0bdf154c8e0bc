"""What every streaming pool shares: slot bookkeeping and the per-slot transducer decoder state.

`SlotPool` hands out and takes back slot indices of a pool preallocated for `max_streams`
streams; a subclass resets its own per-slot tensors in `_reset`. `DecoderSlots` holds what a
stream's greedy decoding carries from one chunk to the next and continues it over a new chunk
of encoder frames with the offline label-looping stage functions (`engines.decode_stages`):

    h, c      [Lr, S, H]  prediction-net LSTM state after the stream's last label
    pred_out  [S, J]      projected prediction-net output for that label
    time_jump [S]         frames the last chunk's final step jumped past its end (TDT: a label
                          or blank whose predicted duration overshoots the chunk; the next chunk
                          starts decoding that many frames in, as NeMo's `time_jumps`)
    frames    [S]         encoder frames decoded so far (token frames are stream-absolute)

Both the cache-aware pool (`engines.stream_pool`) and the chunked one (`engines.chunked_pool`)
use these, so RNN-T and TDT decode the same way in either, in the offline decoder's modes
(`engines.slot_decode`: eager on the CPU, the full graph on CUDA).
"""
from __future__ import annotations

import torch
from torch import Tensor

from engines.cpu_threads import decoder_threads
from engines.decode_stages import Hypothesis
from engines.slot_decode import SlotGraphDecoder
from engines.transducer import TransducerDecoder


class PoolExhausted(RuntimeError):
    """All `max_streams` slots are in use."""


class SlotPool:
    """Slot indices 0 .. max_streams-1; `acquire` takes one, `release` resets and returns it."""

    def __init__(self, max_streams: int):
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.max_streams = max_streams
        self._free = list(range(max_streams - 1, -1, -1))  # pop() hands out slot 0 first

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

    def reset(self, slot: int) -> None:
        """The slot's state back to a new stream's, whoever holds it: `transcribe serve`'s engine
        process resets the slots its server process released (which hands out the indices)."""
        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} is outside the pool (0..{self.max_streams - 1})")
        self._reset(slot)

    def _reset(self, slot: int) -> None:
        raise NotImplementedError  # each pool resets its own per-slot tensors


class DecoderSlots:
    """Per-slot decoder state of a pool (see the module docstring) and its continuation, in the
    decoder `mode` (`engines.slot_decode`: auto = eager on the CPU, graphs on CUDA, built now
    for steps of up to `max_streams` rows of `max_frames` encoder frames when that is given)."""

    def __init__(self, decoder: TransducerDecoder, max_streams: int, max_frames: int | None = None,
                 mode: str = "auto"):
        self.decoder = decoder
        ref = next(iter(decoder.joint.parameters()))
        self.device, self.dtype = ref.device, ref.dtype
        self.graphs = SlotGraphDecoder(decoder.prediction, decoder.joint, decoder.config)
        self.graphs.set_mode(mode, self.device)
        if max_frames is not None:
            self.graphs.prepare(max_streams, max_frames, self.dtype, self.device)
        with torch.inference_mode():
            self._sos = self._prime()  # (h, c, pred_out) after the blank (SOS) symbol, batch 1
        h0, c0, g0 = self._sos
        self.h = h0.repeat(1, max_streams, 1)
        self.c = c0.repeat(1, max_streams, 1)
        self.pred_out = g0.repeat(max_streams, 1)
        self.time_jump = torch.zeros(max_streams, dtype=torch.int64, device=self.device)
        self.frames = torch.zeros(max_streams, dtype=torch.int64, device=self.device)

    def _prime(self) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.decoder.config
        sos = torch.full((1,), cfg.blank_id, dtype=torch.long, device=self.device)
        hc0 = torch.zeros(cfg.pred_rnn_layers, 1, cfg.pred_hidden, dtype=self.dtype, device=self.device)
        out, (h, c) = self.decoder.prediction.step(sos, (hc0, hc0.clone()))
        return h, c, self.decoder.joint.pred(out)

    def reset(self, slot: int) -> None:
        h0, c0, g0 = self._sos
        self.h[:, slot] = h0[:, 0]
        self.c[:, slot] = c0[:, 0]
        self.pred_out[slot] = g0[0]
        self.time_jump[slot] = 0
        self.frames[slot] = 0

    @torch.inference_mode()  # as offline decoding, where the graphs are captured in it too
    def decode(self, idx: Tensor, enc: Tensor, enc_len: Tensor) -> list[Hypothesis]:
        """Label-looping over enc [B, T, D] (row b = slot idx[b], enc_len[b] valid frames),
        continuing each slot's state; returns the NEW tokens with stream-absolute frames."""
        enc_len = enc_len.to(device=self.device, dtype=torch.long)
        enc_proj = self.decoder.joint.enc(enc)
        # The token loop with the decoder's CPU threads (1 until measured), as offline: in `serve`
        # the event loop shares the cores, and with all threads the 100-stream CPU load's
        # decoder stage took 4.8-5.2 s instead of 3.9-4.1 (each small op ends in a barrier).
        # (the state's gathers and scatters too: small ops, as the loop's)
        with decoder_threads(self.device, self.decoder.cpu_threads):
            hyps, (h, c, pred_out, time) = self.graphs.resume(
                enc_proj, enc_len, self.h.index_select(1, idx), self.c.index_select(1, idx),
                self.pred_out.index_select(0, idx), self.time_jump.index_select(0, idx))
            self.h.index_copy_(1, idx, h)  # same as: h[:, idx] = h
            self.c.index_copy_(1, idx, c)
            self.pred_out.index_copy_(0, idx, pred_out)
            # Every row ends inactive (time >= length): what is past the end starts the next chunk.
            self.time_jump.index_copy_(0, idx, time - enc_len)  # same as: time_jump[idx] = time - len
            offsets = self.frames.index_select(0, idx).tolist()
            self.frames.index_add_(0, idx, enc_len)  # same as: frames[idx] += enc_len
        return [Hypothesis(h.tokens, [f + off for f in h.frames], h.durations) for h, off in zip(hyps, offsets)]
