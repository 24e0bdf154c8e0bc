"""The transducer's decoder modes over the label-looping stages of `decode_stages.py`: its
static state, the runners that capture it, and `GraphDecoder` (mode selection and fallbacks
are `decode_modes.ModeSelection`).

- full-graph: the whole loop is ONE CUDA graph; the outer loop (any item active) and the inner
  loop (any item still on blank) are conditional WHILE nodes (`cuda_conditional.py`).
- unrolled: four graphs (before the loop / outer-loop head / inner-loop body / after the inner
  loop) replayed from the CPU, which reads the loop flags through a pinned buffer + event.
- eager: `run_label_looping`, no graphs (the only mode on CPU).

Graph modes run over static buffers sized (max_batch, max_frames): each batch is copied in,
rows past it get length 0 (inactive from the first step), and a larger batch regrows the
buffers and recaptures, in a fresh graph memory pool (one per capture). The four pieces
call the same stage functions as eager mode and add only `torch.any(..., out=flag)`, so every
mode emits the same tokens. A failed capture or replay falls back to the next mode
(full-graph -> unrolled -> eager), logged, and so does a capture whose first batch decodes to
other tokens than eager's (`ModeSelection.agrees_with_eager`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from engines import cuda_conditional
from engines.decode_modes import (GRAPH_ERRORS, DecodeMode, ModeSelection, fresh_graph_pool, graph_capture,
                                  side_stream, warm_up)
from engines.decode_stages import (DecodeBuffers, Hypothesis, collect, reset_state, stage_first_joint,
                                   label_looping_decode, stage_force_blank, stage_inner_joint, stage_predict,
                                   stage_store, state_view)

if TYPE_CHECKING:
    from engines.transducer import Joint, PredictionNetwork, TransducerConfig

Decoded = TypeVar("Decoded")  # what a decoder's batch gives: hypotheses, or with its final state

FRAME_QUANTUM = 64  # static frames grow in steps of 64 encoder frames (~5 s at 80 ms): few recaptures
WARMUP_RUNS = 2  # eager runs before capture, so cuBLAS/cuDNN set up their handles outside it
# A segfault in the parent's capture_end is what the CUDA driver does when a conditional body's
# capture was invalidated (NVIDIA/cuda-python#2918): `cuda_conditional` prints the call that
# invalidated it before unwinding; `bench/gpu/while_loop_probe.py` isolates such calls.
FULL_GRAPH_CAPTURE_MODE = "thread_local"


@dataclass(frozen=True)
class Pieces:
    """The loop cut where the host (unrolled) or a while node (full-graph) decides what runs next.
    Flags are 0-dim bool tensors on the decoding device, rewritten by the pieces."""

    before: Callable[[], None]  # reset the state; active_any
    head: Callable[[], None]  # stage 1.1; advance_any
    inner: Callable[[], None]  # stage 1.2; advance_any
    after: Callable[[], None]  # stages 2-4; active_any
    active_any: torch.Tensor
    advance_any: torch.Tensor


class StaticState:
    """Static inputs, decoding state and pieces for batches up to [max_batch, max_frames]."""

    def __init__(self, prediction: "PredictionNetwork", joint: "Joint", cfg: "TransducerConfig",
                 max_batch: int, max_frames: int, dtype: torch.dtype, device: torch.device):
        self.max_batch, self.max_frames, self.cfg = max_batch, max_frames, cfg
        J = joint.pred.weight.shape[0]
        self.enc_in = torch.zeros(max_batch, max_frames, J, dtype=dtype, device=device)
        self.len_in = torch.zeros(max_batch, dtype=torch.long, device=device)
        buffers = DecodeBuffers(max_batch, max_frames, cfg, J, dtype, device)
        self.state = state = state_view(buffers, self.enc_in)
        active_any = torch.zeros((), dtype=torch.bool, device=device)
        advance_any = torch.zeros((), dtype=torch.bool, device=device)

        self.prediction, self.joint = prediction, joint

        def before() -> None:
            self._start()
            torch.any(state.active, out=active_any)

        def head() -> None:
            stage_first_joint(state, joint, cfg)
            torch.any(state.advance, out=advance_any)

        def inner() -> None:
            stage_inner_joint(state, joint, cfg)
            torch.any(state.advance, out=advance_any)

        def after() -> None:
            stage_store(state, cfg)
            stage_predict(state, prediction, joint)
            stage_force_blank(state, cfg)
            torch.any(state.active, out=active_any)

        self.pieces = Pieces(before, head, inner, after, active_any, advance_any)

    def _start(self) -> None:
        """The loop's start, captured as part of `before`: clear the state and prime the
        prediction network with SOS (`engines.slot_decode` starts from each stream's state)."""
        reset_state(self.state, self.len_in, self.prediction, self.joint, self.cfg)

    def fits(self, batch: int, frames: int) -> bool:
        return batch <= self.max_batch and frames <= self.max_frames

    def load(self, enc_proj: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy a batch in; frames past T of a row are never read (gathers stop at length - 1)."""
        B, T, _ = enc_proj.shape
        self.enc_in[:B, :T].copy_(enc_proj)
        self.len_in[:B].copy_(lengths)
        self.len_in[B:].zero_()  # padding rows: length 0 = inactive from the start

    def result(self, batch: int) -> list[Hypothesis]:
        return collect(self.state, with_durations=self.cfg.is_tdt, batch=batch)


def run_direct(p: Pieces) -> None:
    """The unrolled driver with "replay" = call: what the graphs run, runnable on CPU (tests)."""
    p.before()
    while bool(p.active_any):
        p.head()
        while bool(p.advance_any):
            p.inner()
        p.after()


class DirectRunner:
    def __init__(self, static: StaticState, pool: object):
        self.static = static

    def run(self) -> None:
        run_direct(self.static.pieces)


def _warm_up(p: Pieces, device: torch.device) -> None:
    """Run every piece eagerly (inputs are all length 0, so nothing decodes)."""
    def run() -> None:
        for _ in range(WARMUP_RUNS):
            for piece in (p.before, p.head, p.inner, p.after):
                piece()

    warm_up(device, run)


class UnrolledRunner:
    """Four graphs; the host loop reads each flag through one pinned byte and an event (no
    `.item()` on a CUDA tensor, which would add a synchronous copy per step)."""

    def __init__(self, static: StaticState, pool: object):
        p, device = static.pieces, static.enc_in.device
        _warm_up(p, device)
        self.graphs = {name: torch.cuda.CUDAGraph() for name in ("before", "head", "inner", "after")}
        stream = side_stream(device)
        for name, graph in self.graphs.items():
            with graph_capture(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                getattr(p, name)()
        self.flags = p
        self.host_flag = torch.zeros((), dtype=torch.bool, pin_memory=True)
        self.event = torch.cuda.Event()

    def _flag(self, flag: torch.Tensor) -> bool:
        self.host_flag.copy_(flag, non_blocking=True)
        self.event.record()
        self.event.synchronize()  # waits for this copy only, not for the whole device
        return bool(self.host_flag)

    def run(self) -> None:
        g = self.graphs
        g["before"].replay()
        while self._flag(self.flags.active_any):
            g["head"].replay()
            while self._flag(self.flags.advance_any):
                g["inner"].replay()
            g["after"].replay()


class FullGraphRunner:
    """One graph: before, then `while active_any: head; while advance_any: inner; after`."""

    def __init__(self, static: StaticState, pool: object):
        p, device = static.pieces, static.enc_in.device
        loops = cuda_conditional.WhileLoops(cuda_conditional.import_cuda_python(), device, FULL_GRAPH_CAPTURE_MODE)
        _warm_up(p, device)
        # Allocations inside the while bodies happen on the bodies' own capture streams, which
        # torch's capture does not route to its pool: this pool (kept with the graph) takes them.
        self.body_pool = torch.cuda.MemPool()
        self.graph = torch.cuda.CUDAGraph()
        stream = side_stream(device)
        with graph_capture(self.graph, pool=pool, stream=stream, capture_error_mode=FULL_GRAPH_CAPTURE_MODE):
            p.before()
            with torch.cuda.use_mem_pool(self.body_pool, device), loops.while_loop(p.active_any):
                p.head()
                with loops.while_loop(p.advance_any):
                    p.inner()
                p.after()
        self.loops = loops

    def run(self) -> None:
        self.graph.replay()


_RUNNERS = {DecodeMode.FULL_GRAPH: FullGraphRunner, DecodeMode.UNROLLED: UnrolledRunner}


class GraphDecoder(ModeSelection):
    """Mode selection, static state, capture and fallback for one TransducerDecoder."""

    state_class = StaticState  # what _build captures over (`engines.slot_decode` resumes streams)

    def __init__(self, prediction: "PredictionNetwork", joint: "Joint", cfg: "TransducerConfig",
                 mode: DecodeMode = DecodeMode.EAGER, capture: bool = True):
        super().__init__(mode, capture)
        self.prediction, self.joint, self.cfg = prediction, joint, cfg
        self.min_batch, self.min_frames = 1, FRAME_QUANTUM
        self.static: StaticState | None = None
        self.runner: DirectRunner | UnrolledRunner | FullGraphRunner | None = None
        self.pool: object | None = None
        self.captures = 0  # how many times the buffers were (re)built and captured

    def _drop(self) -> None:
        self.static = self.runner = None

    def reserve(self, max_batch: int, max_frames: int) -> None:
        """Smallest static size to build (at the first graph-mode decode)."""
        self.min_batch, self.min_frames = max(1, max_batch), max(1, max_frames)

    def decode(self, enc_proj: torch.Tensor, lengths: torch.Tensor, buffers: DecodeBuffers | None = None
               ) -> list[Hypothesis]:
        """enc_proj [B, T, J] on the decoding device, lengths [B] there too -> B hypotheses."""
        return self.run_mode(enc_proj, lambda static: static.load(enc_proj, lengths),
                             lambda static: static.result(enc_proj.shape[0]),
                             lambda: label_looping_decode(enc_proj, lengths, self.prediction, self.joint, self.cfg,
                                                          buffers),
                             lambda hyps: hyps)

    def run_mode(self, enc_proj: torch.Tensor, load: Callable[["StaticState"], None],
                 result: Callable[["StaticState"], Decoded], eager: Callable[[], Decoded],
                 hypotheses: Callable[[Decoded], list[Hypothesis]]) -> Decoded:
        """One batch [B, T, J] in the mode in use: (re)build the static state if it does not fit,
        `load` the batch into it, replay, and read `result`; `eager()` where no graph runs (eager
        mode, or a fallback reached it). A replay error falls back and decodes again; a new
        capture's first batch is checked against eager (their `hypotheses`). Shared by offline
        decoding and the streaming one (`engines.slot_decode`), which load and read differently."""
        B, T, _ = enc_proj.shape
        if self.mode is not DecodeMode.EAGER and (self.static is None or not self.static.fits(B, T)):
            self._build(B, T, enc_proj.dtype, enc_proj.device)
        if self.static is None or self.runner is None:  # eager, chosen or fallen back to
            return eager()
        load(self.static)
        try:
            self.runner.run()
        except GRAPH_ERRORS as e:  # a replay the driver refuses: the next mode decodes
            self.replay_failed(e)
            return self.run_mode(enc_proj, load, result, eager, hypotheses)
        out = result(self.static)
        if self.unverified:
            want = eager()
            if not self.agrees_with_eager([(h.tokens, h.frames, h.durations) for h in hypotheses(out)],
                                          [(h.tokens, h.frames, h.durations) for h in hypotheses(want)]):
                return want
        return out

    def _build(self, batch: int, frames: int, dtype: torch.dtype, device: torch.device) -> None:
        old = self.static
        max_batch = max(batch, self.min_batch, old.max_batch if old else 0)
        need = max(frames, self.min_frames, old.max_frames if old else 0)
        max_frames = -(-need // FRAME_QUANTUM) * FRAME_QUANTUM
        self._drop()  # drop old graphs first, so their memory is free before the new capture

        def capture(mode: DecodeMode) -> tuple[StaticState, DirectRunner | UnrolledRunner | FullGraphRunner]:
            static = self.state_class(self.prediction, self.joint, self.cfg, max_batch, max_frames, dtype, device)
            if not self.capture:
                return static, DirectRunner(static, None)
            self.pool = fresh_graph_pool(device)  # shared only by this runner's graphs
            return static, _RUNNERS[mode](static, self.pool)

        built = self._capture_with_fallback(capture)
        if built is not None:
            self.static, self.runner = built
            self.captures += 1
