"""decode.AudioStream on what real archives hold: every container cut short fails as
truncated (and whole ones read), joined or padded MP3s and mislabelled MP4s read whole,
folders find every extension the decoder reads, and SPHERE files are read as their headers say."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from transcribe.audio import AudioError
from transcribe.decode import AV_EXTENSIONS, AudioStream
from transcribe.inputs import AUDIO_EXTENSIONS, discover

RATE = 16000


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def _read(path: Path) -> tuple[np.ndarray, AudioStream]:
    with AudioStream(path, RATE) as s:
        return np.concatenate(list(s.blocks())), s


@pytest.mark.parametrize("fmt,ext", [("WAV", "wav"), ("AIFF", "aiff"), ("AU", "au"), ("W64", "w64"),
                                     ("RF64", "rf64"), ("NIST", "sph")])
def test_a_cut_off_file_of_any_container_fails_as_truncated(tmp_path, fmt, ext):
    """libsndfile reads the frames a cut file holds: an AIFF, AU, W64, RF64 or SPHERE file cut to
    60 % was transcribed as ok without the rest (only WAV's cut was caught)."""
    whole = tmp_path / f"whole.{ext}"
    sf.write(whole, _noise(3.0), RATE, format=fmt, subtype="PCM_16")
    got, _ = _read(whole)
    assert got.shape[0] == 3 * RATE
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(whole.read_bytes()[:int(whole.stat().st_size * 0.6)])
    with pytest.raises(AudioError, match="truncated"):
        _read(cut)


def test_a_wav_whose_size_counts_a_few_bytes_too_many_reads_whole(tmp_path):
    """A writer counting the chunk header in the data size: every sample is there ("truncated" before)."""
    path = tmp_path / "plus8.wav"
    sf.write(path, _noise(1.0), RATE, subtype="PCM_16")
    data = bytearray(path.read_bytes())
    at = data.index(b"data") + 4
    data[at:at + 4] = (int.from_bytes(data[at:at + 4], "little") + 8).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    got, _ = _read(path)
    assert got.shape[0] == RATE


def _encoded(path: Path, container: str, codec: str, seconds: float, seed: int = 0, title: str | None = None,
             **options: str) -> None:
    """`seconds` of noise encoded by FFmpeg (PyAV) with `codec` into `container`."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w", format=container, options=options) as out:
        if title is not None:
            out.metadata["title"] = title
        stream = out.add_stream(codec, rate=RATE, layout="mono")
        samples = _noise(seconds, seed)
        for i in range(0, samples.shape[0], 1024):
            frame = av.AudioFrame.from_ndarray(samples[None, i:i + 1024], format="fltp", layout="mono")
            frame.sample_rate = RATE
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def _mp3(path: Path, seconds: float, seed: int, title: str) -> None:
    """An MP3 as LAME and FFmpeg write them: an ID3v2 tag, then a Xing header."""
    _encoded(path, "mp3", "libmp3lame", seconds, seed, title)


def test_joined_tagged_mp3s_and_zero_padding_read_whole(tmp_path):
    """`cat a.mp3 b.mp3` puts b's ID3 tag mid-stream, and downloads end in zero padding:
    FFmpeg's decoder refuses that packet, and stopping there failed the whole file."""
    a, b = tmp_path / "a.mp3", tmp_path / "b.mp3"
    _mp3(a, 6.0, 1, "a")
    _mp3(b, 4.0, 2, "b")
    (tmp_path / "ab.mp3").write_bytes(a.read_bytes() + b.read_bytes())
    got, _ = _read(tmp_path / "ab.mp3")
    assert abs(got.shape[0] / RATE - 10.0) < 0.2
    (tmp_path / "padded.mp3").write_bytes(a.read_bytes() + bytes(50_000))
    got, _ = _read(tmp_path / "padded.mp3")
    assert abs(got.shape[0] / RATE - 6.0) < 0.2


def _m4a(path: Path, seconds: float, **options: str) -> None:
    _encoded(path, "mp4", "aac", seconds, **options)


def test_an_mp4_named_mp3_is_read_for_what_it_is(tmp_path):
    """Podcast and download tools name AAC-in-MP4 files .mp3: libsndfile cannot open them."""
    path = tmp_path / "episode.mp3"
    _m4a(path, 3.0)
    got, _ = _read(path)
    assert abs(got.shape[0] / RATE - 3.0) < 0.1
    text = tmp_path / "notes.mp3"
    text.write_text("not audio\n" * 100)
    with pytest.raises(AudioError, match="not a readable audio file"):
        _read(text)


def test_folders_find_every_extension_the_decoder_reads(tmp_path):
    """A folder's .mov (which decode reads through PyAV), .m4b or .3gp was skipped without a word."""
    assert AV_EXTENSIONS <= AUDIO_EXTENSIONS
    for ext in (".mov", ".m4b", ".3gp", ".amr", ".rf64", ".mka"):
        (tmp_path / f"x{ext}").write_bytes(b"")
    assert {f.path.suffix for f in discover([str(tmp_path)])} == {".mov", ".m4b", ".3gp", ".amr", ".rf64", ".mka"}


def test_an_mp3_cut_short_of_its_xing_frame_count_fails_as_truncated(tmp_path):
    """A Xing/Info frame count is exact: an MP3 cut at 96 % (2.4 s of 60 gone) read as ok, the
    5 % slack for lengths libsndfile estimates applied to it too."""
    whole = tmp_path / "whole.mp3"
    _mp3(whole, 60.0, 3, "t")
    got, _ = _read(whole)
    assert abs(got.shape[0] / RATE - 60.0) < 0.1
    cut = tmp_path / "cut.mp3"
    cut.write_bytes(whole.read_bytes()[:int(whole.stat().st_size * 0.96)])
    with pytest.raises(AudioError, match="truncated"):
        _read(cut)


def test_a_cut_off_m4a_fails_as_truncated(tmp_path):
    """Its index (moov first, as web-ready files have it) gives the length: once undecodable
    packets were skipped, a half M4A decoded to its cut as ok."""
    whole = tmp_path / "whole.m4a"
    _m4a(whole, 20.0, movflags="faststart")
    got, _ = _read(whole)
    assert abs(got.shape[0] / RATE - 20.0) < 0.2
    cut = tmp_path / "half.m4a"
    cut.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    with pytest.raises(AudioError, match="truncated"):
        _read(cut)


def _sphere(path: Path, samples: np.ndarray, count: int) -> None:
    pcm = (samples * 32767).astype("<i2").tobytes()
    header = (f"NIST_1A\n   1024\nsample_count -i {count}\nsample_rate -i {RATE}\nchannel_count -i 1\n"
              "sample_n_bytes -i 2\nsample_byte_format -s2 01\nsample_coding -s3 pcm\n"
              "end_head\n").encode()
    path.write_bytes(header.ljust(1024, b" ") + pcm)


def test_sphere_files_are_read_as_their_headers_say(tmp_path):
    """A cut SPHERE file fails as truncated (nothing in libsndfile's log says so); a count of
    every channel's samples is not a cut."""
    x = _noise(2.0)
    _sphere(tmp_path / "whole.sph", x, x.shape[0])
    assert _read(tmp_path / "whole.sph")[0].shape[0] == x.shape[0]
    _sphere(tmp_path / "cut.sph", x[:RATE], x.shape[0])
    with pytest.raises(AudioError, match="truncated: the header promises 32000 samples"):
        _read(tmp_path / "cut.sph")
    stereo = np.repeat(x, 2)  # a stereo file whose count is of both channels' samples
    path = tmp_path / "both.sph"
    _sphere(path, stereo, stereo.shape[0])
    path.write_bytes(path.read_bytes().replace(b"channel_count -i 1", b"channel_count -i 2"))
    assert _read(path)[0].shape[0] == x.shape[0]


def test_a_segment_of_an_m4a_is_sought_and_equals_the_whole_decode(tmp_path):
    """A manifest segment of an M4A seeks through the container's index (from a second before,
    for the codec's state to settle) instead of decoding from the file's start each time: the
    same samples as cutting the whole decode."""
    path = tmp_path / "talk.m4a"
    _m4a(path, 30.0)
    whole, _ = _read(path)
    for start, length in ((0.0, 3.0), (0.7, 2.0), (5.3, 4.1), (12.71, 10.0), (27.0, None)):
        with AudioStream(path, RATE, span=(start, length)) as s:
            got = np.concatenate(list(s.blocks()))
            sought = s._source._from
        a = round(start * RATE)
        assert sought == (a if start > 1.0 else None)  # from its index, where there is a second before
        want = whole[a:] if length is None else whole[a:a + round(length * RATE)]
        assert got.shape == want.shape and np.array_equal(got, want), (start, np.abs(got - want).max())
