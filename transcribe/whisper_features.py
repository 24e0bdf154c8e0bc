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

from transcribe import features as mel

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


@lru_cache(maxsize=4)
def mel_filterbank(n_mels: int, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-normalised triangular mel filters, shape [n_mels, n_fft // 2 + 1], float32: the
    librosa.filters.mel(htk=False, norm="slaney", fmin=0, fmax=sr/2) construction Whisper's
    bundled `mel_filters.npz` was made with (the same function NeMo's front end uses)."""
    out = mel.mel_filterbank(sr, n_fft, n_mels, 0.0, sr / 2, "slaney").numpy()
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
