"""Where features are computed: in the preprocessing workers, or on the engine's device.

With features on the device, the workers still decode, resample and cut at pauses, but their
frontend (`AudioFrontend`) ships the piece's samples themselves, as a [1, T] float32 "feature"
piece: the slab, `Piece`, the batcher (which buckets by `Piece.samples`, i.e. seconds, never by
the piece's width) and the engine's padding stay one mechanism for both. The engine then pads
the batch to [B, 1, T] and computes the log-mel of the whole batch where the model runs.
"""
from __future__ import annotations

import numpy as np

FEATURES_ON = ("auto", "workers", "device")


def resolve_features_on(name: str) -> str:
    """`auto` -> workers; `workers` and `device` as given; anything else is a ValueError.

    `auto` means the workers until `bench/gpu_bench.py --features-on workers,device` shows the
    device faster on a GPU: on the CPU the workers win (they run beside the model, which would
    otherwise spend its own cores on the features), and no GPU figure exists yet."""
    if name not in FEATURES_ON:
        raise ValueError(f"features on {name!r} is not supported (supported: {', '.join(FEATURES_ON)})")
    return "workers" if name == "auto" else name


class AudioFrontend:
    """A piece's samples as they are: float32 [T] -> [1, T] (a view). Picklable, for the workers.

    A slot holds the longest piece the cutter makes (max_piece_seconds * sample_rate samples)."""

    n_mels = 1  # rows of a slab piece: one row of samples

    def __init__(self, sample_rate: int, max_piece_seconds: float):
        self.sample_rate = sample_rate
        self.max_piece_seconds = self.cut_seconds = max_piece_seconds  # longer files: pieces of the same
        self.max_frames = int(max_piece_seconds * sample_rate)  # = segmenting.PieceCutter.whole_len

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        return np.asarray(audio, dtype=np.float32).reshape(1, -1)
