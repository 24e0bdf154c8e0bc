"""What the streaming server's steps cost, for the `stats` message (`protocol.py`): an operator's
or a load test's view of where a final result's latency goes.

Per step (one batched pool step, `Scheduler.collect` -> `pool.step` -> `apply`): the chunks it
ran, its wall time in the model's thread, and the event loop's time turning its tokens into
transcript updates and messages (while the next step runs: the steps are pipelined) and taking
its chunks (`collect_seconds`, between two steps: the engine waits for it). The pool's own
seconds per stage (log-mel or batching, encoder, decoder; synchronised on CUDA,
`engines.stage_times`) are summed since the server started.
Wall-time percentiles cover the last `STEP_WINDOW` steps, so a long-running server reports
its recent behaviour in bounded memory.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Mapping

import numpy as np

STEP_WINDOW = 10_000


class StepStats:
    def __init__(self):
        self.started = time.monotonic()
        self.steps = 0
        self.chunks = 0
        self.max_chunks = 0
        self.apply_seconds = 0.0
        self.collect_seconds = 0.0
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self.stage_seconds: dict[str, float] = {}

    def record(self, chunks: int, step_s: float, apply_s: float, stage_seconds: Mapping[str, float]) -> None:
        """One step: its chunk count, wall seconds in the model's thread, seconds applying its
        results, and the pool's cumulative seconds per stage after it (copied: the pool's
        thread writes them during the next step)."""
        self.steps += 1
        self.chunks += chunks
        self.max_chunks = max(self.max_chunks, chunks)
        self.step_seconds.append(step_s)
        self.apply_seconds += apply_s
        self.stage_seconds = dict(stage_seconds)

    def record_collect(self, seconds: float) -> None:
        """The event loop's seconds taking a step's chunks, between two steps (the engine
        waits for them)."""
        self.collect_seconds += seconds

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        """The `stats` message: figures so far, plus `extra` (the pool's occupancy)."""
        ms = np.asarray(self.step_seconds) * 1000
        step_ms = ({q: round(float(np.percentile(ms, p)), 2) for q, p in (("p50", 50), ("p95", 95), ("p99", 99))}
                   | {"max": round(float(ms.max()), 2)}) if ms.size else None
        return {
            "type": "stats", "uptime_s": round(time.monotonic() - self.started, 3), "steps": self.steps,
            "chunks": self.chunks, "chunks_per_step": round(self.chunks / self.steps, 2) if self.steps else None,
            "max_chunks_per_step": self.max_chunks, "step_ms": step_ms, "step_window": len(self.step_seconds),
            "stage_seconds": {k: round(v, 4) for k, v in sorted(self.stage_seconds.items())},
            "apply_seconds": round(self.apply_seconds, 4), "collect_seconds": round(self.collect_seconds, 4), **extra,
        }
