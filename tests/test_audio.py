"""Audio loading: what NeMo saw (libsndfile float32, channel average, its resampling), and clean errors."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import SPEECH, Reference, needs_shared
from transcribe.audio import AudioError, audio_info, load_audio
from transcribe.resample import output_length, resample


def _tone(freq: float, rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


def test_int16_wav_is_scaled_like_nemo(tmp_path: Path) -> None:
    pcm = np.array([0, 1, -1, 16384, -32768, 32767] * 100, dtype=np.int16)
    path = tmp_path / "pcm.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    x = load_audio(path, 16000)
    assert x.dtype == np.float32 and x.ndim == 1
    np.testing.assert_array_equal(x, pcm.astype(np.float32) / 32768.0)


def test_stereo_is_averaged(tmp_path: Path) -> None:
    left, right = _tone(300, 16000, 0.5), _tone(1100, 16000, 0.5) * 0.25
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    x = load_audio(path, 16000)
    np.testing.assert_allclose(x, (left + right) / 2, atol=1e-7)
    assert audio_info(path) == (pytest.approx(0.5), 16000, 2)


@pytest.mark.parametrize("source_rate", [44100, 48000, 8000])
def test_resampling_length_and_content(tmp_path: Path, source_rate: int) -> None:
    n = int(source_rate * 1.3) + 7  # not a whole number of output samples
    tone = _tone(440, source_rate, 2.0)[:n]
    path = tmp_path / f"tone_{source_rate}.flac"
    sf.write(path, tone, source_rate, subtype="PCM_24")
    x = load_audio(path, 16000)
    assert len(x) == output_length(n, source_rate, 16000)  # lhotse's length (tests/test_resample.py)
    assert abs(_peak_hz(x, 16000) - 440) < 2
    # Level is preserved away from the edges (the pass band is flat at 440 Hz).
    assert np.max(np.abs(x[1000:-1000])) == pytest.approx(0.5, abs=0.01)


def test_resample_is_identity_at_same_rate() -> None:
    x = _tone(440, 16000, 0.1)
    assert resample(x, 16000, 16000) is x


def _assert_audio_error(path: Path, fragment: str) -> None:
    with pytest.raises(AudioError) as err:
        load_audio(path, 16000)
    assert isinstance(err.value, ValueError)
    assert str(path) in str(err.value) and fragment in str(err.value)
    assert err.value.path == str(path)


def test_missing_file(tmp_path: Path) -> None:
    _assert_audio_error(tmp_path / "nope.wav", "no such file")
    with pytest.raises(AudioError, match="no such file"):
        audio_info(tmp_path / "nope.wav")


def test_a_broken_symlink_or_a_loop_says_so(tmp_path: Path) -> None:
    """A loop (x -> y -> x) was "no such file", as Path.exists() says of it: the system's reason."""
    (tmp_path / "gone.wav").symlink_to(tmp_path / "nowhere.wav")
    _assert_audio_error(tmp_path / "gone.wav", "no such file (a symlink to nothing)")
    (tmp_path / "x.wav").symlink_to(tmp_path / "y.wav")
    (tmp_path / "y.wav").symlink_to(tmp_path / "x.wav")
    _assert_audio_error(tmp_path / "x.wav", "cannot look at it (Too many levels of symbolic links)")


def test_directory_is_not_audio(tmp_path: Path) -> None:
    _assert_audio_error(tmp_path, "not a regular file")


def test_zero_byte_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    _assert_audio_error(path, "empty")


def test_wav_with_no_samples(tmp_path: Path) -> None:
    path = tmp_path / "noframes.wav"
    sf.write(path, np.zeros(0, dtype=np.float32), 16000)
    _assert_audio_error(path, "no audio samples")


def test_text_renamed_wav(tmp_path: Path) -> None:
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n" * 20)
    _assert_audio_error(path, "not a readable audio file")
    with pytest.raises(AudioError, match="not a readable audio file"):
        audio_info(path)


def test_truncated_flac(tmp_path: Path) -> None:
    good = tmp_path / "good.flac"
    sf.write(good, np.random.default_rng(0).standard_normal(48000).astype(np.float32) * 0.1, 16000)
    data = good.read_bytes()
    for name, cut in (("half.flac", len(data) // 2), ("header.flac", 60)):
        path = tmp_path / name
        path.write_bytes(data[:cut])
        _assert_audio_error(path, "not a readable audio file")


def test_shorter_than_one_window_loads(tmp_path: Path) -> None:
    """NeMo transcribes a file of one sample (tests/test_nemo_edges.py); a caller may ask for more."""
    path = tmp_path / "blip.wav"
    sf.write(path, np.zeros(1, dtype=np.float32), 16000)
    assert len(load_audio(path, 16000)) == 1
    with pytest.raises(AudioError, match="too short: 1 samples at 16000 Hz, need at least 400"):
        load_audio(path, 16000, min_samples=400)


def test_non_finite_samples(tmp_path: Path) -> None:
    path = tmp_path / "nan.wav"
    x = np.zeros(1600, dtype=np.float32)
    x[100] = np.nan
    sf.write(path, x, 16000, subtype="FLOAT")
    _assert_audio_error(path, "NaN")


def test_reference_audio_lengths(reference: Reference) -> None:
    for i, meta in enumerate(reference.files):
        path = reference.audio_path(i)
        x = load_audio(path, 16000)
        assert len(x) == meta["samples"]
        duration, rate, channels = audio_info(path)
        assert (rate, channels) == (16000, 1) and duration == pytest.approx(meta["samples"] / 16000)


@needs_shared
def test_mp3_decodes_when_libsndfile_supports_it() -> None:
    if "MP3" not in sf.available_formats():
        pytest.skip(f"libsndfile {sf.__libsndfile_version__} has no MP3 support")
    mp3s = sorted(SPEECH.rglob("*.mp3"))
    if not mp3s:
        pytest.skip("no MP3 files in shared data")
    path = min(mp3s, key=lambda p: p.stat().st_size)
    duration, rate, _ = audio_info(path)
    x = load_audio(path, 16000)
    assert x.dtype == np.float32 and x.ndim == 1 and np.isfinite(x).all()
    # The header duration is an estimate for MP3; the decode agrees to within a few frames.
    assert len(x) / 16000 == pytest.approx(duration, abs=0.1)
    assert np.abs(x).max() > 0.01  # speech, not silence


@needs_shared
def test_a_vbr_mp3_reads_in_our_blocks_as_ffmpeg_decodes_it(tmp_path: Path) -> None:
    """libsndfile 1.2.2 decodes a VBR MP3 wrongly when it is read in small blocks: a 48 kHz
    stereo LAME VBR file read 4096 frames at a time differs from one whole read, which equals
    FFmpeg's decoding, by up to 0.1 over ~0.2 s stretches. Our ~2 MB blocks (BLOCK_BYTES) read
    it as FFmpeg does; this fails if they shrink to where libsndfile goes wrong."""
    av = pytest.importorskip("av")
    from transcribe.resample import resample
    from transcribe.decode import _SoundfileSource

    speech, rate = sf.read(SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac", dtype="float32")
    y = resample(speech[: 40 * rate], rate, 48000)
    path = tmp_path / "vbr.mp3"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libmp3lame", rate=48000, layout="stereo")
        stream.codec_context.qscale, stream.codec_context.flags = 4, stream.codec_context.flags | 2  # VBR (QSCALE)
        planes = np.stack([y, 0.8 * y])
        for i in range(0, planes.shape[1], 48000):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, i:i + 48000]), format="fltp",
                                               layout="stereo")
            frame.sample_rate = 48000
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    with av.open(str(path)) as c:
        ffmpeg = np.concatenate([f.to_ndarray() for f in c.decode(audio=0)], axis=1).mean(axis=0)
    source = _SoundfileSource(path)
    try:
        ours = np.concatenate(list(source.mono_blocks()))
    finally:
        source.close()
    assert ours.shape == ffmpeg.shape
    assert float(np.abs(ours - ffmpeg).max()) < 1e-4  # 0.1 with BLOCK_BYTES = 32 KiB (4096 frames)
