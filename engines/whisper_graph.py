"""Whisper decoder modes over the fixed-shape step of `whisper_static.py`: capture and fallbacks.

- unrolled: per batch bucket, one CUDA graph of `loop_check_every` (default 16) steps in a row,
  replayed from the host once per chunk; a chunk after every row finished still runs to its end.
- full-graph: per bucket, one CUDA graph whose steps run in a conditional WHILE node
  (`cuda_conditional.py`) while "a row is live and the chunk has steps left": a chunk stops
  as soon as every row has finished, and with the compression-ratio check off one replay
  decodes the whole batch.
- eager: `GreedyDecoder._greedy` (the only mode on CPU).

The host loop is `GreedyDecoder._chunked`: after each chunk it reads the chunk's tokens (one
sync), runs the repetition-loop check, and moves the live rows to a smaller bucket's graph
when they fit one. Every bucket is captured when the static buffers are built (largest first,
a fresh graph memory pool per build; the warm-up scribbles on the state, which each batch's
`load` resets).
Mode selection and the capture fallback full-graph -> unrolled -> eager, logged once, are the
transducer's (`decode_modes.ModeSelection`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from engines import cuda_conditional
from engines.decode_modes import DecodeMode, ModeSelection, fresh_graph_pool, graph_capture, side_stream, warm_up
from engines.whisper_static import StaticDecoding

if TYPE_CHECKING:
    from engines.whisper_decoding import GreedyDecoder

WARMUP_RUNS = 2  # eager runs before capture, so cuBLAS and attention set up their state outside it


class Runner(Protocol):
    steps: int  # steps per chunk

    def run(self, b: int) -> None:
        """One chunk on rows 0..b-1 (b a bucket of the static state)."""


class DirectRunner:
    """What the mode's graphs run, called directly: capture=False, the CPU tests' path."""

    def __init__(self, static: StaticDecoding, mode: DecodeMode, steps: int):
        self.static, self.mode, self.steps = static, mode, steps

    def run(self, b: int) -> None:
        s = self.static
        if self.mode is DecodeMode.FULL_GRAPH:
            s.chunk_head(b, self.steps)
            while bool(s.go):
                s.chunk_body(b)
        else:
            for _ in range(self.steps):
                s.step(b)


def _warm_up(static: StaticDecoding, device: torch.device) -> None:
    """Run every bucket's step eagerly (the capture's kernels, once each)."""
    def run() -> None:
        for b in static.buckets:
            static.step_no.zero_()  # keeps the warm-up's writes inside the buffers
            for _ in range(WARMUP_RUNS):
                static.chunk_body(b)

    warm_up(device, run)


class UnrolledRunner:
    """Per bucket, `steps` steps captured back to back; the host replays one graph per chunk."""

    def __init__(self, static: StaticDecoding, pool: object, steps: int):
        device = static.done.device
        _warm_up(static, device)
        stream = side_stream(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for b in reversed(static.buckets):
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                for _ in range(steps):
                    static.step(b)
            self.graphs[b] = graph
        self.steps = steps

    def run(self, b: int) -> None:
        self.graphs[b].replay()


class FullGraphRunner:
    """Per bucket, `chunk_head` then `while go: chunk_body` as one graph (conditional node)."""

    def __init__(self, static: StaticDecoding, pool: object, steps: int):
        device = static.done.device
        loops = cuda_conditional.WhileLoops(cuda_conditional.import_cuda_python(), device)
        _warm_up(static, device)
        # Allocations inside the while bodies happen on the bodies' own capture streams, which
        # torch's capture does not route to its pool: this pool (kept with the graphs) takes them.
        self.body_pool = torch.cuda.MemPool()
        stream = side_stream(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for b in reversed(static.buckets):
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                static.chunk_head(b, steps)
                with torch.cuda.use_mem_pool(self.body_pool, device), loops.while_loop(static.go):
                    static.chunk_body(b)
            self.graphs[b] = graph
        self.loops, self.steps = loops, steps

    def run(self, b: int) -> None:
        self.graphs[b].replay()


_RUNNERS = {DecodeMode.FULL_GRAPH: FullGraphRunner, DecodeMode.UNROLLED: UnrolledRunner}


class WhisperGraphs(ModeSelection):
    """Mode selection, static state, capture and fallback for one GreedyDecoder."""

    def __init__(self, decoder: "GreedyDecoder", mode: DecodeMode = DecodeMode.EAGER, capture: bool = True):
        super().__init__(mode, capture)
        self.decoder = decoder
        self.min_capacity = 1
        self.static: StaticDecoding | None = None
        self.runner: Runner | None = None
        self.pool: object | None = None
        self.captures = 0  # how many times the buffers were (re)built and captured

    def _drop(self) -> None:
        self.static = self.runner = None

    def reserve(self, max_batch: int) -> None:
        """Smallest capacity to build (at the first graph-mode decode)."""
        self.min_capacity = max(1, max_batch)

    def steps(self, mode: DecodeMode) -> int:
        """Steps per chunk: the loop check's period, so chunks end where eager checks; a while
        node with no check to stop for runs the whole decode."""
        opts = self.decoder.opts
        if mode is DecodeMode.FULL_GRAPH and opts.compression_ratio_threshold is None:
            return max(1, self.decoder.n_steps)
        return opts.loop_check_every

    def ready(self, n: int) -> tuple[StaticDecoding, Runner] | None:
        """The static state and runner for a batch of n windows, built (and captured) when n does
        not fit; None when a failed capture fell back to eager."""
        if self.static is None or self.static.capacity < n:
            self._build(n)
        if self.static is None or self.runner is None:
            return None
        return self.static, self.runner

    def _build(self, n: int) -> None:
        old = self.static
        capacity = max(n, self.min_capacity, old.capacity if old else 0)
        self._drop()  # drop old graphs first, so their memory is free before the new capture

        def capture(mode: DecodeMode) -> tuple[StaticDecoding, Runner]:
            static = StaticDecoding(self.decoder, capacity, self.decoder.opts.loop_check_every)
            if not self.capture:
                return static, DirectRunner(static, mode, self.steps(mode))
            self.pool = fresh_graph_pool(self.decoder.device)  # shared only by this runner's bucket graphs
            return static, _RUNNERS[mode](static, self.pool, self.steps(mode))

        built = self._capture_with_fallback(capture)
        if built is not None:
            self.static, self.runner = built
            self.captures += 1
