"""Resampling as NeMo's `transcribe()` does it (lhotse, by scipy's resample_poly): the samples lhotse hands
NeMo's model, and NeMo's transcripts of 8 / 22.05 / 44.1 / 48 kHz files through our command
line (tests/data/nemo_resample, made by bench/make_resample_references.py)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SPEECH, Reference, needs_shared
from test_cli import run_cli
from transcribe import resample as resampling
from transcribe.resample import Resampler, output_length, resample

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((Path(__file__).parent / "data" / "nemo_resample" / "reference.json").read_text())
_spec = importlib.util.spec_from_file_location("make_resample_references",
                                               ROOT / "bench" / "make_resample_references.py")
make_refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_refs)


@pytest.fixture(scope="module")
def derived(tmp_path_factory) -> dict[str, Path]:
    """The reference's input files, rebuilt byte for byte from the shared recordings."""
    folder = tmp_path_factory.mktemp("rates")
    return {p.name: p for p in make_refs.write_inputs(folder, SPEECH / "librispeech_test_other")}


@needs_shared
def test_samples_are_lhotses(derived):
    """What NeMo's model is fed: lhotse's count (round half up, not librosa's ceil) and values."""
    import soundfile as sf

    for name, ref in REFERENCE["files"].items():
        pcm, rate = sf.read(derived[name], dtype="float32")
        y = resample(pcm, rate, 16000)
        assert y.shape[0] == ref["lhotse_samples"] == output_length(pcm.shape[0], rate, 16000), name
        assert np.abs(y[1000:1008] - np.array(ref["lhotse_head"])).max() < 1e-6, name
        assert abs(float(np.sqrt(np.mean(y.astype(np.float64) ** 2))) - ref["lhotse_rms"]) < 1e-6, name


@needs_shared
@pytest.mark.parametrize("variant", sorted({m for f in REFERENCE["files"].values() for m in f["models"]}))
def test_cli_reproduces_nemo_at_other_rates(variant, derived, tmp_path):
    """soxr (librosa's resampler, which we used) gave other text on every model at 8 kHz."""
    out = tmp_path / "out"
    p = run_cli(*map(str, derived.values()), "--model", str(Reference(variant).nemo), "--out", str(out),
                "--format", "json", "--batch-seconds", "20")
    assert p.returncode == 0, p.stderr
    for name, ref in REFERENCE["files"].items():
        doc = json.loads((out / Path(name).with_suffix(".json").name).read_text())
        nemo = ref["models"][variant]
        assert doc["text"] == nemo["transcribe_text"], name
        end = ref["lhotse_samples"] / 16000  # NeMo's last word may end past the audio; ours does not
        assert [(w["word"], w["start"], w["end"]) for w in doc["words"]] == [
            (w["word"], round(min(w["start"], end), 3), round(min(w["end"], end), 3)) for w in nemo["words"]], name


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
    assert np.array_equal(np.concatenate(parts)[:whole.shape[0]], whole)
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
