"""Thread count for the token-by-token decoder loops on the CPU.

A decoder step is many small ops (an LSTM step, one joint row per utterance, a few masks).
With several OpenMP threads each op ends in a barrier, so whether threads pay depends on the
model and on the machine's load: a tiny decoder on a busy 2-core VM ran 7x slower with 2
threads than with 1, while the 618M Parakeet decoder (640-wide LSTM and joint) at batch 24 ran
1.6x faster with 2 on an idle one. No fixed number is right for both, so `fastest_threads`
times the engine's own decode with 1 thread and with all of them once at startup and keeps the
faster. The large matrix work (encoders) always keeps all threads.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

DECODER_THREADS = 1  # until fastest_threads has measured: never worse than 7x


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


def fastest_threads(run: Callable[[], object], rounds: int = 3, margin: float = 0.85) -> int:
    """torch's current thread count if it runs `run` in under `margin` of the time 1 thread
    takes (best of `rounds`, the two interleaved so a burst of outside load hits both), else 1:
    when they are close, 1 thread is the choice that cannot collapse under load. Call once at
    startup."""
    full = torch.get_num_threads()
    if full == 1:
        return 1
    best = {1: float("inf"), full: float("inf")}
    with decoder_threads("cpu", 1):
        run()  # warm-up: first-call allocations and lazy inits are not the decoder's speed
    for _ in range(rounds):
        for n in best:
            with decoder_threads("cpu", n):
                t0 = time.perf_counter()
                run()
                best[n] = min(best[n], time.perf_counter() - t0)
    return full if best[full] < margin * best[1] else 1
