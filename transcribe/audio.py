"""Audio decoding as NeMo sees it: libsndfile float32 samples, channel average, NeMo's resampling.

NeMo reads with soundfile as float32 (int16 / 32768 for PCM) and averages channels; its
`transcribe()` resamples through lhotse (`transcribe/resample.py`). Doing the same here keeps
our features within float rounding of NeMo's.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import soundfile as sf

from transcribe.resample import resample

# A file needs one sample: NeMo's centred STFT gives n // hop + 1 feature frames for any n >= 1,
# and NeMo transcribes a 10 ms file (a letter or empty text); refusing files under one 25 ms
# window (400 samples), as we did, failed files NeMo transcribes.
DEFAULT_MIN_SAMPLES = 1


class AudioError(ValueError):
    """An input file that cannot be turned into speech samples; str() names the file and why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def _check_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    try:
        os.stat(p)
    except FileNotFoundError:
        raise AudioError(p, "no such file" + (" (a symlink to nothing)" if p.is_symlink() else "")) from None
    except OSError as e:  # a symlink loop, a name too long: the system's reason, not "no such file"
        raise AudioError(p, f"cannot look at it ({e.strerror or e})") from None
    if not p.is_file():
        raise AudioError(p, "not a regular file")
    if not os.access(p, os.R_OK):
        raise AudioError(p, "permission denied")
    if p.stat().st_size == 0:
        raise AudioError(p, "empty file (0 bytes)")
    return p


def sndfile_path(p: Path) -> bytes:
    """The path as soundfile should get it: it encodes a str path strictly as UTF-8, so a file
    name that is not valid UTF-8 failed to open; os.fsencode gives back the name's own bytes."""
    return os.fsencode(p)


def _open_error(p: Path, e: Exception) -> AudioError:
    # libsndfile prefixes its messages with "Error opening <path>: "; keep only the cause.
    msg = str(e).split(": ", 1)[-1] if str(e).startswith("Error opening ") else str(e)
    if msg.startswith("File does not exist or is not a regular file"):
        # libsndfile's answer when its MP3 decoder finds no frame; `_check_path` saw the file.
        msg = "no audio frames found: corrupt, or not the format its extension says"
    return AudioError(p, f"not a readable audio file ({msg.strip()})")


def audio_info(path: str | os.PathLike) -> tuple[float, int, int]:
    """(duration_s, sample_rate, channels) from the file header, without decoding samples.

    For MP3 the duration is libsndfile's header estimate and may differ slightly from the
    decoded length.
    """
    p = _check_path(path)
    try:
        info = sf.info(sndfile_path(p))
    except (sf.SoundFileError, OSError) as e:
        raise _open_error(p, e) from e
    if info.channels <= 0:
        raise AudioError(p, f"unsupported channel count {info.channels}")
    if info.samplerate <= 0:
        raise AudioError(p, f"invalid sample rate {info.samplerate}")
    return info.frames / info.samplerate, int(info.samplerate), int(info.channels)


def _decode(p: Path) -> tuple[np.ndarray, int]:
    """All samples as float32 [frames, channels] and the file's sample rate (Hz)."""
    try:
        with sf.SoundFile(sndfile_path(p)) as f:
            if f.channels <= 0:
                raise AudioError(p, f"unsupported channel count {f.channels}")
            if f.samplerate <= 0:
                raise AudioError(p, f"invalid sample rate {f.samplerate}")
            rate = int(f.samplerate)
            data = f.read(dtype="float32", always_2d=True)
    except (sf.SoundFileError, OSError) as e:
        # Corrupt or truncated streams fail here (e.g. "flac decoder lost sync").
        raise _open_error(p, e) from e
    return data, rate


def load_audio(path: str | os.PathLike, sample_rate: int, min_samples: int = DEFAULT_MIN_SAMPLES) -> np.ndarray:
    """Decode `path` to mono float32 samples at `sample_rate` Hz: [n] with n >= min_samples.

    Raises AudioError (naming the file) for a missing or unreadable file, data that is not audio
    or is corrupt, no samples, fewer than `min_samples` samples after resampling, or samples that
    are not finite.
    """
    p = _check_path(path)
    data, rate = _decode(p)
    if data.shape[0] == 0:
        raise AudioError(p, "no audio samples (0 frames)")
    # Channel average, as NeMo's default channel_selector does; resampling is linear, so
    # downmixing first gives the same result at a fraction of the cost.
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    if not np.isfinite(mono).all():
        raise AudioError(p, "audio contains NaN or infinite samples")
    mono = resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sample_rate)
    if mono.shape[0] < min_samples:
        raise AudioError(
            p, f"too short: {mono.shape[0]} samples at {sample_rate} Hz, need at least {min_samples}"
        )
    return mono
