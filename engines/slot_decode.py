"""Decoding a streaming step's chunks from each stream's own decoder state, in any decoder mode.

A step decodes, for every stream that has a chunk ready, its new encoder frames, continuing
from the state its previous chunk left (`engines.slot_pool.DecoderSlots`): LSTM h, c and the
projected prediction after its last label, and TDT's overshoot past the previous chunk's end
(`time_jump`). That is the offline label-looping decode with another start: instead of clearing
the state and priming the prediction network with SOS, the loop starts from those tensors.

- eager: `continue_state` then `run_label_looping` (the only mode on the CPU).
- full-graph / unrolled: the offline decoder's graphs (`engines.decode_graphs`) over
  `ResumingState`, whose captured start copies each row's state in from static inputs. Eager
  label looping syncs with the host twice per outer step and launches every stage's kernels
  one by one; a streaming step decodes only chunk + right frames, so launches and syncs, not
  arithmetic, are its cost on a GPU.

The graphs are built (captured) for [max_streams, frames of the longest chunk] when the pool is
made (`prepare`), not in a step; rows past a step's batch get length 0, inactive from the start.
As offline, a capture's first batch is checked against eager and a mode that disagrees or
fails falls back to the next (full-graph -> unrolled -> eager), logged once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.decode_graphs import GraphDecoder, StaticState
from engines.decode_modes import DecodeMode
from engines.decode_stages import (DecodeBuffers, DecodeState, Hypothesis, clear_state, collect, run_label_looping,
                                   state_view)

if TYPE_CHECKING:
    from engines.transducer import TransducerConfig

# What a resumed decode leaves for the stream's next chunk: h, c [Lr, B, H], pred_out [B, J] and
# time [B] (the frame each row stopped at, at or past its length).
FinalState = tuple[Tensor, Tensor, Tensor, Tensor]


def resume_state(state: DecodeState, h: Tensor, c: Tensor, pred_out: Tensor, time_jump: Tensor) -> None:
    """Start a cleared state (`clear_state`) from each row's previous decoder state instead of
    SOS, at frame time_jump [B]. Capture-safe: copies and elementwise ops only."""
    state.h.copy_(h)
    state.c.copy_(c)
    state.pred_out.copy_(pred_out)
    state.time.copy_(time_jump)
    torch.minimum(state.time, state.last_frame, out=state.safe_time)
    torch.less(state.time, state.lengths, out=state.active)


def continue_state(enc_proj: Tensor, lengths: Tensor, h: Tensor, c: Tensor, pred_out: Tensor,
                   time_jump: Tensor, cfg: "TransducerConfig") -> DecodeState:
    """A fresh `DecodeState` over a new chunk that starts from each row's previous decoder state
    (LSTM h, c [Lr, B, H], projected prediction pred_out [B, J] after its last label) at frame
    time_jump [B] (0 unless the previous chunk's last TDT step overshot its end). enc_proj
    [B, T, J], lengths [B] valid frames. The max_symbols counters start afresh, as in NeMo."""
    B, T, J = enc_proj.shape
    state = state_view(DecodeBuffers(B, T, cfg, J, enc_proj.dtype, enc_proj.device), enc_proj)
    clear_state(state, lengths.to(device=enc_proj.device, dtype=torch.long), cfg)
    resume_state(state, h, c, pred_out, time_jump)
    return state


class ResumingState(StaticState):
    """`StaticState` whose captured start resumes each row from static inputs h_in, c_in,
    pred_in and jump_in (filled by `load_resuming`) instead of priming with SOS."""

    def __init__(self, prediction, joint, cfg: "TransducerConfig", max_batch: int, max_frames: int,
                 dtype: torch.dtype, device: torch.device):
        hc = (cfg.pred_rnn_layers, max_batch, cfg.pred_hidden)
        self.h_in = torch.zeros(hc, dtype=dtype, device=device)
        self.c_in = torch.zeros(hc, dtype=dtype, device=device)
        self.pred_in = torch.zeros(max_batch, joint.pred.weight.shape[0], dtype=dtype, device=device)
        self.jump_in = torch.zeros(max_batch, dtype=torch.long, device=device)
        super().__init__(prediction, joint, cfg, max_batch, max_frames, dtype, device)

    def _start(self) -> None:
        clear_state(self.state, self.len_in, self.cfg)
        resume_state(self.state, self.h_in, self.c_in, self.pred_in, self.jump_in)

    def load_resuming(self, enc_proj: Tensor, lengths: Tensor, h: Tensor, c: Tensor, pred_out: Tensor,
                      time_jump: Tensor) -> None:
        B = enc_proj.shape[0]
        self.load(enc_proj, lengths)
        self.h_in[:, :B].copy_(h)
        self.c_in[:, :B].copy_(c)
        self.pred_in[:B].copy_(pred_out)
        self.jump_in[:B].copy_(time_jump)
        self.jump_in[B:].zero_()

    def final(self, batch: int) -> FinalState:
        """Views of the first `batch` rows' final state: valid until the next decode."""
        st = self.state
        return st.h[:, :batch], st.c[:, :batch], st.pred_out[:batch], st.time[:batch]


class SlotGraphDecoder(GraphDecoder):
    """The decoder modes for resumed chunks (see the module docstring)."""

    state_class = ResumingState

    @torch.inference_mode()  # as `resume` runs them
    def prepare(self, max_batch: int, max_frames: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Build the graphs now (startup) for batches up to [max_batch, max_frames]; eager: nothing."""
        self.reserve(max_batch, max_frames)
        if self.mode is not DecodeMode.EAGER:
            self._build(max_batch, max_frames, dtype, torch.device(device))

    def resume(self, enc_proj: Tensor, lengths: Tensor, h: Tensor, c: Tensor, pred_out: Tensor,
               time_jump: Tensor) -> tuple[list[Hypothesis], FinalState]:
        """enc_proj [B, T, J], lengths [B] and each row's previous state -> the rows' new
        hypotheses and final state (graph modes: views of static buffers, valid until the next
        call). The inputs are read, never written."""
        B = enc_proj.shape[0]
        return self.run_mode(enc_proj,
                             lambda static: static.load_resuming(enc_proj, lengths, h, c, pred_out, time_jump),
                             lambda static: (static.result(B), static.final(B)),
                             lambda: self._eager(enc_proj, lengths, h, c, pred_out, time_jump),
                             lambda decoded: decoded[0])

    def _eager(self, enc_proj: Tensor, lengths: Tensor, h: Tensor, c: Tensor, pred_out: Tensor,
               time_jump: Tensor) -> tuple[list[Hypothesis], FinalState]:
        state = continue_state(enc_proj, lengths, h, c, pred_out, time_jump, self.cfg)
        run_label_looping(state, self.prediction, self.joint, self.cfg)
        return collect(state, with_durations=self.cfg.is_tdt), (state.h, state.c, state.pred_out, state.time)
