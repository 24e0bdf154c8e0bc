"""Per-stage wall time of an engine (`Engine.stage_seconds`), summed over batches.

    times = StageTimes(device)
    t = time.perf_counter()
    ...                          # the encoder, say
    t = times.lap("encoder", t)  # adds the time since t, returns now

On CUDA a lap first synchronises the device: kernels run asynchronously, so without it a stage
would be charged for the work queued before it. That is one sync per stage per batch, which
costs little next to a batch's work and makes the per-stage figures of `transcribe bench` honest.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class StageTimes(defaultdict):
    """stage name -> seconds (a defaultdict(float), so the pipeline and benches read it as a dict)."""

    def __init__(self, device: str | torch.device):
        super().__init__(float)
        self.cuda = torch.device(device).type == "cuda"

    def lap(self, stage: str, t0: float) -> float:
        """Charge the time since t0 (time.perf_counter) to `stage`; returns the current time."""
        if self.cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self[stage] += t1 - t0
        return t1
