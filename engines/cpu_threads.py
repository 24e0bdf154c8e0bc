"""Thread count for the token-by-token decoder loops on the CPU.

A decoder step is many tiny ops (an LSTM step, one joint row per utterance, a few masks). With
several OpenMP threads each op ends in a barrier; when the machine is busy (preprocessing
workers, other jobs) a descheduled thread stalls every op: measured 7x slower per decode with
2 threads than with 1 on a loaded 2-core VM, and no faster with 2 on an idle one. The large
matrix work (encoders) keeps all threads.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

DECODER_THREADS = 1


@contextlib.contextmanager
def decoder_threads(device: torch.device | str, n: int | None = DECODER_THREADS) -> Iterator[None]:
    """Run the block with `n` intra-op threads on the CPU (None or a CUDA device: unchanged)."""
    if n is None or torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
