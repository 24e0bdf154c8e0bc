"""Whisper's log-mel front end, reproduced exactly (no librosa).

Definition (OpenAI `whisper/audio.py`): 16 kHz mono float audio, STFT with a periodic Hann
window of 400 samples (25 ms), hop 160 (10 ms), centred frames with reflect padding; power
spectrum with the last frame dropped; a Slaney-style mel filterbank (80 or 128 bins, 0-8 kHz,
area-normalised triangles); log10 clamped at 1e-10; values floored at (max - 8); then
(x + 4) / 4. A window is zero-padded or trimmed to 30 s = 480 000 samples = 3000 frames first,
which gives the same frames as OpenAI's "pad with 30 s of zeros, then cut 3000 frames".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480 000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
SECONDS_PER_FRAME = HOP_LENGTH / SAMPLE_RATE  # 0.01 s


@dataclass(frozen=True)
class FeatureConfig:
    """Front-end settings; only the mel count varies between Whisper checkpoints."""

    n_mels: int = 80

    def __post_init__(self) -> None:
        if self.n_mels not in (80, 128):
            raise ValueError(f"n_mels must be 80 or 128, got n_mels={self.n_mels!r}")


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    lin = f / f_sp
    log = min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    """Inverse of `_hz_to_mel`."""
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=4)
def mel_filterbank(n_mels: int, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-normalised triangular mel filters, shape [n_mels, n_fft // 2 + 1], float32.

    Same construction as librosa.filters.mel(htk=False, norm="slaney", fmin=0, fmax=sr/2),
    which is what Whisper's bundled `mel_filters.npz` was made with.
    """
    fft_freqs = np.linspace(0.0, sr / 2, n_fft // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2)
    hz_pts = _mel_to_hz(mel_pts)
    widths = np.diff(hz_pts)
    ramps = hz_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    # Area normalisation: each triangle integrates to ~1 over Hz, so wide bands are not louder.
    weights *= (2.0 / (hz_pts[2:] - hz_pts[:-2]))[:, None]
    out = weights.astype(np.float32)
    out.setflags(write=False)  # cached and shared: callers must not modify it
    return out


def pad_or_trim(audio: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Zero-pad or cut the last axis to `length` samples. audio: [..., T] -> [..., length]."""
    t = audio.shape[-1]
    if t > length:
        return audio[..., :length]
    if t < length:
        return torch.nn.functional.pad(audio, (0, length - t))
    return audio


def log_mel_spectrogram(audio: torch.Tensor, config: FeatureConfig = FeatureConfig()) -> torch.Tensor:
    """Whisper log-mel of whole 30 s windows.

    audio: [B, T] or [T] float32 at 16 kHz (any T; padded / trimmed to 480 000 samples).
    Returns [B, n_mels, 3000] (or [n_mels, 3000]) float32 on audio's device; the dynamic range
    floor (max - 8) is taken per window, as Whisper does for each transcribed chunk.
    """
    squeeze = audio.dim() == 1
    x = pad_or_trim(audio.reshape(-1, audio.shape[-1]).float())
    # Frames that see only the zero padding have exactly zero power, so the STFT runs on the
    # audio plus margin (identical result; most windows are far shorter than 30 s).
    nonzero = torch.nonzero(x.ne(0).any(0))
    end = int(nonzero[-1]) + 1 if nonzero.numel() else 0
    end = min(N_SAMPLES, (end // HOP_LENGTH + 4) * HOP_LENGTH)  # >= 2 * n_fft / 2 past the audio
    window = torch.hann_window(N_FFT, device=x.device)  # periodic, like torch's default
    spec = torch.stft(x[:, :end], N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec.abs() ** 2
    power = torch.nn.functional.pad(power, (0, N_FRAMES + 1 - power.shape[-1]))[..., :-1]  # [B, 201, 3000]
    filters = torch.tensor(mel_filterbank(config.n_mels), device=x.device)
    mel = filters @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    floor = log_spec.amax(dim=(-2, -1), keepdim=True) - 8.0
    out = (torch.maximum(log_spec, floor) + 4.0) / 4.0
    return out[0] if squeeze else out
