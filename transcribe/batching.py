"""Batching: length buckets whose edges are the encoder's shape profiles, so padding stays small.

A piece goes to the smallest bucket whose edge (seconds, `engine.bucket_edges_s`) holds it. A
bucket becomes a batch as soon as its padded seconds (items x edge) reach the budget or it
holds `max_items` pieces (the slab's slots bound how many can wait). Whenever the model is free
the pipeline takes the bucket holding the most audio, topped up with the longest pieces of
shorter buckets while its padding stays small. The engine pads each batch to its longest piece, so the padding
fraction is measured against that: the tensor actually computed.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
TOPUP_MAX_PADDING = 0.2  # a batch topped up from shorter buckets stays at least 80 % audio


@dataclass
class PaddingStats:
    """Seconds of real audio and of padded batch rows (items x longest item), over all batches."""

    valid_seconds: float = 0.0
    padded_seconds: float = 0.0

    def add(self, seconds: Sequence[float]) -> None:
        self.valid_seconds += sum(seconds)
        self.padded_seconds += len(seconds) * max(seconds, default=0.0)

    @property
    def fraction(self) -> float:
        """Share of computed batch rows that is padding (0 = none)."""
        if self.padded_seconds <= 0:
            return 0.0
        return 1.0 - self.valid_seconds / self.padded_seconds


class Batcher(Generic[T]):
    """Items with a length in seconds in, batches (lists of items) out."""

    def __init__(self, edges_s: Sequence[float], budget_s: float, max_items: int):
        if not edges_s or list(edges_s) != sorted(edges_s) or edges_s[0] <= 0:
            raise ValueError(f"bucket edges must be increasing positive seconds, got {edges_s}")
        if budget_s <= 0 or max_items < 1:
            raise ValueError(f"need a positive budget and max_items, got {budget_s}, {max_items}")
        self.edges = list(edges_s)
        self.capacity = [max(1, min(max_items, int(budget_s // e))) for e in self.edges]
        self.buckets: list[list[tuple[float, T]]] = [[] for _ in self.edges]
        self.padding = PaddingStats()

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets)

    def add(self, item: T, seconds: float) -> list[T] | None:
        """Place `item`; returns its bucket as a batch when that bucket is full."""
        k = min(bisect_left(self.edges, seconds), len(self.edges) - 1)
        self.buckets[k].append((seconds, item))
        return self._pop(k) if len(self.buckets[k]) >= self.capacity[k] else None

    def take(self) -> list[T] | None:
        """A batch now (None when nothing waits): the bucket holding the most audio, topped up
        with the longest pieces of the buckets below it while the batch's padding stays under
        TOPUP_MAX_PADDING, so the end of a job does not turn into many tiny batches."""
        k = max(range(len(self.buckets)), key=lambda i: sum(s for s, _ in self.buckets[i]))
        if not self.buckets[k]:
            return None
        batch, self.buckets[k] = self.buckets[k], []
        longest, total = max(s for s, _ in batch), sum(s for s, _ in batch)
        for j in range(k - 1, -1, -1):
            rest = sorted(self.buckets[j], key=lambda e: -e[0])
            n = 0
            while (n < len(rest) and len(batch) < self.capacity[k]
                   and 1 - (total + rest[n][0]) / (longest * (len(batch) + 1)) <= TOPUP_MAX_PADDING):
                total += rest[n][0]
                batch.append(rest[n])
                n += 1
            self.buckets[j] = rest[n:]
            if n < len(rest):
                break  # shorter buckets would pad even more
        self.padding.add([s for s, _ in batch])
        return [item for _, item in batch]

    def drop(self, doomed: Callable[[T], bool]) -> list[T]:
        """Remove and return every waiting item for which `doomed(item)` is true."""
        out = []
        for b in self.buckets:
            out.extend(item for _, item in b if doomed(item))
            b[:] = [(s, item) for s, item in b if not doomed(item)]
        return out

    def _pop(self, k: int) -> list[T]:
        batch, self.buckets[k] = self.buckets[k], []
        self.padding.add([s for s, _ in batch])
        return [item for _, item in batch]
