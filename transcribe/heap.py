"""Give the C heap's free memory back to the system, at most once a second.

Why: the engine's tensors change shape with every batch (lengths, batch sizes), and glibc's
malloc keeps what they free in its heap (its mmap threshold rises after large frees, so
later large tensors come from the heap too, and the heap's top is rarely free to trim). The
main process's RSS then grew by ~50 KB per file on 6,000 short segments (tdt_tiny, CPU), and
the encoder alone on random shapes reached 1.27 GB after 3,000 batches where trimming every
100 batches held it at 0.64 GB: free memory kept, not leaked, but a million-file job or a
server up for weeks runs out all the same. malloc_trim(0) takes under 1 ms. Elsewhere (musl,
macOS) there is no malloc_trim and this does nothing.

`out_of_memory` tells torch's out-of-memory errors from its other RuntimeErrors, for the
pipeline (a batch run again in halves) and the streaming pool (a message naming --max-streams).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

import torch

EVERY_S = 1.0


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()
_last = 0.0


def trim() -> bool:
    """malloc_trim(0) unless one ran in the last EVERY_S seconds; whether it ran."""
    global _last
    now = time.monotonic()
    if _TRIM is None or now - _last < EVERY_S:
        return False
    _last = now
    _TRIM(0)
    return True


def out_of_memory(error: RuntimeError) -> bool:
    """Whether torch ran out of memory: torch.OutOfMemoryError on CUDA; the CPU allocator
    raises a plain RuntimeError ("can't allocate memory", or "not enough memory")."""
    return isinstance(error, torch.OutOfMemoryError) or "not enough memory" in str(error) \
        or "can't allocate memory" in str(error)
