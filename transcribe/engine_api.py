"""What the pipeline needs of a model: the `Engine` and the `Frontend` its workers run.

Parakeet (`engines/parakeet.py`) and Whisper (`engines/whisper_engine.py`) engines provide
them; `transcribe/pipeline.py` and `transcribe/workers.py` use nothing else of a model.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from transcribe.results import Result


class Frontend(Protocol):
    """Audio piece -> features, run in the preprocessing workers; must pickle (plain `pickle`).

    Parakeet: `engines.parakeet.LogMelFrontend` (NeMo log-mel, F = valid frames), or with
    features on the device `transcribe.audio_frontend.AudioFrontend` (the samples: n_mels = 1,
    F = T). A Whisper engine provides its own, e.g. 80/128 mels over a 30 s window: F = 3000.
    """

    sample_rate: int  # Hz the audio is resampled to
    n_mels: int
    max_piece_seconds: float  # a file up to this long is one piece; longer files are cut at pauses
    cut_seconds: float  # ... into pieces no longer than this (<= max_piece_seconds)
    max_frames: int  # F of the longest piece: the size of a slab slot is n_mels x max_frames

    def __call__(self, audio: np.ndarray) -> np.ndarray: ...  # float32 [T] -> float32 [n_mels, F]


class Engine(Protocol):
    """What the pipeline needs of a model (Parakeet or Whisper)."""

    name: str
    device: str
    # Choices besides the model that change the words (Whisper's language and task; Parakeet:
    # none). Recorded with each file in results.jsonl: a rerun with other settings redoes the
    # file. Precision, backends and batch sizes are left out: they change a word in hundreds.
    settings: dict[str, str]
    sample_rate: int
    max_piece_seconds: float  # longest audio the model takes in one piece (== frontend's)
    bucket_edges_s: tuple[float, ...]  # batch length buckets (s), increasing; last >= max piece
    frontend: Frontend
    stage_seconds: dict[str, float]  # accumulated time per stage, filled by the engine

    # The model detects the spoken language (Whisper with --language auto): the pipeline decodes
    # a file's later pieces in its first piece's language (`transcribe/file_language.py`).
    detects_language: bool
    # What a result's segments are: sentences ending in one of these (Parakeet: NeMo's rule),
    # which a long file's stitching makes again over all its words, as NeMo decoding it whole
    # would; None: the model's own spans (Whisper's), kept per piece (`stitching.stitch`).
    sentence_delimiters: tuple[str, ...] | None

    def reserve(self, max_items: int) -> None: ...  # preallocate batch buffers, once at startup

    # frontend outputs [n_mels, F_i] float32 (views into shared memory: copy before returning)
    # -> Result per piece. languages (with detects_language): per piece, its file's language,
    # or None to detect it (Result.language says what was found); else None. after_pause: per
    # piece, whether it begins at a cut in a pause after earlier speech (a file's later pieces),
    # for word times that take the pause into account (Whisper's); None: none does.
    def transcribe_features(self, features: list[torch.Tensor], languages: list[str | None] | None = None,
                            after_pause: list[bool] | None = None) -> list[Result]: ...

    # frontend + the above; pieces: mono float samples at sample_rate (`checked_pieces`)
    def transcribe(self, pieces: list[np.ndarray]) -> list[Result]: ...


def checked_pieces(pieces: list[np.ndarray]) -> list[np.ndarray]:
    """`Engine.transcribe`'s audio as float32, or ValueError naming the piece: each must be mono
    float samples in [-1, 1] and finite, as a file's are once decoded (`transcribe/audio.py`);
    integer PCM would be read 32768 times too loud, and a NaN spreads over the whole batch."""
    out = []
    for i, p in enumerate(pieces):
        a = np.asarray(p)
        if a.ndim != 1:
            raise ValueError(f"piece {i}: audio must be mono samples [T], got shape {a.shape}")
        if a.dtype.kind != "f":
            raise ValueError(f"piece {i}: audio must be float samples in [-1, 1], got {a.dtype} "
                             f"(divide integer PCM by its full scale, 32768 for int16)")
        if not np.isfinite(a).all():
            raise ValueError(f"piece {i}: audio contains NaN or infinite samples")
        out.append(np.ascontiguousarray(a, dtype=np.float32))
    return out
