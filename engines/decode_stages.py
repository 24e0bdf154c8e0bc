"""Batched greedy label-looping decoding for TDT and RNN-T, as stage functions over fixed state.

This is NeMo's `GreedyBatched{TDT,RNNT}LabelLoopingComputer.torch_impl` (arXiv 2406.06220):
instead of looping over frames, each outer step finds the NEXT non-blank label of every
utterance (inner loop: re-evaluate the joint while the answer is blank, jumping frames), stores
it, and runs the prediction network once for the whole batch. All tensors live in a
preallocated `DecodeState` and every stage updates them in place with masked `torch.where`
(never boolean indexing, never `.item()`), so the same stage functions can later be captured
unchanged into CUDA graphs; the eager driver below syncs only on its two loop conditions.

RNN-T is TDT with an implicit duration table: blank advances one frame, a label advances none.
TDT rules kept exactly: label argmax over `logits[:, :-K]`, duration argmax over
`logits[:, -K:]` (K = len(durations)), and a blank whose predicted duration is 0 advances 1.
Both: after `max_symbols` labels on one frame a blank is forced (time += 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only for annotations: transducer.py imports this module
    from engines.transducer import Joint, PredictionNetwork, TransducerConfig


@dataclass(frozen=True)
class Hypothesis:
    """One utterance's greedy result. `frames`: encoder frame of each token; `durations`: TDT
    predicted duration in frames (CTC: run length; empty for RNN-T)."""

    tokens: list[int]
    frames: list[int]
    durations: list[int]


@dataclass
class DecodeState:
    """Preallocated decoding state for a batch of B utterances, T frames, capacity C tokens.

    Shapes: enc_proj [B, T, J]; per-item vectors [B]; h, c [L, B, H]; pred_out [B, J];
    output buffers [B, C + 1] (the extra column absorbs the unmasked write of finished items).
    """

    enc_proj: torch.Tensor  # projected encoder output (joint.enc applied once)
    lengths: torch.Tensor  # valid frames per item
    last_frame: torch.Tensor  # max(lengths - 1, 0): gather index that is always in range
    batch_idx: torch.Tensor  # arange(B), constant
    duration_table: torch.Tensor  # TDT durations [K] (long); empty for RNN-T
    time: torch.Tensor  # current frame of each item (may pass lengths when done)
    safe_time: torch.Tensor  # min(time, last_frame)
    label_time: torch.Tensor  # frame at which the current label was found
    labels: torch.Tensor  # current label (blank = "none found yet")
    step_durations: torch.Tensor  # duration predicted with the current label
    active: torch.Tensor  # time < lengths
    active_prev: torch.Tensor  # active at the start of this outer step
    advance: torch.Tensor  # active and still blank: inner loop must evaluate the joint again
    found: torch.Tensor  # a non-blank label was found this outer step
    pred_out: torch.Tensor  # projected prediction-network output for the last label
    h: torch.Tensor  # LSTM hidden state
    c: torch.Tensor  # LSTM cell state
    tokens: torch.Tensor  # output token ids
    frames: torch.Tensor  # output token frames
    durations: torch.Tensor  # output token durations
    count: torch.Tensor  # tokens written per item (write index)
    last_emit_frame: torch.Tensor  # frame of the last stored token (-1 = none)
    same_frame_count: torch.Tensor  # tokens stored on last_emit_frame so far


_LONG_FIELDS = ("time", "safe_time", "label_time", "labels", "step_durations", "count",
                "last_emit_frame", "same_frame_count", "lengths", "last_frame", "batch_idx")
_BOOL_FIELDS = ("active", "active_prev", "advance", "found")
_OUTPUT_FIELDS = ("tokens", "frames", "durations")


class DecodeBuffers:
    """Every DecodeState tensor except enc_proj, allocated once for up to `max_batch` items and
    `max_frames` encoder frames; `init_state` takes views of them, so batches reuse the same
    memory (no allocation per batch, stable addresses for CUDA-graph capture)."""

    def __init__(self, max_batch: int, max_frames: int, cfg: "TransducerConfig", joint_hidden: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.max_batch, self.max_frames = max_batch, max_frames
        self.max_symbols = cfg.max_symbols
        self.capacity = max_frames * cfg.max_symbols + 1
        long = dict(dtype=torch.long, device=device)
        self.vectors = {k: torch.zeros(max_batch, **long) for k in _LONG_FIELDS}
        self.vectors.update({k: torch.zeros(max_batch, dtype=torch.bool, device=device) for k in _BOOL_FIELDS})
        self.outputs = {k: torch.zeros(max_batch, self.capacity, **long) for k in _OUTPUT_FIELDS}
        hc = (cfg.pred_rnn_layers, max_batch, cfg.pred_hidden)
        self.h, self.c = torch.zeros(hc, dtype=dtype, device=device), torch.zeros(hc, dtype=dtype, device=device)
        self.pred_out = torch.zeros(max_batch, joint_hidden, dtype=dtype, device=device)
        self.duration_table = torch.tensor(cfg.durations, **long)

    def fits(self, batch: int, frames: int) -> bool:
        return batch <= self.max_batch and frames <= self.max_frames


def state_view(buffers: DecodeBuffers, enc_proj: torch.Tensor) -> DecodeState:
    """A DecodeState over the first B rows (and the columns T frames need) of `buffers`; writes
    nothing. Graph modes pass the whole static buffers, so every address stays fixed."""
    B, T, _ = enc_proj.shape
    capacity = T * buffers.max_symbols + 1  # at most max_symbols tokens per frame
    v = {k: t[:B] for k, t in buffers.vectors.items()}
    out_bufs = {k: t[:B, :capacity] for k, t in buffers.outputs.items()}
    return DecodeState(enc_proj=enc_proj, duration_table=buffers.duration_table, pred_out=buffers.pred_out[:B],
                       h=buffers.h[:, :B], c=buffers.c[:, :B], **v, **out_bufs)


def clear_state(state: DecodeState, lengths: torch.Tensor, cfg: "TransducerConfig") -> None:
    """Every loop variable and output back to the start, for `lengths` valid frames, in place;
    the prediction-network state (h, c, pred_out) is left to the caller."""
    for name in (*_LONG_FIELDS, *_BOOL_FIELDS, *_OUTPUT_FIELDS):
        getattr(state, name).zero_()
    state.lengths.copy_(lengths)
    torch.clamp(state.lengths - 1, min=0, out=state.last_frame)
    torch.arange(state.batch_idx.shape[0], out=state.batch_idx)
    state.labels.fill_(cfg.blank_id)
    state.last_emit_frame.fill_(-1)
    torch.greater(state.lengths, 0, out=state.active)


def reset_state(state: DecodeState, lengths: torch.Tensor, prediction: "PredictionNetwork", joint: "Joint",
                cfg: "TransducerConfig") -> None:
    """Start decoding: clear the state in place and prime the prediction network with the blank
    (SOS) symbol. Capture-safe (no host sync, fixed shapes): graph modes capture it."""
    clear_state(state, lengths, cfg)
    state.h.zero_()
    state.c.zero_()
    out, (h1, c1) = prediction.step(state.labels, (state.h, state.c))
    state.h.copy_(h1)
    state.c.copy_(c1)
    state.pred_out.copy_(joint.pred(out))


def init_state(enc_proj: torch.Tensor, lengths: torch.Tensor, prediction: "PredictionNetwork",
               joint: "Joint", cfg: "TransducerConfig", buffers: DecodeBuffers | None = None) -> DecodeState:
    """Set up the state (in `buffers` when they fit, else freshly allocated) and prime the
    prediction network with the blank (SOS) symbol."""
    B, T, J = enc_proj.shape
    if buffers is None or not buffers.fits(B, T):
        buffers = DecodeBuffers(B, T, cfg, J, enc_proj.dtype, enc_proj.device)
    state = state_view(buffers, enc_proj)
    reset_state(state, lengths, prediction, joint, cfg)
    return state


def _joint_step(state: DecodeState, joint: "Joint", cfg: "TransducerConfig"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint at each item's safe_time with its last prediction -> (labels [B], durations [B]).

    Durations are the raw TDT prediction (0 for RNN-T); blank adjustments happen in the stages
    because they depend on the label after masking."""
    logits = joint.logits(state.enc_proj[state.batch_idx, state.safe_time], state.pred_out)
    k = state.duration_table.numel()
    if k == 0:
        _, labels = logits.max(dim=-1)
        return labels, torch.zeros_like(labels)
    _, labels = logits[:, :-k].max(dim=-1)
    return labels, state.duration_table[logits[:, -k:].argmax(dim=-1)]


def _blank_advance(durations: torch.Tensor, blank: torch.Tensor, is_tdt: bool) -> torch.Tensor:
    """Frames to advance: RNN-T: 1 on blank, 0 on a label. TDT: predicted, but >= 1 on blank."""
    if not is_tdt:
        return blank.long()
    return durations.masked_fill(torch.logical_and(durations == 0, blank), 1)


def _update_time_masks(state: DecodeState, blank: torch.Tensor) -> None:
    torch.minimum(state.time, state.last_frame, out=state.safe_time)
    torch.less(state.time, state.lengths, out=state.active)
    torch.logical_and(state.active, blank, out=state.advance)


def stage_first_joint(state: DecodeState, joint: "Joint", cfg: "TransducerConfig") -> None:
    """Stage 1.1: first joint evaluation of an outer step, for every item."""
    state.active_prev.copy_(state.active)
    labels, durations = _joint_step(state, joint, cfg)
    blank = labels == cfg.blank_id
    step = _blank_advance(durations, blank, cfg.is_tdt)
    state.labels.copy_(labels)
    state.step_durations.copy_(step)
    state.label_time.copy_(state.time)
    state.time.add_(step * state.active)  # same as: time[active] += step[active]
    _update_time_masks(state, blank)


def stage_inner_joint(state: DecodeState, joint: "Joint", cfg: "TransducerConfig") -> None:
    """Stage 1.2 (inner loop body): items still on blank look again at their new frame."""
    adv = state.advance
    torch.where(adv, state.time, state.label_time, out=state.label_time)  # same as: label_time[adv] = time[adv]
    labels, durations = _joint_step(state, joint, cfg)
    torch.where(adv, labels, state.labels, out=state.labels)  # same as: labels[adv] = labels_new[adv]
    blank = state.labels == cfg.blank_id
    step = _blank_advance(durations, blank, cfg.is_tdt)
    # Masked, unlike NeMo's batched code (which overwrites every item's duration here): keeps
    # stored durations independent of what else is in the batch; equals NeMo at batch size 1.
    torch.where(adv, step, state.step_durations, out=state.step_durations)  # same as: d[adv] = step[adv]
    torch.where(adv, state.time + step, state.time, out=state.time)  # same as: time[adv] += step[adv]
    _update_time_masks(state, blank)


def stage_store(state: DecodeState, cfg: "TransducerConfig") -> None:
    """Stage 2: append the found labels (items that were active and ended on a non-blank)."""
    torch.logical_and(state.active_prev, state.labels != cfg.blank_id, out=state.found)
    found = state.found
    # Unmasked write at each item's write index; only `count += found` makes it stick.
    state.tokens[state.batch_idx, state.count] = state.labels
    state.frames[state.batch_idx, state.count] = state.label_time
    state.durations[state.batch_idx, state.count] = state.step_durations
    same = torch.logical_and(found, state.last_emit_frame == state.label_time)
    new_frame = torch.logical_and(found, state.last_emit_frame != state.label_time)
    torch.where(same, state.same_frame_count + 1, state.same_frame_count, out=state.same_frame_count)
    state.same_frame_count.masked_fill_(new_frame, 1)  # same as: same_frame_count[new_frame] = 1
    torch.where(found, state.label_time, state.last_emit_frame, out=state.last_emit_frame)
    state.count.add_(found.long())


def stage_predict(state: DecodeState, prediction: "PredictionNetwork", joint: "Joint") -> None:
    """Stage 3: advance the prediction network for items with a new label (others keep theirs)."""
    out, (h, c) = prediction.step(state.labels, (state.h, state.c))
    g = joint.pred(out)  # projected once per step, reused by every joint call until the next label
    found = state.found
    torch.where(found[:, None], g, state.pred_out, out=state.pred_out)  # same as: pred_out[found] = g[found]
    torch.where(found[None, :, None], h, state.h, out=state.h)  # same as: h[:, found] = h_new[:, found]
    torch.where(found[None, :, None], c, state.c, out=state.c)


def stage_force_blank(state: DecodeState, cfg: "TransducerConfig") -> None:
    """Stage 4: after max_symbols labels on the current frame, act as if blank was emitted."""
    force = torch.logical_and(state.active, state.labels != cfg.blank_id)
    force = torch.logical_and(force, state.same_frame_count >= cfg.max_symbols)
    force = torch.logical_and(force, state.last_emit_frame == state.time)
    state.time.add_(force.long())  # same as: time[force] += 1
    torch.minimum(state.time, state.last_frame, out=state.safe_time)
    torch.less(state.time, state.lengths, out=state.active)


def run_label_looping(state: DecodeState, prediction: "PredictionNetwork", joint: "Joint",
                      cfg: "TransducerConfig") -> None:
    """Eager driver: the only host syncs are the two loop conditions."""
    while state.active.any():
        stage_first_joint(state, joint, cfg)
        while state.advance.any():
            stage_inner_joint(state, joint, cfg)
        stage_store(state, cfg)
        stage_predict(state, prediction, joint)
        stage_force_blank(state, cfg)


def collect(state: DecodeState, with_durations: bool, batch: int | None = None) -> list[Hypothesis]:
    """Copy the first `batch` rows (default all) of the output buffers to Python lists: the counts
    first, then only the columns the longest hypothesis uses (one transfer per buffer)."""
    counts = state.count[:batch].cpu().tolist()
    n = max(counts, default=0)
    tokens, frames, durations = (t[:batch, :n].cpu() for t in (state.tokens, state.frames, state.durations))
    return [
        Hypothesis(tokens[b, :k].tolist(), frames[b, :k].tolist(),
                   durations[b, :k].tolist() if with_durations else [])
        for b, k in enumerate(counts)
    ]


def label_looping_decode(enc_proj: torch.Tensor, lengths: torch.Tensor, prediction: "PredictionNetwork",
                         joint: "Joint", cfg: "TransducerConfig", buffers: DecodeBuffers | None = None
                         ) -> list[Hypothesis]:
    """enc_proj [B, T, J] (joint.enc already applied), lengths [B] -> B hypotheses."""
    state = init_state(enc_proj, lengths, prediction, joint, cfg, buffers)
    run_label_looping(state, prediction, joint, cfg)
    return collect(state, with_durations=cfg.is_tdt)
