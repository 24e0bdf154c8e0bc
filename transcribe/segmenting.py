"""Segmenting: cut audio longer than the model's longest piece at its quietest moments.

The encoder attends over the whole piece (memory grows with its square), so long files are cut
into pieces of at most `max_seconds`, each cut placed at the lowest-energy 100 ms frame in the
last quarter of the allowed span, which is almost always a pause between words.
"""
from __future__ import annotations

import numpy as np

FRAME_SECONDS = 0.1
SEARCH_FRACTION = 0.25  # look for a pause in the last quarter of each piece


def split_long(audio: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[float, np.ndarray]]:
    """[(offset seconds, piece)] covering `audio` [samples] with pieces of <= max_seconds."""
    max_len = int(max_seconds * sample_rate)
    if len(audio) <= max_len:
        return [(0.0, audio)]
    frame = max(1, int(FRAME_SECONDS * sample_rate))
    pieces = []
    start = 0
    while len(audio) - start > max_len:
        lo = start + int(max_len * (1 - SEARCH_FRACTION))
        hi = start + max_len
        n = (hi - lo) // frame
        window = audio[lo : lo + n * frame].reshape(n, frame)
        energy = np.einsum("ij,ij->i", window, window)  # per-frame energy, no temporaries
        cut = lo + int(np.argmin(energy)) * frame + frame // 2
        pieces.append((start / sample_rate, audio[start:cut]))
        start = cut
    pieces.append((start / sample_rate, audio[start:]))
    return pieces
