"""Log-mel front end against NeMo's own features, and its config handling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import NEMO_REF, Reference, needs_shared
from engines.checkpoint import NemoArchive, sub_state_dict
from transcribe.audio import load_audio
from transcribe.features import FeatureConfig, LogMel, make_window, mel_filterbank

FEATURE_ATOL = 1e-3  # fixtures README: what a faithful implementation reaches


def _front_end(ref: Reference) -> tuple[LogMel, dict[str, torch.Tensor]]:
    with NemoArchive(ref.nemo) as archive:
        bufs = sub_state_dict(archive.state_dict(), "preprocessor.featurizer")
        return LogMel.from_archive(archive), bufs


def _features(lm: LogMel, x: np.ndarray) -> tuple[torch.Tensor, int]:
    feats, n = lm(torch.from_numpy(x)[None], torch.tensor([len(x)]))
    return feats[0], int(n[0])


def test_matches_nemo_features(reference: Reference) -> None:
    lm, _ = _front_end(reference)
    errors = []
    for i, meta in enumerate(reference.files):
        x = load_audio(reference.audio_path(i), lm.cfg.sample_rate)
        assert len(x) == meta["samples"]
        feats, frames = _features(lm, x)
        want = torch.from_numpy(reference.array("features", i))
        assert frames == meta["feature_frames"] == want.shape[1]
        assert feats.shape == (lm.cfg.features, len(x) // lm.cfg.hop_length + 1)
        errors.append((feats[:, :frames] - want).abs().max().item())
        # NeMo's extra trailing stft frame is padding, not signal.
        assert torch.all(feats[:, frames:] == lm.cfg.pad_value)
    print(f"{reference.dir.name}: max abs feature error {max(errors):.3g}")
    assert max(errors) < FEATURE_ATOL


def test_batched_equals_per_file(reference: Reference) -> None:
    lm, _ = _front_end(reference)
    audios = [load_audio(reference.audio_path(i), 16000) for i in range(len(reference.files))]
    lengths = torch.tensor([len(a) for a in audios])
    batch = torch.zeros(len(audios), int(lengths.max()))
    for row, a in zip(batch, audios):
        row[: len(a)] = torch.from_numpy(a)
    feats, frames = lm(batch, lengths)
    assert feats.shape[0] == len(audios)
    for i, a in enumerate(audios):
        single, n = _features(lm, a)
        assert int(frames[i]) == n == reference.files[i]["feature_frames"]
        torch.testing.assert_close(feats[i, :, : single.shape[1]], single, atol=1e-5, rtol=0)
        assert torch.all(feats[i, :, n:] == lm.cfg.pad_value)


def test_filterbank_and_window_from_scratch(reference: Reference) -> None:
    lm, bufs = _front_end(reference)
    cfg = lm.cfg
    fb = mel_filterbank(cfg.sample_rate, cfg.n_fft_resolved, cfg.features, cfg.lowfreq, cfg.highfreq)
    assert fb.shape == bufs["fb"].shape[1:]
    torch.testing.assert_close(fb, bufs["fb"][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(make_window(cfg), bufs["window"], atol=1e-7, rtol=0)
    # A front end built without the checkpoint's buffers still reproduces NeMo.
    x = load_audio(reference.audio_path(0), cfg.sample_rate)
    feats, frames = _features(LogMel(cfg), x)
    want = torch.from_numpy(reference.array("features", 0))
    assert (feats[:, :frames] - want).abs().max().item() < FEATURE_ATOL


@needs_shared
def test_streaming_config_has_no_normalisation() -> None:
    with NemoArchive(NEMO_REF / "rnnt_streaming_tiny" / "model.nemo") as archive:
        lm = LogMel.from_archive(archive)
    assert lm.cfg.normalize == "NA" and lm.cfg.normalize_mode is None
    x = np.sin(np.arange(8000) * 0.1).astype(np.float32)
    feats, frames = _features(lm, x)
    # Un-normalised log-mel of a loud tone: a per-bin mean far from 0.
    assert feats[:, :frames].mean(dim=1).abs().max() > 1.0
    torch.testing.assert_close(feats[:, :frames], _numpy_log_mel(x, lm), atol=1e-4, rtol=1e-5)


def _numpy_log_mel(x: np.ndarray, lm: LogMel) -> torch.Tensor:
    """Independent float64 reference: preemphasis, zero-padded centred frames, |rfft|^2, mel, log."""
    cfg = lm.cfg
    n_fft, hop, win = cfg.n_fft_resolved, cfg.hop_length, cfg.win_length
    y = np.concatenate([x[:1], x[1:] - cfg.preemph * x[:-1]]).astype(np.float64)
    y = np.pad(y, (n_fft // 2, n_fft // 2))
    window = np.zeros(n_fft)
    window[(n_fft - win) // 2 : (n_fft - win) // 2 + win] = lm.window.double().numpy()
    n_frames = len(x) // hop
    frames = np.stack([y[t * hop : t * hop + n_fft] * window for t in range(n_frames)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    mel = lm.fb.double().numpy() @ power.T
    return torch.from_numpy(np.log(mel + 2.0**-24)).float()


def _cfg(**kw) -> FeatureConfig:
    return FeatureConfig.from_nemo({"window_size": 0.025, "features": 80, "n_fft": 512, "pad_to": 0, **kw})


def test_defaults_follow_nemo() -> None:
    cfg = FeatureConfig.from_nemo({"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor"})
    assert (cfg.win_length, cfg.hop_length, cfg.n_fft_resolved) == (320, 160, 512)
    assert (cfg.features, cfg.pad_to, cfg.preemph, cfg.normalize_mode) == (64, 16, 0.97, "per_feature")
    assert cfg.log_zero_guard_value == 2**-24 and cfg.mag_power == 2.0 and cfg.mel_norm == "slaney"
    assert cfg.frame_seconds == pytest.approx(0.01)
    # NeMo's sample-count spelling of the window is accepted too.
    alt = FeatureConfig.from_nemo({"window_size": None, "window_stride": None, "n_window_size": 400,
                                   "n_window_stride": 128})
    assert (alt.win_length, alt.hop_length) == (400, 128)


@pytest.mark.parametrize(
    "key,value",
    [
        ("normalize", "per_channel"),
        ("normalize", {"fixed_mean": [0.0], "fixed_std": [1.0]}),
        ("log_zero_guard_type", "max"),
        ("log_zero_guard_value", "huge"),
        ("frame_splicing", 3),
        ("window", "kaiser"),
        ("mel_norm", "htk"),
        ("pad_to", "max"),
        ("n_fft", 256),
        ("_target_", "nemo.collections.asr.modules.AudioToMFCCPreprocessor"),
        ("unknown_option", 7),
    ],
)
def test_unsupported_config_names_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        _cfg(**{key: value})
    assert key in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("guard_type,guard,expected", [
    ("add", 2**-24, math.log(2**-24)),
    ("clamp", "tiny", math.log(torch.finfo(torch.float32).tiny)),
    ("add", "eps", math.log(torch.finfo(torch.float32).eps)),
])
def test_log_zero_guard_on_silence(guard_type: str, guard: object, expected: float) -> None:
    lm = LogMel(_cfg(normalize="NA", log_zero_guard_type=guard_type, log_zero_guard_value=guard))
    feats, frames = _features(lm, np.zeros(1600, dtype=np.float32))
    assert frames == 10
    torch.testing.assert_close(feats[:, :frames], torch.full((80, 10), expected), atol=1e-5, rtol=0)


def test_normalisation_statistics_and_pad_to() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(16000 + 37).astype(np.float32) * 0.1
    for mode in ("per_feature", "all_features"):
        lm = LogMel(_cfg(normalize=mode, pad_to=16, pad_value=-5.0))
        feats, frames = _features(lm, x)
        assert frames == 100 and feats.shape[1] % 16 == 0 and feats.shape[1] >= frames
        assert torch.all(feats[:, frames:] == -5.0)
        valid = feats[:, :frames].double()
        dim = 1 if mode == "per_feature" else None
        mean = valid.mean(dim=dim) if dim else valid.mean()
        std = valid.std(dim=dim) if dim else valid.std()
        assert mean.abs().max() < 1e-5
        torch.testing.assert_close(std, torch.ones_like(std), atol=1e-3, rtol=0)


def test_single_frame_item_is_finite() -> None:
    lm = LogMel(_cfg())
    x = np.random.default_rng(1).standard_normal(400).astype(np.float32)
    feats, frames = _features(lm, x)
    assert frames == 2 and torch.isfinite(feats).all()
    feats, frames = _features(lm, x[:200])  # one valid frame: NeMo's std 0 -> divide by 1e-5
    assert frames == 1 and torch.isfinite(feats).all()
