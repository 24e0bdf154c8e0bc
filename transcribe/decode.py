"""Streamed decoding: an audio file -> blocks of mono float32 samples at the model's rate.

A worker never holds a whole long file: soundfile reads fixed blocks into one reused buffer,
channels are averaged, and `transcribe.resample.Resampler` (NeMo's `transcribe()`
resampling) resamples block by block. It gives the same samples as one-shot
`transcribe.resample.resample` for any block size, to lhotse's length, so files decode
exactly as `load_audio` decodes them. Containers libsndfile cannot read (mp4, m4a,
aac, webm, ...) go through PyAV, the optional `av` extra, imported only when needed.
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import soundfile as sf

# _check_path / _open_error: the same file checks and libsndfile messages as load_audio.
from transcribe.audio import DEFAULT_MIN_SAMPLES, AudioError, _check_path, _open_error, sndfile_path
from transcribe.ogg_end import ogg_chained, ogg_cut_off
from transcribe.resample import Resampler

AV_EXTENSIONS = frozenset(".mp4 .m4a .m4b .aac .webm .weba .mkv .mka .mov .wma .3gp .3g2 .amr".split())
MIN_RATE, MAX_RATE = 4000, 768_000  # below 4 kHz speech is cut to under 2 kHz bandwidth
MAX_CHANNELS = 64
# ~2 MB of decoded float32 per block, whatever the channel count. Not much smaller: libsndfile
# 1.2.2 decodes VBR MP3s wrongly in small reads (4096 frames: stretches off by up to 0.1; at
# this size LAME VBR files read as FFmpeg decodes them, tests/test_audio.py).
BLOCK_BYTES = 1 << 21
# libsndfile's log for a file whose data chunk promises more bytes than the file holds, and
# then reads as many frames as are there: WAV "data", AIFF "SSND", AU "Data Size", and for W64
# and RF64, whose data line gives no "should be", the whole file's "riff" / "Riff size" (a WAV's
# "RIFF" line is not read: a wrong RIFF size is common and harmless there). A cut AIFF, AU, W64
# or RF64 was transcribed as ok without 40 % of its audio. NIST SPHERE logs nothing
# (`_sphere_count`).
_SHORT_DATA = re.compile(r"^\s*(?:data|SSND|Data Size|riff|Riff size)\s*:\s*(\d+) \(should be (\d+)\)",
                         re.MULTILINE)
_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # streaming writers leave the size open: not truncation (`_open_wav`)
# Bytes a data chunk may lack and still be whole: writers that count the chunk's own 8-byte
# header in its size (every sample is there; "truncated" failed the file).
SHORT_DATA_SLACK = 1024
# A chained Ogg stream (files joined end to end), of which libsndfile decodes only the first
# link: its frame count is SF_COUNT_MAX (unknown) when the links' serial numbers differ, and it
# logs junk after the first link when they are equal. Neither flags every join (two copies of
# one file, Opus links): `ogg_chained` walks the pages for a second stream's first page.
_UNKNOWN_FRAMES = 2**63 - 1
_OGG_JUNK = "Ogg: Junk after the last page"
# Decoding ending this far short of the header's length is a cut-off file (a half-copied MP3
# keeps its Xing header's full count). The fraction covers MP3s without a frame count, whose
# length libsndfile estimates from the file size: within ~2.5 % on our Common Voice files.
SHORT_FRACTION, SHORT_SECONDS = 0.05, 1.0
# MP3s joined end to end (`cat a.mp3 b.mp3`, chapters glued into one file) keep the first
# part's Xing/Info header, and libsndfile (mpg123) stops where its frame count ends: the rest
# would be dropped without a word. Such a file holds more MPEG bytes than that header declares;
# mpg123 itself warns past 1 %. Tags after the audio (ID3v1, APEv2) are not counted.
JOINED_MP3_SLACK = 0.01, 8192
# FFmpeg's names of the containers a file libsndfile cannot open is read as (by content).
MEDIA_CONTAINERS = frozenset("mov mp4 m4a 3gp 3g2 aac matroska webm asf amr".split())
INDEXED_CONTAINERS = frozenset("mov mp4 m4a 3gp 3g2 matroska webm asf".split())  # lengths from an index
PREROLL_S = 1.0  # decoded before a segment's start after a seek, then dropped
# Containers whose frames' timestamps count samples exactly (an MP4 track's time scale is its
# rate), so a segment sought through the index equals the whole decode cut. Matroska's are
# milliseconds, and Opus drops its pre-skip: a WebM segment came out misaligned (0.7 off).
SEEKABLE_CONTAINERS = frozenset("mov mp4 m4a 3gp 3g2".split())
# Undecodable packets PyAV skips before a file counts as corrupt rather than joined or padded.
MAX_BAD_PACKETS, BAD_PACKET_FRACTION = 8, 0.01
# Fewer bytes per second of audio than any speech codec needs (2.4 kbps is 300 B/s): what a
# file's size can hold at this rate bounds the length its header claims, for the hang timeout.
MIN_BYTES_PER_SECOND = 100


class AudioStream:
    """One file's samples as mono float32 blocks at `target_rate`.

    `duration` is the header's estimate (s) before decoding; `samples` counts what `blocks()`
    has produced. Raises AudioError (naming the file and why) on open or while decoding.
    """

    def __init__(self, path: str | Path, target_rate: int, min_samples: int = DEFAULT_MIN_SAMPLES,
                 span: tuple[float, float | None] | None = None):
        self.path = _check_path(path)
        self.target_rate = target_rate
        self.min_samples = min_samples
        self.span = span  # (start s, length s or None: to the end): a segment of the file
        self.samples = 0
        self._source = self._open_source()
        rate, channels = self._source.rate, self._source.channels
        reason = None
        if not MIN_RATE <= rate <= MAX_RATE:
            reason = f"unsupported sample rate {rate} Hz (need {MIN_RATE}-{MAX_RATE})"
        elif not 1 <= channels <= MAX_CHANNELS:
            reason = f"unsupported channel count {channels} (need 1-{MAX_CHANNELS})"
        if reason:
            self._source.close()  # workers are long-lived: never leak a file handle
            raise AudioError(self.path, reason)
        self.duration = self._source.frames / rate if self._source.frames else 0.0
        if span is not None:
            start, length = span
            self.duration = max(0.0, min(self.duration - start, length if length is not None else math.inf))

    def _open_source(self) -> "_SoundfileSource | _AvSource":
        """libsndfile, or PyAV for containers it cannot read and for files it would read only
        in part; AudioError for a cut-off Ogg. A libsndfile handle is closed on any error:
        workers are long-lived."""
        if self.path.suffix.lower() in AV_EXTENSIONS:
            return _AvSource(self.path)
        try:
            source = _SoundfileSource(self.path)
        except AudioError:
            # An MP4/AAC file named .mp3 (podcast and download tools) is not libsndfile's to
            # read: FFmpeg's probe names what it is. Only containers it names as audio/video
            # ones, so that a damaged or non-audio file keeps libsndfile's reason.
            av = _AvSource.sniffed(self.path)
            if av is None:
                raise
            return av
        try:
            # before `chained`: libsndfile logs junk after the last page for a cut-off file too
            cut = source.format == "OGG" and ogg_cut_off(self.path)
            if cut:
                raise AudioError(self.path, f"truncated: {cut}")
            if source.chained or source.format == "OGG" and ogg_chained(self.path):
                source.close()
                return _AvSource(self.path, "a chained Ogg stream (several joined)")
            if source.open_wav:
                source.close()
                return _AvSource(self.path, source.open_wav)
            joined = _joined(source.xing) if source.format == "MP3" else None
            if joined is None:
                return source
            declared, held = joined
            source.close()
            av = _AvSource(self.path, "MP3s joined end to end (the first one's Xing header "
                                      f"declares {declared} of the file's {held} MPEG bytes)")
            # FFmpeg's length, too, comes from that header: scale it to the bytes held (the
            # hang timeout allows for this length).
            av.frames = max(av.frames, round(source.frames * held / declared))
            return av
        except OSError as e:  # reading the file's end or head for the checks above
            source.close()
            raise AudioError(self.path, f"cannot read: {e}") from e
        except BaseException:
            source.close()
            raise

    @property
    def timeout_seconds(self) -> float:
        """The audio length the worker's hang timeout allows for: `duration`, but at most what
        the file's size can hold. A header may claim anything (a corrupt MP3's frame count, a
        stream whose length is unknown), and a decoder stuck on such a file must still time out
        rather than hold its worker, and the job, forever. A header with no length (browser-
        recorded WebM) gives 0: the pool renews the deadline with each piece, so a long such
        file is not cut off, and a hung decoder is still found within the base allowance."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return self.duration
        return min(self.duration, size / MIN_BYTES_PER_SECOND)

    def __enter__(self) -> "AudioStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.close()

    def blocks(self) -> Iterator[np.ndarray]:
        """Mono float32 blocks at target_rate (their total is `Resampler`'s length); the last
        one is checked against `min_samples` before it is given."""
        rate = self._source.rate
        stream = None if rate == self.target_rate else Resampler(rate, self.target_rate)
        n_in, held = 0, None
        for mono in self._mono_blocks():
            if not np.isfinite(mono).all():
                raise AudioError(self.path, "audio contains NaN or infinite samples")
            n_in += mono.shape[0]
            out = mono if stream is None else stream.resample_chunk(mono, last=False)
            if out.shape[0]:
                if held is not None:
                    self.samples += held.shape[0]
                    yield held
                held = out
        if n_in == 0:
            if self.span is not None and self.span[1] is not None and round(self.span[1] * rate) == 0:
                raise AudioError(self.path, f"an empty segment: duration {self.span[1]:g} s at offset "
                                            f"{self.span[0]:g} s holds no sample")
            if self.span is not None:
                raise AudioError(self.path, f"no audio samples from {self.span[0]:g} s on (offset past the end)")
            raise AudioError(self.path, "no audio samples (0 frames)")
        tail = [] if held is None else [held]
        if stream is not None:
            tail.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
        last = np.concatenate(tail) if len(tail) > 1 else tail[0]
        self.samples += last.shape[0]
        if self.samples < self.min_samples:
            raise AudioError(self.path, f"too short: {self.samples} samples at {self.target_rate} Hz, "
                                        f"need at least {self.min_samples}")
        yield last

    def _mono_blocks(self) -> Iterator[np.ndarray]:
        """The source's mono blocks at its own rate, only those of the span for a segment
        (soundfile seeks to its start; PyAV through an MP4's index, else it decodes from the
        beginning and drops the samples before it)."""
        if self.span is None:
            yield from self._source.mono_blocks()
            return
        rate = self._source.rate
        skip = round(min(self.span[0] * rate, 2**62))  # an offset of 1e308 s is past any end, not an overflow
        left = math.inf if self.span[1] is None else round(self.span[1] * rate)
        skip -= self._source.seek(skip)
        for mono in self._source.mono_blocks():
            if skip >= mono.shape[0]:
                skip -= mono.shape[0]
                continue
            mono = mono[skip:skip + left] if left < math.inf else mono[skip:]
            skip, left = 0, left - mono.shape[0]
            yield mono
            if left <= 0:
                return


class _SoundfileSource:
    """libsndfile (wav, flac, ogg/opus, mp3, aiff, ...), read in blocks into one buffer."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = sf.SoundFile(sndfile_path(path))
        except (sf.SoundFileError, OSError) as e:
            raise _open_error(path, e) from e
        self.rate, self.channels, self.frames = int(self._f.samplerate), int(self._f.channels), int(self._f.frames)
        self._at = 0  # the frame the next read starts at
        self.format = self._f.format
        self.chained = self.frames == _UNKNOWN_FRAMES or _OGG_JUNK in self._f.extra_info
        try:  # a libsndfile handle is closed on any error below: workers are long-lived
            short = _SHORT_DATA.search(self._f.extra_info)
            if short and int(short.group(1)) not in _UNKNOWN_SIZES and \
                    int(short.group(2)) + SHORT_DATA_SLACK < int(short.group(1)):
                raise AudioError(path, f"truncated: the header promises {short.group(1)} data bytes, "
                                       f"the file holds {short.group(2)}")
            promised = _sphere_count(path) if self.format == "NIST" else None
            # sample_count is per channel, but some tools count every channel's samples.
            if promised is not None and promised > self.frames + SHORT_DATA_SLACK // 2 \
                    and promised != self.frames * self.channels:
                raise AudioError(path, f"truncated: the header promises {promised} samples, the file holds {self.frames}")
            # An MP3 whose Xing/Info header counts its frames has an exact length: a cut one lost
            # up to 5 % (3 min an hour) as ok. Without one libsndfile estimates from the size.
            self.xing = _xing(path) if self.format == "MP3" else None  # read once: `_joined` looks too
            self.short_fraction = 0.0 if self.xing is not None and self.xing[1] > 0 else SHORT_FRACTION
            # only a WAV that reads as empty or holds over 4 GiB can have samples libsndfile misses
            self.open_wav = _open_wav(path) if self.format in ("WAV", "WAVEX") and (
                self.frames == 0 or path.stat().st_size > 0xFFFFFFFF) else None
        except AudioError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise AudioError(path, f"cannot read: {e}") from e

    def seek(self, frame: int) -> int:
        """Start reading at `frame` (clamped to the file); returns the frames skipped."""
        frame = min(frame, self.frames)
        try:
            self._f.seek(frame)
        except (sf.SoundFileError, RuntimeError) as e:
            raise self._read_error(e) from e
        self._at = frame
        return frame

    def mono_blocks(self) -> Iterator[np.ndarray]:
        n = max(1024, BLOCK_BYTES // (4 * self.channels))
        buf = np.empty((n, self.channels), dtype=np.float32)
        while True:
            try:
                got = self._f.read(n, dtype="float32", always_2d=True, out=buf)
            except (sf.SoundFileError, RuntimeError, OSError) as e:
                raise self._read_error(e) from e
            self._at += got.shape[0]
            if got.shape[0] == 0:
                _check_whole(self.path, "header", self.frames, self._at, self.rate, self.short_fraction)
                return
            # A fresh array either way: `buf` is reused for the next block.
            yield got[:, 0].copy() if self.channels == 1 else got.mean(axis=1, dtype=np.float32)

    def _read_error(self, e: Exception) -> AudioError:
        # Corrupt or truncated compressed streams fail in a read ("flac decoder lost sync") or
        # a segment's seek ("Internal psf_fseek() failed"), a whole block at once: where in it
        # is not known (libsndfile's smaller reads near the fault fail elsewhere, on a seek),
        # so the message says what may be, and how long the header says the file is.
        if 0 < self.frames != _UNKNOWN_FRAMES and self._at < self.frames:
            return AudioError(self.path, f"corrupt or cut off: decoding failed before the end its header "
                                         f"promises at {self.frames / self.rate:.1f} s ({str(e).strip()})")
        return _open_error(self.path, e)

    def close(self) -> None:
        self._f.close()


def _check_whole(path: Path, source: str, promised: int, held: int, rate: int,
                 fraction: float = SHORT_FRACTION) -> None:
    """AudioError when decoding ended short of the length the `source` ("header") promised by
    more than max(fraction of it, SHORT_SECONDS): a cut-off file."""
    if promised - held > max(fraction * promised, SHORT_SECONDS * rate):
        raise AudioError(path, f"truncated: the {source} promises {promised / rate:.1f} s, "
                               f"the file holds {held / rate:.1f} s")


def joined_mp3(path: Path) -> tuple[int, int] | None:
    """(MPEG bytes the first frame's Xing/Info header declares, MPEG bytes the file holds) for
    an MP3 holding more than that header declares (JOINED_MP3_SLACK), else None (also when it
    has no such header, or no byte count in it)."""
    return _joined(_xing(path))


def _joined(xing: tuple[int, int, int, int] | None) -> tuple[int, int] | None:
    """`joined_mp3` of an MP3's `_xing` header, read already."""
    if xing is None or not xing[0] & 2:  # no byte count
        return None
    declared, held = xing[2], xing[3]
    fraction, minimum = JOINED_MP3_SLACK
    if declared <= 0 or held <= declared + max(fraction * declared, minimum):
        return None
    return declared, held


def _xing(path: Path) -> tuple[int, int, int, int] | None:
    """(flags, frame count, byte count, MPEG bytes the file holds) of an MP3's Xing/Info header
    in its first frame (the counts 0 where its flags give none), None without one."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(10)
        start = 0
        if head[:3] == b"ID3" and len(head) == 10:  # ID3v2: syncsafe size, + 10 for a footer
            start = 10 + sum((head[6 + k] & 0x7F) << (21 - 7 * k) for k in range(4)) + (10 if head[5] & 0x10 else 0)
        f.seek(start)
        head = f.read(4096)
        end = size
        f.seek(max(end - 128, 0))
        if f.read(3) == b"TAG":  # ID3v1
            end -= 128
        f.seek(max(end - 32, 0))
        footer = f.read(32)
        if footer[:8] == b"APETAGEX":  # APEv2 footer: the tag's size (without its optional header)
            flags = int.from_bytes(footer[20:24], "little")
            end -= int.from_bytes(footer[12:16], "little") + (32 if flags & 0x80000000 else 0)
    sync = next((i for i in range(len(head) - 3) if head[i] == 0xFF and head[i + 1] & 0xE0 == 0xE0), None)
    if sync is None:
        return None
    mpeg1, mono, crc = (head[sync + 1] >> 3) & 3 == 3, head[sync + 3] >> 6 == 3, not head[sync + 1] & 1
    tag = sync + 4 + (2 if crc else 0) + ((17 if mono else 32) if mpeg1 else (9 if mono else 17))
    if head[tag:tag + 4] not in (b"Xing", b"Info"):
        return None
    flags = int.from_bytes(head[tag + 4:tag + 8], "big")
    frames = int.from_bytes(head[tag + 8:tag + 12], "big") if flags & 1 else 0
    at = tag + 8 + (4 if flags & 1 else 0)
    declared = int.from_bytes(head[at:at + 4], "big") if flags & 2 else 0
    return flags, frames, declared, end - start - sync


def _open_wav(path: Path) -> str | None:
    """Why FFmpeg, which reads such a data chunk to the file's end, must read the WAV at `path`
    (None: libsndfile reads it all): its data size is 0 (a recorder stopped before it wrote the
    sizes; libsndfile reads no samples) or 0xFFFFFFFF over more than 4 GiB (a writer streaming
    to a pipe; libsndfile reads 4 GiB of it: 21 min of a 4.5 h 48 kHz stereo 24-bit file were
    dropped, the file transcribed as ok). A size that wrapped past 4 GiB, another 2 GiB or more
    of the file after the data it gives, is an AudioError: neither reader reads on."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        data = _data_chunk(f, size)
    if data is None:
        return None
    start, declared = data
    held = size - start
    if declared == 0 and held > 0:
        return "a WAV whose header gives its data no size (its writer stopped before finishing it)"
    if declared == 0xFFFFFFFF and held > declared:
        return "a WAV over 4 GiB whose header leaves its data size open"
    if declared not in _UNKNOWN_SIZES and held - declared >= 1 << 31:
        raise AudioError(path, f"a WAV over 4 GiB whose header gives its data {declared} of the {held} bytes "
                               "after it (its sizes wrapped past 4 GiB): neither libsndfile nor FFmpeg reads "
                               "on; convert it to RF64, W64 or FLAC")
    return None


def _data_chunk(f, size: int, max_chunks: int = 1000) -> tuple[int, int] | None:
    """(offset of its samples, the size its header gives) of the RIFF file `f`'s "data" chunk,
    found by walking the chunk headers from byte 12 (a search for the bytes "data" found the
    word in a LIST/INFO comment before it); None if it has none where a header can be read."""
    at = 12
    for _ in range(max_chunks):
        f.seek(at)
        head = f.read(8)
        if len(head) < 8:
            return None
        n = int.from_bytes(head[4:], "little")
        if head[:4] == b"data":
            return at + 8, n
        at += 8 + n + (n & 1)  # chunks are padded to an even length
        if at >= size:
            return None
    return None


def _sphere_count(path: Path) -> int | None:
    """The `sample_count` a NIST SPHERE header promises (None: it gives none)."""
    with open(path, "rb") as f:
        head = f.read(1024)
        lines = head.split(b"\n")
        size = int(lines[1]) if len(lines) > 1 and lines[1].strip().isdigit() else 1024
        if size > 1024:  # the header's own size, on its second line
            head += f.read(min(size, 1 << 20) - 1024)
    for line in head.split(b"\n"):
        parts = line.split()
        if len(parts) == 3 and parts[0] == b"sample_count" and parts[2].isdigit():
            return int(parts[2])
    return None


def _import_av():
    try:
        import av
    except ImportError:
        return None
    return av


class _AvSource:
    """PyAV (FFmpeg) for containers libsndfile cannot read, and chained Ogg streams and joined
    MP3s, which it reads only in part; samples converted to float32."""

    def __init__(self, path: Path, what: str | None = None):
        self.path = path
        self.av = _import_av()
        if self.av is None:
            what = what or f"{path.suffix} files"
            raise AudioError(path, f"reading {what} needs PyAV: pip install 'transcribe[av]'")
        try:
            self._c = self.av.open(str(path))
        except (self.av.FFmpegError, OSError) as e:
            raise AudioError(path, f"not a readable audio file ({e})") from e
        if not self._c.streams.audio:
            self._c.close()
            raise AudioError(path, "no audio stream")
        self._s = self._c.streams.audio[0]
        self.rate, self.channels = int(self._s.codec_context.sample_rate or 0), int(self._s.codec_context.layout.nb_channels or 0)
        self.frames = int(self._s.duration * self._s.time_base * self.rate) if self._s.duration else 0
        self._kinds = self._c.format.name.split(",")  # FFmpeg's names of what it found: "mov,mp4,m4a,..."
        self._indexed = not INDEXED_CONTAINERS.isdisjoint(self._kinds)
        self._seekable = not SEEKABLE_CONTAINERS.isdisjoint(self._kinds)
        self._from: int | None = None  # after a seek: the first sample to yield

    @classmethod
    def sniffed(cls, path: Path) -> "_AvSource | None":
        """PyAV's reading of a file whose content FFmpeg takes for one of MEDIA_CONTAINERS,
        else None (no PyAV, not such a container, no audio)."""
        if _import_av() is None:
            return None
        try:
            source = cls(path)
        except AudioError:
            return None
        if MEDIA_CONTAINERS.isdisjoint(source._kinds):
            source.close()
            return None
        return source

    def seek(self, frame: int) -> int:
        """Start at `frame`: through the container's index where it has one, from PREROLL_S
        before (seeks land on packets, and a codec's state, AAC's overlap, needs frames to
        settle), the samples before `frame` dropped by their timestamps; returns the frames
        skipped. Else 0: the caller drops samples from the start (a manifest cutting an hour
        of M4A into 240 segments decoded 120 h that way)."""
        start = frame - PREROLL_S * self.rate
        if start <= 0 or not self._seekable:
            return 0
        self._c.seek(int(start / self.rate / self._s.time_base), stream=self._s, backward=True)
        self._from = frame
        return frame

    def mono_blocks(self) -> Iterator[np.ndarray]:
        # Only the sample format changes here (to float planar); the rate stays for Resampler.
        conv = self.av.AudioResampler(format="fltp")
        packets = bad = decoded = 0
        try:
            for packet in self._c.demux(self._s):
                packets += 1
                try:
                    frames = packet.decode()
                except self.av.FFmpegError as e:
                    if packet.is_corrupt:  # the demuxer's own flag: a packet cut off with the file
                        raise AudioError(self.path, f"truncated: its last packet is cut off ({e})") from e
                    # Any other packet the decoder cannot take is skipped, as FFmpeg's own
                    # command does: `cat a.mp3 b.mp3` puts b's ID3 tag mid-stream, downloads
                    # end in zero padding. Stopping there failed such files whole.
                    bad += 1
                    continue
                for frame in frames:
                    drop = self._before_start(frame)
                    for f in conv.resample(frame):
                        planes = f.to_ndarray().astype(np.float32, copy=False)  # [channels, n]
                        decoded += planes.shape[1]
                        if drop >= planes.shape[1]:
                            drop -= planes.shape[1]
                            continue
                        planes, drop = planes[:, drop:], 0
                        yield planes[0].copy() if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
        except self.av.FFmpegError as e:
            raise AudioError(self.path, f"corrupt audio stream ({e})") from e
        if bad > max(MAX_BAD_PACKETS, BAD_PACKET_FRACTION * packets):
            raise AudioError(self.path, f"corrupt audio stream ({bad} of {packets} packets undecodable)")
        # The container's length, where its index gives one (MP4, Matroska, ASF; FFmpeg's
        # estimate from the size of an MP3 or ADTS stream says nothing): a cut M4A decoded to
        # its cut as ok once bad packets were skipped.
        if self._indexed and self._from is None:
            _check_whole(self.path, "container", self.frames, decoded, self.rate)
        if bad:  # the worker's stderr names the file (preprocess.NamedStderr)
            print(f"skipped {bad} undecodable packet{'s' * (bad > 1)} of {packets}", file=sys.stderr)

    def _before_start(self, frame) -> int:
        """Samples of decoded `frame` before the sought start (0 when not seeking, or past it)."""
        if self._from is None:
            return 0
        if frame.pts is None:
            raise AudioError(self.path, "cannot seek to a segment: the stream's frames carry no timestamps")
        at = round(frame.pts * frame.time_base * self.rate)
        return max(0, min(self._from - at, frame.samples))

    def close(self) -> None:
        self._c.close()
