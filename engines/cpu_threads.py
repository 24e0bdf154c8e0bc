"""Thread count for the token-by-token decoder loops on the CPU.

A decoder step is many small ops (an LSTM step, one joint row per utterance, a few masks).
With several OpenMP threads each op ends in a barrier, so whether threads pay depends on the
model and on the machine's load: a tiny decoder on a busy 2-core VM ran 7x slower with 2
threads than with 1, while the 618M Parakeet decoder (640-wide LSTM and joint) at batch 24 ran
1.6x faster with 2 on an idle one. No fixed number is right for both, so `fastest_threads`
times the engine's own decode with 1 thread and with all of them once at startup and keeps the
faster. The large matrix work (encoders) always keeps all threads.

`best_seconds` is how every such startup choice between two ways of doing the same work is
timed (here, the bf16-or-fp32 GEMM choice in `engines.fast_linear.bf16_gemm_pays`, the
Whisper encoder's attention kernel in `engines.whisper.encoder_attention_kernel`, and the
dtype of its decoder's cross-attention cache in `engines.whisper.cross_cache_dtype`).
"""
from __future__ import annotations

import contextlib
from time import perf_counter
from typing import Callable, Hashable, Iterator, TypeVar

import torch

DECODER_THREADS = 1  # until fastest_threads has measured: never worse than 7x

K = TypeVar("K", bound=Hashable)


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


def best_seconds(runs: dict[K, Callable[[], object]], rounds: int) -> dict[K, float]:
    """Each callable's best wall time over `rounds` runs, the callables interleaved round by
    round so that a burst of outside load hits all of them alike. Warm-ups are the caller's."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = perf_counter()
            run()
            best[key] = min(best[key], perf_counter() - t0)
    return best


def fastest_threads(run: Callable[[], object], rounds: int = 3, margin: float = 0.85) -> int:
    """torch's current thread count if it runs `run` in under `margin` of the time 1 thread
    takes (best of `rounds`, the two interleaved so a burst of outside load hits both), else 1:
    when they are close, 1 thread is the choice that cannot collapse under load. Call once at
    startup."""
    full = torch.get_num_threads()
    if full == 1:
        return 1

    def with_threads(n: int) -> Callable[[], None]:
        def go() -> None:
            with decoder_threads("cpu", n):  # setting the count: ~0.3 us, inside the timing
                run()
        return go

    with decoder_threads("cpu", 1):
        run()  # warm-up: first-call allocations and lazy inits are not the decoder's speed
    best = best_seconds({1: with_threads(1), full: with_threads(full)}, rounds)
    return full if best[full] < margin * best[1] else 1
