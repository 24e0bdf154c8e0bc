"""Log-mel features identical to NeMo's `AudioToMelSpectrogramPreprocessor` at inference.

NeMo's front end (`FilterbankFeatures`, NeMo 2.x/3.0) does, per batch item of `len` samples:
preemphasis (then zeroes every sample at or beyond `len`), `torch.stft` with `center=True` and
zero ("constant") padding, |X|**mag_power, a slaney mel filterbank, log with a zero guard,
normalisation over the item's valid frames, then sets frames beyond the item's frame count to
`pad_value` and pads the time axis to a multiple of `pad_to`. Dither is training-only and
therefore never applied here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

# NeMo's std guard in normalize_batch (features.CONSTANT).
STD_EPS = 1e-5
_WINDOWS = {
    "hann": torch.hann_window,
    "hamming": torch.hamming_window,
    "blackman": torch.blackman_window,
    "bartlett": torch.bartlett_window,
}  # NeMo also lists 'none', but its forward then calls None.to(...) and fails
# Config spellings NeMo treats as "no normalisation" (any falsy value, or a string that is
# neither per_feature nor all_features; we accept only the spellings seen in real configs).
_NO_NORMALIZE = {None, False, "", "NA", "na", "none", "None"}
# Keys NeMo accepts that do not change inference output (training-only or deprecated no-ops).
_IGNORED_KEYS = {
    "_target_", "dither", "rng", "nb_augmentation_prob", "nb_max_freq", "use_grads",
    "max_duration", "stft_conv", "stft_exact_pad", "use_torchaudio",
}
_PREPROCESSOR_TARGET = "AudioToMelSpectrogramPreprocessor"


def _unsupported(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"preprocessor config: unsupported {key}={value!r} ({why})")


@dataclass(frozen=True)
class FeatureConfig:
    """NeMo preprocessor settings. Times in seconds; `n_fft`, window lengths in samples."""

    sample_rate: int = 16000
    window_size: float = 0.02
    window_stride: float = 0.01
    window: str = "hann"
    features: int = 64
    n_fft: int | None = None
    normalize: str | None = "per_feature"
    log: bool = True
    log_zero_guard_type: str = "add"
    log_zero_guard_value: float | str = 2**-24
    mag_power: float = 2.0
    preemph: float | None = 0.97
    pad_to: int = 16
    pad_value: float = 0.0
    frame_splicing: int = 1
    exact_pad: bool = False
    lowfreq: float = 0.0
    highfreq: float | None = None
    mel_norm: str | None = "slaney"
    dither: float = 1e-5  # kept for round-tripping configs; inference never dithers
    n_window_size: int | None = None  # NeMo's alternative spelling, in samples
    n_window_stride: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise _unsupported("sample_rate", self.sample_rate, "must be a positive int")
        if self.window not in _WINDOWS:
            raise _unsupported("window", self.window, f"expected one of {sorted(_WINDOWS)}")
        if self.normalize not in _NO_NORMALIZE and self.normalize not in ("per_feature", "all_features"):
            raise _unsupported("normalize", self.normalize, "expected per_feature, all_features or NA")
        if self.log_zero_guard_type not in ("add", "clamp"):
            raise _unsupported("log_zero_guard_type", self.log_zero_guard_type, "expected add or clamp")
        g = self.log_zero_guard_value
        if isinstance(g, str) and g not in ("tiny", "eps"):
            raise _unsupported("log_zero_guard_value", g, "expected a number, 'tiny' or 'eps'")
        if not isinstance(self.pad_to, int) or isinstance(self.pad_to, bool) or self.pad_to < 0:
            raise _unsupported("pad_to", self.pad_to, "expected an int >= 0 ('max' is training-only)")
        if self.frame_splicing != 1:
            raise _unsupported("frame_splicing", self.frame_splicing, "only 1 is supported")
        if self.mel_norm not in ("slaney", None):
            raise _unsupported("mel_norm", self.mel_norm, "expected slaney or null")
        if not isinstance(self.features, int) or self.features <= 0:
            raise _unsupported("features", self.features, "must be a positive int")
        if self.window_size and self.n_window_size:
            raise _unsupported("n_window_size", self.n_window_size, "window_size is also set")
        if self.window_stride and self.n_window_stride:
            raise _unsupported("n_window_stride", self.n_window_stride, "window_stride is also set")
        for key, value in (("win_length", self.win_length), ("hop_length", self.hop_length)):
            if value <= 0:
                raise _unsupported(key, value, "must be positive samples")
        if self.n_fft_resolved < self.win_length:
            raise _unsupported("n_fft", self.n_fft, f"smaller than the window ({self.win_length})")
        if self.exact_pad and self.hop_length % 2 == 1:
            raise _unsupported("exact_pad", self.exact_pad, "needs an even hop length")

    @classmethod
    def from_nemo(cls, cfg: dict[str, Any]) -> "FeatureConfig":
        """From a NeMo `preprocessor` config dict (or a whole model config holding one).

        Absent keys take NeMo's `AudioToMelSpectrogramPreprocessor` defaults; anything we do not
        reproduce exactly raises ValueError naming the key and the value.
        """
        if "preprocessor" in cfg and isinstance(cfg["preprocessor"], dict):
            cfg = cfg["preprocessor"]
        target = cfg.get("_target_", _PREPROCESSOR_TARGET)
        if not str(target).endswith(_PREPROCESSOR_TARGET):
            raise _unsupported("_target_", target, f"only {_PREPROCESSOR_TARGET} is supported")
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in cfg.items():
            if key in _IGNORED_KEYS:
                continue
            if key not in known:
                raise _unsupported(key, value, "unknown preprocessor key")
            kwargs[key] = value
        if kwargs.get("normalize") is not None and not isinstance(kwargs["normalize"], (str, bool)):
            # e.g. {fixed_mean: [...], fixed_std: [...]}
            raise _unsupported("normalize", kwargs["normalize"], "fixed mean/std is not supported")
        return cls(**kwargs)

    @property
    def win_length(self) -> int:
        """Analysis window length in samples (NeMo truncates window_size * sample_rate)."""
        if self.window_size:
            return int(self.window_size * self.sample_rate)
        return int(self.n_window_size or 0)

    @property
    def hop_length(self) -> int:
        """Frame shift in samples."""
        if self.window_stride:
            return int(self.window_stride * self.sample_rate)
        return int(self.n_window_stride or 0)

    @property
    def n_fft_resolved(self) -> int:
        """FFT size: the configured one, else the next power of two >= the window."""
        return int(self.n_fft or 2 ** math.ceil(math.log2(self.win_length)))

    @property
    def frame_seconds(self) -> float:
        """Seconds between consecutive feature frames."""
        return self.hop_length / self.sample_rate

    @property
    def normalize_mode(self) -> str | None:
        """'per_feature', 'all_features', or None for no normalisation."""
        return None if self.normalize in _NO_NORMALIZE else self.normalize

    def frame_count(self, lengths: torch.Tensor) -> torch.Tensor:
        """Valid feature frames per item (NeMo's get_seq_len): [B] samples -> [B] int64 frames."""
        n_fft = self.n_fft_resolved
        pad = 2 * ((n_fft - self.hop_length) // 2) if self.exact_pad else 2 * (n_fft // 2)
        # No "+ 1": NeMo (2.x, 3.0) counts len // hop frames for center=True, one fewer than
        # torch.stft returns; that last frame is excluded from normalisation and set to pad_value.
        frames = torch.div(lengths.long() + pad - n_fft, self.hop_length, rounding_mode="floor")
        return frames.clamp(min=0)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale (librosa htk=False): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                   fmax: float | None = None, norm: str | None = "slaney") -> torch.Tensor:
    """librosa.filters.mel (htk=False) re-implemented: [n_mels, n_fft // 2 + 1] float32."""
    fmax = fmax or sample_rate / 2  # NeMo: `highfreq or sample_rate / 2`
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    # librosa stores each triangle in float32 before normalising; do the same.
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    if norm == "slaney":
        enorm = 2.0 / (mel_f[2:] - mel_f[:-2])  # equal area per filter
        weights = (weights * enorm[:, None]).astype(np.float32)
    return torch.from_numpy(weights)


def make_window(cfg: FeatureConfig) -> torch.Tensor:
    """NeMo's analysis window: symmetric (periodic=False), `win_length` samples, float32."""
    return _WINDOWS[cfg.window](cfg.win_length, periodic=False, dtype=torch.float32)


class LogMel(torch.nn.Module):
    """Batched log-mel front end; see the module docstring for the exact NeMo steps."""

    def __init__(self, cfg: FeatureConfig, window: torch.Tensor | None = None, fb: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        n_bins = cfg.n_fft_resolved // 2 + 1
        if window is None:
            window = make_window(cfg)
        elif tuple(window.shape) != (cfg.win_length,):
            raise ValueError(f"window buffer has shape {tuple(window.shape)}, expected ({cfg.win_length},)")
        if fb is None:
            fb = mel_filterbank(cfg.sample_rate, cfg.n_fft_resolved, cfg.features, cfg.lowfreq,
                                cfg.highfreq, cfg.mel_norm)
        fb = fb.reshape(fb.shape[-2], fb.shape[-1]) if fb.dim() == 3 else fb
        if tuple(fb.shape) != (cfg.features, n_bins):
            raise ValueError(f"fb buffer has shape {tuple(fb.shape)}, expected ({cfg.features}, {n_bins})")
        self.register_buffer("window", window.float().contiguous(), persistent=False)
        self.register_buffer("fb", fb.float().contiguous(), persistent=False)

    @classmethod
    def from_archive(cls, archive: Any, state_dict: dict[str, torch.Tensor] | None = None) -> "LogMel":
        """From a `NemoArchive`, using the checkpoint's own window and filterbank buffers.

        Pass `state_dict` when the caller already loaded the weights, to avoid a second read.
        """
        from engines.checkpoint import sub_state_dict  # local: keep this module light to import

        if not isinstance(archive.config.get("preprocessor"), dict):
            raise ValueError(f"{archive.path}: model config has no preprocessor section")
        cfg = FeatureConfig.from_nemo(archive.config["preprocessor"])
        sd = archive.state_dict() if state_dict is None else state_dict
        bufs = sub_state_dict(sd, "preprocessor.featurizer")
        return cls(cfg, window=bufs.get("window"), fb=bufs.get("fb"))

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio [B, T] float32 (zero-padded batch), lengths [B] int64 samples ->
        (features [B, n_mels, frames] float32, frame_lengths [B] int64 valid frames).

        As in NeMo, `frames` is T // hop + 1 (rounded up to pad_to) while an item of `len`
        samples has len // hop valid frames; every frame past those holds `pad_value`.
        """
        if audio.dim() != 2 or lengths.shape != (audio.shape[0],):
            raise ValueError(f"expected audio [B, T] and lengths [B], got {tuple(audio.shape)} and {tuple(lengths.shape)}")
        cfg = self.cfg
        audio = audio.float()
        frame_lengths = cfg.frame_count(lengths)
        power = self._power_spectrum(audio, lengths)
        x = torch.matmul(self.fb, power)  # [n_mels, bins] @ [B, bins, frames]
        if cfg.log:
            x = self._log(x)
        frame_valid = torch.arange(x.shape[-1], device=x.device)[None, :] < frame_lengths[:, None]
        mode = cfg.normalize_mode
        if mode is not None:
            x = _normalize(x, frame_valid, frame_lengths, per_feature=(mode == "per_feature"))
        x = x.masked_fill(~frame_valid[:, None, :], cfg.pad_value)
        if cfg.pad_to > 0 and x.shape[-1] % cfg.pad_to:
            x = torch.nn.functional.pad(x, (0, cfg.pad_to - x.shape[-1] % cfg.pad_to), value=cfg.pad_value)
        return x, frame_lengths

    def _power_spectrum(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T] samples -> [B, n_fft//2+1, frames] |STFT|**mag_power."""
        cfg = self.cfg
        if cfg.exact_pad:
            # NeMo pads before preemphasis and masks with the unpadded lengths; reproduced as is.
            pad = (cfg.n_fft_resolved - cfg.hop_length) // 2
            audio = torch.nn.functional.pad(audio, (pad, pad))
        if cfg.preemph is not None:
            audio = torch.cat((audio[:, :1], audio[:, 1:] - cfg.preemph * audio[:, :-1]), dim=1)
        # Zero everything past each item's end so batch padding cannot reach its frames.
        if bool((lengths < audio.shape[1]).any()):
            sample_valid = torch.arange(audio.shape[1], device=audio.device)[None, :] < lengths[:, None]
            audio = audio.masked_fill(~sample_valid, 0.0)
        spec = torch.stft(
            audio, n_fft=cfg.n_fft_resolved, hop_length=cfg.hop_length, win_length=cfg.win_length,
            window=self.window, center=not cfg.exact_pad, pad_mode="constant", return_complex=True,
        )
        ri = torch.view_as_real(spec)
        power = ri[..., 0].square() + ri[..., 1].square()
        if cfg.mag_power == 2.0:
            return power  # skip NeMo's sqrt-then-square: equal to within float rounding
        return power.sqrt().pow(cfg.mag_power) if cfg.mag_power != 1.0 else power.sqrt()

    def _log(self, x: torch.Tensor) -> torch.Tensor:
        guard = self.cfg.log_zero_guard_value
        if isinstance(guard, str):
            guard = getattr(torch.finfo(x.dtype), guard)  # 'tiny' or 'eps', validated in config
        if self.cfg.log_zero_guard_type == "add":
            return torch.log(x + guard)
        return torch.log(torch.clamp(x, min=guard))


def _normalize(x: torch.Tensor, valid: torch.Tensor, n: torch.Tensor, per_feature: bool) -> torch.Tensor:
    """NeMo's normalize_batch over valid frames only: (x - mean) / (unbiased std + 1e-5).

    x [B, F, frames]; valid [B, frames] bool; n [B] valid frame counts. per_feature reduces over
    time for each mel bin; otherwise over all bins and time of the item.
    """
    dims = (2,) if per_feature else (1, 2)
    m = valid[:, None, :]
    count = n.to(x.dtype).view(-1, 1, 1)
    if not per_feature:
        count = count * x.shape[1]
    mean = torch.where(m, x, 0.0).sum(dim=dims, keepdim=True) / count
    var = torch.where(m, x - mean, 0.0).square().sum(dim=dims, keepdim=True) / (count - 1.0)
    # One valid frame gives 0/0: NeMo maps that NaN std to 0 rather than failing.
    std = torch.nan_to_num(var.sqrt(), nan=0.0)
    return (x - mean) / (std + STD_EPS)
