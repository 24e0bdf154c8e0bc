"""Resampling as NeMo's `transcribe()` does it (lhotse, by scipy's resample_poly): any blocks
give the same samples, both kernel layouts agree, and the filter passes speech and stops
aliasing. NeMo's own samples and transcripts: tests/test_nemo_edges.py."""
import numpy as np
import pytest

from transcribe import resample as resampling
from transcribe.resample import Resampler, output_length, resample


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000, 44101])
def test_any_blocks_give_the_same_samples(rate):
    """A worker feeds ~2 MB blocks, `load_audio` the whole file: the same samples, bit for bit
    (a matrix product's sums depend on its shape, so groups are computed in fixed chunks).
    44101 Hz (gcd 1 with 16 kHz) takes the band-of-taps path; its whole kernel would take 2.8 GB."""
    x = (np.random.default_rng(rate).standard_normal(rate * 3 + 11) * 0.3).astype(np.float32)
    whole = resample(x, rate, 16000)
    stream, parts, at = Resampler(rate, 16000), [], 0
    for size in (1, 5, 999, 4096, 31_000, 1 << 30):
        parts.append(stream.resample_chunk(x[at:at + size]))
        at += size
    parts.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    assert np.array_equal(np.concatenate(parts), whole)  # the stream comes to the same length itself
    assert whole.shape[0] == output_length(x.shape[0], rate, 16000)


def test_band_path_equals_the_whole_kernel(monkeypatch):
    """The band-of-taps path (rates whose kernel is too big) computes what the whole kernel does."""
    x = (np.random.default_rng(0).standard_normal(44100 * 2) * 0.3).astype(np.float32)
    dense = resample(x, 44100, 16000)
    monkeypatch.setattr(resampling, "DENSE_MAX", 0)
    assert Resampler(44100, 16000).cols is not None
    assert np.abs(resample(x, 44100, 16000) - dense).max() < 1e-6


def test_a_tone_keeps_its_pitch_and_level():
    """Pass band: a 440 Hz tone at 44.1 kHz is a 440 Hz tone of the same level at 16 kHz;
    stop band: 9 kHz at 48 kHz, which would alias to 7 kHz, is filtered out."""
    t = np.arange(44100 * 2) / 44100
    y = resample((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 44100, 16000)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.shape[0])))
    assert abs(np.argmax(spectrum) * 16000 / y.shape[0] - 440) < 2
    assert np.max(np.abs(y[1000:-1000])) == pytest.approx(0.5, abs=0.01)
    t = np.arange(48000 * 2) / 48000
    high = resample((0.5 * np.sin(2 * np.pi * 9000 * t)).astype(np.float32), 48000, 16000)
    assert np.max(np.abs(high[1000:-1000])) < 0.025  # -30 dB: a Kaiser window, beta 5
