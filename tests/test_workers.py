"""Preprocessing workers: streamed decoding, the pool's protocol, crashes, hangs, bounded memory,
and the Parakeet frontend's per-piece features against batched LogMel."""
import errno
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import Reference, needs_shared
from transcribe.audio import load_audio
from transcribe.decode import AudioStream
from transcribe.shm import Slab
from transcribe.preprocess import WORKERS_IGNORE
from transcribe.signals import STOP_SIGNALS
from transcribe.workers import FileTimeout, Prespawned, WorkerPool, WorkerStartError

SR = 16000
CRASH_LEN, HANG_LEN, RAISE_LEN = 12_345, 13_579, 14_321  # audio lengths that trigger a fault


class ToyFrontend:
    """Cheap, checkable features: per 160-sample frame, its mean and its max. Faults on cue."""

    sample_rate = SR
    n_mels = 2
    max_piece_seconds = cut_seconds = 4.0
    max_frames = int(4.0 * SR) // 160

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        n = audio.shape[0]
        if n == CRASH_LEN:
            os.kill(os.getpid(), signal.SIGKILL)
        if n == HANG_LEN:
            time.sleep(600)
        if n == RAISE_LEN:
            raise RuntimeError("boom")
        frames = audio[: n // 160 * 160].reshape(-1, 160)
        return np.stack([frames.mean(1), frames.max(1)]).astype(np.float32)


class SlowFrontend(ToyFrontend):
    """A second per call: a worker on slow storage, or one warming up slowly."""

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        time.sleep(1.0)
        return super().__call__(audio)


def _wav(path: Path, n: int, seed: int = 0) -> Path:
    sf.write(path, (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(np.float32), SR, subtype="FLOAT")
    return path


def _collect(pool: WorkerPool, n_files: int, slab: Slab, timeout: float = 120.0):
    """Run until n_files are over; returns ({fid: [(Piece, features copy)]}, {fid: done/error event})."""
    pieces, ends = {}, {}
    deadline = time.monotonic() + timeout
    while len(ends) < n_files:
        ev = pool.events.get(timeout=max(0.1, deadline - time.monotonic()))
        if ev[0] == "piece":
            p = ev[1]
            pieces.setdefault(p.fid, []).append((p, slab.view(p.slot, (p.n_mels, p.frames)).copy()))
            pool.release([p.slot])
        else:
            assert ev[0] in ("done", "error"), ev
            ends[ev[1]] = ev
    return pieces, ends


def _children_alive(pids) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]


def test_stream_decodes_exactly_as_load_audio(tmp_path):
    rng = np.random.default_rng(1)
    stereo = (rng.standard_normal((70_001, 2)) * 0.1).astype(np.float32)
    sf.write(tmp_path / "s.flac", stereo, 44100)
    sf.write(tmp_path / "m.wav", stereo[:, 0], 22050)
    for name in ("s.flac", "m.wav"):
        with AudioStream(tmp_path / name, SR) as s:
            got = np.concatenate(list(s.blocks()))
        assert np.array_equal(got, load_audio(tmp_path / name, SR)) and s.samples == got.shape[0]


def test_pool_preprocesses_files_and_fails_crashes_hangs_and_errors_alone(tmp_path):
    good = [_wav(tmp_path / f"g{i}.wav", n, i) for i, n in enumerate((16_000, 100_000, 3_000))]  # 100k: 2 pieces
    bad = [_wav(tmp_path / "crash.wav", CRASH_LEN), _wav(tmp_path / "hang.wav", HANG_LEN),
           _wav(tmp_path / "raise.wav", RAISE_LEN), tmp_path / "missing.wav"]
    fe = ToyFrontend()
    with Slab.create(4, fe.n_mels * fe.max_frames) as slab, \
            WorkerPool(fe, slab, 2, FileTimeout(base_s=5.0, per_audio_s=0.0)) as pool:
        first = [w.process.pid for w in pool._workers]
        for fid, p in enumerate(good + bad):
            pool.submit(fid, str(p))
        pieces, ends = _collect(pool, len(good) + len(bad), slab)
        later = [w.process.pid for w in pool._workers]
    for fid, p in enumerate(good):
        assert ends[fid][0] == "done", ends[fid]
        audio = load_audio(p, SR, min_samples=1)
        got = sorted(pieces[fid], key=lambda e: e[0].index)
        assert ends[fid][2] == len(got) and ends[fid][3] == audio.shape[0]
        offsets = [round(e[0].offset_s * SR) for e in got] + [audio.shape[0]]
        for (piece, feats), a, b in zip(got, offsets, offsets[1:]):  # pieces tile the file
            assert piece.samples == b - a and np.array_equal(feats, fe(audio[a:b]))
    reasons = {Path(bad[i].name).stem: ends[len(good) + i][2] for i in range(len(bad))}
    assert all(ends[len(good) + i][0] == "error" for i in range(len(bad)))
    assert "worker process died (killed by SIGKILL)" in reasons["crash"]
    assert "timed out" in reasons["hang"] and "RuntimeError: boom" in reasons["raise"]
    assert "no such file" in reasons["missing"] and all(str(tmp_path) in r for r in reasons.values())
    assert set(first) - set(later)  # crashed and hung workers were replaced
    time.sleep(0.2)
    assert not _children_alive(first + later)


def _damaged_mp3(path: Path) -> Path:
    """A 3 s MP3 with ~1 kB of junk in its middle: libmpg123 resyncs past it, writing "Note:
    Illegal Audio-MPEG-Header ..." to stderr, and warns of its Xing header (> 1 % off; under
    8 kB, so not taken for MP3s joined end to end)."""
    sf.write(path, (np.random.default_rng(3).uniform(-0.3, 0.3, 3 * SR)).astype(np.float32), SR, format="MP3")
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2] + bytes(range(7, 200)) * 5 + whole[len(whole) // 2:])
    return path


def _one_worker(fe, files: list[Path]) -> dict:
    """`files` through a pool of one worker: {fid: its done/error event}."""
    with Slab.create(4, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 1) as pool:
        for fid, p in enumerate(files):
            pool.submit(fid, str(p))
        return _collect(pool, len(files), slab)[1]


def test_what_the_decoder_says_on_stderr_names_the_file(tmp_path, capfd):
    """libmpg123 writes "Note: Illegal Audio-MPEG-Header ..." of a damaged MP3 straight to
    stderr, naming no file. Each such line now comes out as `PATH: Note: ...` from the worker
    that read the file; a good file read by the same workers adds nothing."""
    files = [_wav(tmp_path / "g0.wav", 16_000), _damaged_mp3(tmp_path / "junk in.mp3"), _wav(tmp_path / "g1.wav", 20_000)]
    capfd.readouterr()
    ends = _one_worker(ToyFrontend(), files)
    assert [ends[i][0] for i in range(3)] == ["done"] * 3
    lines = capfd.readouterr().err.splitlines()
    assert any("Illegal Audio-MPEG-Header" in line for line in lines), lines
    assert all(line.startswith(f"{tmp_path / 'junk in.mp3'}: ") for line in lines), lines


class SaysThenDies(ToyFrontend):
    """A decoder that writes its last words to stderr, then dies (a C assert's abort)."""

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        if audio.shape[0] == CRASH_LEN:
            os.write(2, b"decoder.c:42: frame_decode: Assertion `n < 1152' failed.\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(audio)


def test_what_a_worker_said_before_it_died_is_named_by_the_pool(tmp_path, capfd):
    """Lines still in a worker's stderr file when it dies (an assert's message, then SIGABRT)
    died with it; the pool reads them from the same memory file and names the file."""
    files = [_wav(tmp_path / "dies.wav", CRASH_LEN), _wav(tmp_path / "g.wav", 16_000)]
    capfd.readouterr()
    ends = _one_worker(SaysThenDies(), files)
    assert ends[0][0] == "error" and "killed by SIGKILL" in ends[0][2] and ends[1][0] == "done"
    err = capfd.readouterr().err
    assert f"{files[0]}: decoder.c:42: frame_decode: Assertion `n < 1152' failed.\n" in err, err


def test_a_stderr_that_takes_nothing_fails_no_file(tmp_path):
    """Workers whose stderr is a pipe nobody reads any more (`2>&1 | head` ended): the decoder's
    lines are lost, as its own fprintf's were, and the damaged MP3 is still transcribed."""
    damaged = _damaged_mp3(tmp_path / "junk.mp3")
    r, w = os.pipe()
    saved = os.dup(2)
    try:
        os.dup2(w, 2)  # the workers inherit this stderr at spawn
        os.close(r)
        os.close(w)
        ends = _one_worker(ToyFrontend(), [damaged])
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert ends[0][0] == "done", ends[0]


class ShortCutFrontend(ToyFrontend):
    cut_seconds = 2.0  # a file of up to 4 s whole, longer ones in pieces of <= 2 s (as Whisper's 30 / 20 s)


def test_workers_cut_longer_files_at_the_frontends_cut_seconds(tmp_path):
    files = [_wav(tmp_path / "whole.wav", int(3.9 * SR), 1), _wav(tmp_path / "cut.wav", int(5.0 * SR), 2)]
    fe = ShortCutFrontend()
    with Slab.create(8, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 1) as pool:
        for fid, p in enumerate(files):
            pool.submit(fid, str(p))
        pieces, ends = _collect(pool, len(files), slab)
    assert [e[0] for e in ends.values()] == ["done", "done"]
    assert [p.samples for p, _ in pieces[0]] == [int(3.9 * SR)]
    cut = sorted(p.samples for p, _ in pieces[1])
    assert len(cut) >= 3 and cut[-1] <= 2 * SR and sum(cut) == 5 * SR


def test_workers_block_when_the_slab_is_full(tmp_path):
    files = [_wav(tmp_path / f"{i}.wav", 8_000, i) for i in range(5)]
    fe = ToyFrontend()
    with Slab.create(2, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 2) as pool:
        for fid, p in enumerate(files):
            pool.submit(fid, str(p))
        held, ends = [], {}
        while len(held) < 2:
            ev = pool.events.get(timeout=60)
            if ev[0] == "piece":
                held.append(ev[1].slot)
            else:
                ends[ev[1]] = ev
        time.sleep(1.0)  # room for more pieces, if the pool wrongly let them through
        assert pool.starved  # a worker asked for a slot and waits
        while not pool.events.empty():
            ev = pool.events.get()
            assert ev[0] != "piece"
            ends[ev[1]] = ev
        pool.release(held)
        _, rest = _collect(pool, 5 - len(ends), slab)
    assert sorted({**ends, **rest}) == list(range(5))
    assert all(e[0] == "done" for e in {**ends, **rest}.values())


def test_prespawned_workers_are_used_first_and_spares_are_stopped(tmp_path):
    """Workers spawned before the model loads serve the pool (no second spawn); those the pool
    does not take end when the spares are closed."""
    files = [_wav(tmp_path / f"{i}.wav", 8_000, i) for i in range(3)]
    fe = ToyFrontend()
    with Prespawned(3) as spares:
        pids = [p.pid for p, _ in spares._spare]
        with Slab.create(4, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 2, prespawned=spares) as pool:
            used = [w.process.pid for w in pool._workers]
            for fid, p in enumerate(files):
                pool.submit(fid, str(p))
            _, ends = _collect(pool, 3, slab)
        left = [p.pid for p, _ in spares._spare]
    assert set(used) <= set(pids) and len(left) == 1  # the pool took two of the three
    assert all(e[0] == "done" for e in ends.values())
    time.sleep(0.2)
    assert not _children_alive(pids)


@needs_shared
def test_frontend_pickles_and_matches_batched_logmel_per_piece():
    """Per-utterance normalisation: a piece's features alone equal its row of a padded batch up
    to float32 summation order (bit-equal for the batch's longest piece), and the engine's
    batch rebuilt from per-piece features has the batched shape."""
    from engines.parakeet import ParakeetEngine
    from transcribe.features import LogMel

    ref = Reference("tdt_tiny")
    engine = ParakeetEngine.from_nemo(ref.nemo, "cpu")
    fe = pickle.loads(pickle.dumps(engine.frontend))
    pieces = [load_audio(ref.audio_path(i), SR) for i in range(4)]
    lm = LogMel(fe.cfg, torch.from_numpy(fe.window), torch.from_numpy(fe.fb))
    lengths = torch.tensor([p.shape[0] for p in pieces])
    audio = torch.zeros(len(pieces), int(lengths.max()))
    for i, p in enumerate(pieces):
        audio[i, : p.shape[0]] = torch.from_numpy(p)
    batched, flen = lm(audio, lengths)
    singles = [torch.from_numpy(fe(p)) for p in pieces]
    for i, f in enumerate(singles):
        assert f.shape == (fe.n_mels, int(flen[i])) == (fe.n_mels, fe.frames(pieces[i].shape[0]))
        torch.testing.assert_close(f, batched[i, :, : int(flen[i])], rtol=0, atol=2e-6)
    longest = int(lengths.argmax())
    assert torch.equal(singles[longest], batched[longest, :, : int(flen[longest])])
    rebuilt, rlen = engine._batch(singles)
    assert rebuilt.shape == batched.shape and torch.equal(rlen, flen)
    assert torch.equal(rebuilt[:, :, int(flen.max()):], batched[:, :, int(flen.max()):])  # pad_value tail


def test_containers_need_the_av_extra(tmp_path, monkeypatch):
    import sys

    from transcribe.decode import AudioError

    (tmp_path / "a.m4a").write_bytes(b"\0\0\0\x18ftypM4A " + bytes(64))
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(AudioError, match=r"needs PyAV: pip install 'transcribe\[av\]'"):
        AudioStream(tmp_path / "a.m4a", SR)


def test_pyav_decodes_audio_and_reports_a_missing_stream(tmp_path):
    av = pytest.importorskip("av")
    from transcribe.decode import AudioError

    tone = (0.3 * np.sin(np.linspace(0, 2000, 44100 * 2))).astype(np.float32)
    with av.open(str(tmp_path / "a.m4a"), "w") as c:
        s = c.add_stream("aac", rate=44100, layout="stereo")
        for i in range(0, tone.shape[0], 1024):
            frame = av.AudioFrame.from_ndarray(np.stack([tone[i:i + 1024]] * 2), format="fltp", layout="stereo")
            frame.sample_rate = 44100
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode(None):
            c.mux(packet)
    with AudioStream(tmp_path / "a.m4a", SR) as stream:
        audio = np.concatenate(list(stream.blocks()))
    assert abs(audio.shape[0] - 2 * SR) < 0.1 * SR and 0.15 < np.abs(audio).max() < 0.5
    # A segment: PyAV cannot seek to a sample, so the samples before it are decoded and dropped.
    with AudioStream(tmp_path / "a.m4a", SR, span=(0.5, 1.0)) as stream:
        part = np.concatenate(list(stream.blocks()))
    # (resampled on its own, so its first and last few ms differ from a slice of the whole)
    assert part.shape[0] == SR and np.abs(part - audio[SR // 2: SR // 2 + SR])[400:-400].max() < 1e-3
    with av.open(str(tmp_path / "v.mp4"), "w") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for _ in range(5):
            for packet in s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")):
                c.mux(packet)
        for packet in s.encode(None):
            c.mux(packet)
    with pytest.raises(AudioError, match="no audio stream"):
        AudioStream(tmp_path / "v.mp4", SR)


def test_a_cut_off_flac_says_so_read_whole_or_as_a_segment(tmp_path):
    """Half a FLAC failed as "not a readable audio file (flac decoder lost sync)", a segment past
    the cut as "(Internal psf_fseek() failed)": both now say corrupt or cut off, with the length
    its header promises."""
    from transcribe.decode import AudioError

    sf.write(tmp_path / "a.flac", (np.random.default_rng(2).uniform(-0.3, 0.3, 8 * SR)).astype(np.float32), SR)
    whole = (tmp_path / "a.flac").read_bytes()
    (tmp_path / "half.flac").write_bytes(whole[:len(whole) // 2])
    for span in (None, (6.0, 1.0)):
        with pytest.raises(AudioError, match=r"half\.flac: corrupt or cut off: decoding failed before the end "
                                             r"its header promises at 8\.0 s \("):
            with AudioStream(tmp_path / "half.flac", SR, span=span) as stream:
                list(stream.blocks())


def test_a_cut_off_mp3_fails_and_a_chained_ogg_is_read_whole(tmp_path, monkeypatch):
    """A half-copied MP3 keeps its header's full length, and libsndfile decoded what was there
    as a whole file; Ogg files joined end to end (a chained stream) lost all but the first part.
    Now the first is an error naming the file and both lengths, the second goes through PyAV."""
    import sys

    from transcribe.decode import AudioError

    rng = np.random.default_rng(5)
    a, b = (rng.uniform(-0.3, 0.3, n).astype(np.float32) for n in (3 * SR, 2 * SR))
    sf.write(tmp_path / "a.mp3", a, SR, format="MP3")
    whole = (tmp_path / "a.mp3").read_bytes()
    (tmp_path / "half.mp3").write_bytes(whole[: len(whole) // 2])
    with AudioStream(tmp_path / "a.mp3", SR) as stream:
        assert sum(x.shape[0] for x in stream.blocks()) == a.shape[0]
    with pytest.raises(AudioError, match=r"half\.mp3: truncated: the header promises 3\.0 s, the file holds 1\.[0-9] s"):
        with AudioStream(tmp_path / "half.mp3", SR) as stream:
            list(stream.blocks())
    for name, x in (("a.ogg", a), ("b.ogg", b)):
        sf.write(tmp_path / name, x, SR, format="OGG", subtype="VORBIS")
    (tmp_path / "ab.ogg").write_bytes((tmp_path / "a.ogg").read_bytes() + (tmp_path / "b.ogg").read_bytes())
    if _has_av():
        with AudioStream(tmp_path / "ab.ogg", SR) as stream:
            n = sum(x.shape[0] for x in stream.blocks())
        assert abs(n - (a.shape[0] + b.shape[0])) < 0.05 * SR  # both links, not 3 s of 5
    # Joins libsndfile reads as the first link alone without a sign: two copies of one file,
    # Opus links. Found by their pages (a second stream's first page after the first's data).
    (tmp_path / "aa.ogg").write_bytes((tmp_path / "a.ogg").read_bytes() * 2)
    for name, x in (("a.opus", a), ("b.opus", b)):
        sf.write(tmp_path / name, x, SR, format="OGG", subtype="OPUS")
    (tmp_path / "ab.opus").write_bytes((tmp_path / "a.opus").read_bytes() + (tmp_path / "b.opus").read_bytes())
    joins = {"ab.ogg": a.shape[0] + b.shape[0], "aa.ogg": 2 * a.shape[0], "ab.opus": a.shape[0] + b.shape[0]}
    if _has_av():
        for name, want in joins.items():
            with AudioStream(tmp_path / name, SR) as stream:
                n = sum(x.shape[0] for x in stream.blocks())
            assert abs(n - want) < 0.05 * SR, (name, n, want)
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    for name in joins:
        with pytest.raises(AudioError, match=r"reading a chained Ogg stream \(several joined\) needs PyAV"):
            AudioStream(tmp_path / name, SR)
    for name in ("a.opus", "b.ogg"):  # one link each: libsndfile, as before
        with AudioStream(tmp_path / name, SR) as stream:
            assert stream._source.__class__.__name__ == "_SoundfileSource", name
    with AudioStream(tmp_path / "a.ogg", SR) as stream:  # one link: libsndfile, as before
        assert sum(x.shape[0] for x in stream.blocks()) == a.shape[0]


def _ogg_pages(data: bytes) -> list[bytearray]:
    pages, at = [], 0
    while at < len(data):
        n = data[at + 26]
        end = at + 27 + n + sum(data[at + 27: at + 27 + n])
        pages.append(bytearray(data[at:end]))
        at = end
    return pages


def _opus_samples(page: bytes) -> int:
    """48 kHz samples in the page's Opus packets (RFC 6716's TOC byte; none continued)."""
    n, total, at, size = page[26], 0, 27 + page[26], 0
    for lacing in page[27: 27 + n]:
        size += lacing
        if lacing < 255:
            toc, config = page[at], page[at] >> 3
            ms = ([10, 20, 40, 60][config % 4] if config < 12 else [10, 20][config % 2] if config < 16
                  else [2.5, 5, 10, 20][config % 4])
            frames = 1 if toc & 3 == 0 else 2 if toc & 3 < 3 else page[at + 1] & 0x3F
            total += int(48 * ms * frames)
            at, size = at + size, 0
    return total


def test_a_cut_off_ogg_fails_naming_why(tmp_path):
    """libsndfile decodes a cut-off Ogg file to its last whole page without complaint (a
    half-copied Opus file was transcribed "ok"; one cut off mid-page even went to PyAV as a
    "chained" stream). Ogg pages carry their length: a last page that is not whole was cut
    off. Whole files, one with bytes of another kind after its last page, and one whose last
    page lacks the end-of-stream flag (as Android's MediaRecorder writes every Opus file),
    read as before."""
    from transcribe.decode import AudioError
    from transcribe.ogg_end import _TABLE, _crc_ok, ogg_cut_off

    x = (np.random.default_rng(7).uniform(-0.3, 0.3, 6 * SR)).astype(np.float32)
    for subtype in ("VORBIS", "OPUS"):
        whole = tmp_path / f"{subtype}.ogg"
        sf.write(whole, x, SR, format="OGG", subtype=subtype)
        data = whole.read_bytes()
        last_page = data.rfind(b"OggS")
        cases = {"mid": data[: len(data) // 2], "between": data[:last_page], "zeros": data + bytes(100)}
        for name, content in cases.items():
            (tmp_path / f"{subtype}_{name}.ogg").write_bytes(content)
        assert ogg_cut_off(whole) is None and ogg_cut_off(tmp_path / f"{subtype}_zeros.ogg") is None
        for name in ("", "_zeros"):
            with AudioStream(tmp_path / f"{subtype}{name}.ogg", SR) as stream:
                assert sum(b.shape[0] for b in stream.blocks()) == x.shape[0]
        with pytest.raises(AudioError, match=rf"{subtype}_mid\.ogg: truncated: the file ends inside an Ogg page"):
            AudioStream(tmp_path / f"{subtype}_mid.ogg", SR)
        # Cut exactly between pages: no sign of it (the whole file below looks the same)
        assert ogg_cut_off(tmp_path / f"{subtype}_between.ogg") is None
    # AOSP's OggWriter: granule positions count the samples, and no page is flagged
    # end-of-stream. The file is whole: libsndfile decodes all of it.
    pages = _ogg_pages((tmp_path / "OPUS.ogg").read_bytes())
    last = pages[-1]
    granule = int.from_bytes(pages[-2][6:14], "little") + _opus_samples(last)
    last[6:14], last[5] = granule.to_bytes(8, "little"), last[5] & ~0x04
    crc = 0
    for b in bytes(last[:22]) + bytes(4) + bytes(last[26:]):  # Ogg's CRC-32, as ogg_end checks it
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _TABLE[(crc >> 24) ^ b]
    last[22:26] = crc.to_bytes(4, "little")
    assert _crc_ok(bytes(last))
    android = tmp_path / "android.ogg"
    android.write_bytes(b"".join(pages))
    assert ogg_cut_off(android) is None
    with AudioStream(android, SR) as stream:
        assert sum(b.shape[0] for b in stream.blocks()) >= x.shape[0]


def test_the_ogg_check_reads_past_trailing_bytes_once_and_closes_what_it_opened(tmp_path, monkeypatch):
    """Bytes of another kind after the last page are no verdict, found by one walk of the
    pages: searching again from every later "OggS" was quadratic (4.4 s for 8,000 small
    pages). And a check that cannot read the file fails it naming the file, with the
    libsndfile handle it had opened closed (workers are long-lived)."""
    from transcribe import decode, ogg_end

    def page(seq: int, body: bytes) -> bytes:
        raw = (b"OggS\0\0" + bytes(8) + (1).to_bytes(4, "little") + seq.to_bytes(4, "little") + bytes(4)
               + bytes([1, len(body)]) + body)
        return raw[:22] + ogg_end.crc(raw).to_bytes(4, "little") + raw[26:]

    pages = b"".join(page(i, bytes(10)) for i in range(8000))
    (tmp_path / "junk.ogg").write_bytes(pages + b"not a page" * 3)
    (tmp_path / "cut.ogg").write_bytes(pages + page(8000, bytes(10))[:-4])
    walks = []
    walk = ogg_end._walk
    monkeypatch.setattr(ogg_end, "_walk", lambda buf, at: walks.append(at) or walk(buf, at))
    assert ogg_end.ogg_cut_off(tmp_path / "junk.ogg") is None and len(walks) <= 2, len(walks)
    assert ogg_end.ogg_cut_off(tmp_path / "cut.ogg") == "the file ends inside an Ogg page (cut off)"

    x = np.zeros(SR, np.float32)
    sf.write(tmp_path / "a.ogg", x, SR, format="OGG", subtype="VORBIS")
    closed = []
    close = decode._SoundfileSource.close
    monkeypatch.setattr(decode._SoundfileSource, "close", lambda self: closed.append(self) or close(self))

    def unreadable(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(decode, "ogg_cut_off", unreadable)
    with pytest.raises(decode.AudioError, match=r"a\.ogg: cannot read: \[Errno 13\] Permission denied"):
        AudioStream(tmp_path / "a.ogg", SR)
    assert len(closed) == 1


def test_mp3s_joined_end_to_end_are_read_whole(tmp_path, monkeypatch):
    """`cat a.mp3 b.mp3` keeps a's Xing header, and libsndfile stopped where its frame count
    ends: b's audio was dropped without a word. A file holding more MPEG bytes than that header
    declares now goes through PyAV (or fails naming the extra that reads it); a single MP3,
    with or without an ID3v1 tag after its audio, stays with libsndfile."""
    import sys

    from transcribe.decode import AudioError, joined_mp3

    rng = np.random.default_rng(6)
    a, b = (rng.uniform(-0.3, 0.3, n).astype(np.float32) for n in (3 * SR, 2 * SR))
    sf.write(tmp_path / "a.mp3", a, SR, format="MP3")
    sf.write(tmp_path / "b.mp3", b, SR, format="MP3")
    one = (tmp_path / "a.mp3").read_bytes()
    (tmp_path / "ab.mp3").write_bytes(one + (tmp_path / "b.mp3").read_bytes())
    (tmp_path / "tagged.mp3").write_bytes(one + b"TAG" + bytes(125))
    assert joined_mp3(tmp_path / "a.mp3") is None and joined_mp3(tmp_path / "tagged.mp3") is None
    declared, held = joined_mp3(tmp_path / "ab.mp3")
    assert declared == len(one) and held == (tmp_path / "ab.mp3").stat().st_size
    for name in ("a.mp3", "tagged.mp3"):
        with AudioStream(tmp_path / name, SR) as stream:
            assert type(stream._source).__name__ == "_SoundfileSource"
            assert sum(x.shape[0] for x in stream.blocks()) == a.shape[0]
    if _has_av():
        with AudioStream(tmp_path / "ab.mp3", SR) as stream:
            assert abs(stream.duration - 5.0) < 0.3  # the hang timeout's length covers both parts
            got = np.concatenate(list(stream.blocks()))
        assert abs(got.shape[0] - (a.shape[0] + b.shape[0])) < 0.2 * SR  # both parts, not 3 s of 5
        with AudioStream(tmp_path / "a.mp3", SR) as stream:
            first = np.concatenate(list(stream.blocks()))
        assert np.abs(got[: 2 * SR] - first[: 2 * SR]).max() < 1e-4  # FFmpeg decodes a's part as libsndfile does
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(AudioError, match=r"ab\.mp3: reading MP3s joined end to end .* needs PyAV"):
        AudioStream(tmp_path / "ab.mp3", SR)


def test_the_hang_timeout_allows_for_no_more_audio_than_the_file_can_hold(tmp_path):
    """A header can claim any length (a corrupt MP3's frame count): the worker's hang timeout
    (FileTimeout.limit of what it reports at "start") must stay finite and follow the size."""
    from transcribe.decode import MIN_BYTES_PER_SECOND

    sf.write(tmp_path / "a.wav", np.zeros(3 * SR, np.float32), SR)
    with AudioStream(tmp_path / "a.wav", SR) as stream:
        assert stream.timeout_seconds == stream.duration == 3.0  # a true header: its own length
        stream.duration = 9.2e14  # what libsndfile reports for a length it cannot tell
        size = (tmp_path / "a.wav").stat().st_size
        assert stream.timeout_seconds == size / MIN_BYTES_PER_SECOND < 1000


def test_a_worker_reports_the_bounded_length_at_start(tmp_path, monkeypatch):
    import transcribe.decode as decode
    from transcribe import preprocess

    real_init = decode.AudioStream.__init__

    def lying_header(self, *a, **k):
        real_init(self, *a, **k)
        self.duration = 9.2e14

    monkeypatch.setattr(decode.AudioStream, "__init__", lying_header)
    sf.write(tmp_path / "a.wav", np.zeros(SR, np.float32), SR)
    sent = []

    class Conn:  # the worker's pipe: records what it sends, grants every slot it asks for
        def send(self, msg):
            sent.append(msg)

        def recv(self):
            return ("slot", len(sent) % 2)

    fe = ToyFrontend()
    with Slab.create(2, fe.n_mels * fe.max_frames) as slab:
        end = preprocess._one_file(Conn(), slab, fe, 7, str(tmp_path / "a.wav"))
    assert end[0] == "done", end
    start = next(m for m in sent if m[0] == "start")
    assert start[1] == 7 and start[2] == (tmp_path / "a.wav").stat().st_size / decode.MIN_BYTES_PER_SECOND


def _has_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_segment_decodes_the_samples_of_its_span(tmp_path):
    """`span` (start s, length s or to the end): the same samples as the whole file decoded
    and sliced (soundfile seeks; a longer span stops at the end; one past it is an error)."""
    from transcribe.decode import AudioError

    rng = np.random.default_rng(3)
    x = rng.uniform(-0.5, 0.5, 3 * SR).astype(np.float32)
    sf.write(tmp_path / "x.flac", x, SR)
    for span, want in (((0.5, 1.25), x[SR // 2: SR // 2 + SR * 5 // 4]), ((2.0, None), x[2 * SR:]),
                       ((2.5, 9.0), x[5 * SR // 2:])):
        with AudioStream(tmp_path / "x.flac", SR, span=span) as stream:
            assert abs(stream.duration - want.shape[0] / SR) < 1e-6
            got = np.concatenate(list(stream.blocks()))
        np.testing.assert_allclose(got, want, atol=1e-4)  # FLAC is 16-bit here
    with pytest.raises(AudioError, match="offset past the end"):
        with AudioStream(tmp_path / "x.flac", SR, span=(4.0, 1.0)) as stream:
            list(stream.blocks())
    for length in (0.0, 1e-5):  # less than a sample is empty too
        with pytest.raises(AudioError, match=f"an empty segment: duration {length:g} s at offset 1 s holds no sample"):
            with AudioStream(tmp_path / "x.flac", SR, span=(1.0, length)) as stream:
                list(stream.blocks())
    with pytest.raises(AudioError, match="offset past the end"):  # not OverflowError
        with AudioStream(tmp_path / "x.flac", SR, span=(1e308, 1.0)) as stream:
            list(stream.blocks())


def test_a_wav_whose_writer_stopped_before_its_sizes_is_read_to_its_end(tmp_path, monkeypatch):
    """A recorder killed before it finalises its WAV leaves the RIFF and data sizes 0 (or
    0xFFFFFFFF). libsndfile reads 0xFFFFFFFF to the end but 0 as no samples: such a file failed
    as "no audio samples (0 frames)" though it holds them. It goes through PyAV, as FFmpeg reads
    the data to the end; a header with no data after it is still "no audio samples"."""
    import struct
    import sys

    from transcribe.decode import AudioError

    x = (np.sin(np.arange(52_400) / 7.0) * 8000).astype("<i2")
    fmt = struct.pack("<HHIIHH", 1, 1, SR, 2 * SR, 2, 16)
    head = b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data"
    (tmp_path / "open.wav").write_bytes(b"RIFF" + bytes(4) + head + bytes(4) + x.tobytes())
    (tmp_path / "bare.wav").write_bytes(b"RIFF" + struct.pack("<I", 36) + head + bytes(4))
    if _has_av():
        with AudioStream(tmp_path / "open.wav", SR) as stream:
            got = np.concatenate(list(stream.blocks()))
        np.testing.assert_allclose(got, x / 32768.0, atol=1e-6)
    with pytest.raises(AudioError, match="no audio samples"):
        with AudioStream(tmp_path / "bare.wav", SR) as stream:
            list(stream.blocks())
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed: said, not "no samples"
    with pytest.raises(AudioError, match=r"reading a WAV whose header gives its data no size .* needs PyAV"):
        AudioStream(tmp_path / "open.wav", SR)


def test_a_wav_over_4_gib_whose_sizes_are_open_is_read_to_its_end_and_one_whose_sizes_wrapped_fails(tmp_path):
    """A writer streaming a WAV to a pipe (ffmpeg) leaves its sizes 0xFFFFFFFF, which libsndfile
    reads as 4 GiB, not as "to the end": 21 min of a 4.5 h file were dropped, the file logged ok.
    Such a file goes through PyAV, which reads to the end. Sizes that wrapped past 4 GiB leave
    both readers short: that file fails saying so. (Sparse files: no 4 GiB is written.)"""
    import struct

    from transcribe.decode import AudioError, _SoundfileSource

    fmt = struct.pack("<HHIIHH", 1, 1, SR, 2 * SR, 2, 16)
    size = (1 << 32) + (1 << 20)  # 4 GiB and 1 MiB, 37.3 h at 16 kHz 16-bit: all zeros

    def wav(name: str, declared: int, before: bytes = b"", to: int = size) -> Path:
        p = tmp_path / name
        p.write_bytes(b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
                      + before + b"data" + struct.pack("<I", declared))
        os.truncate(p, to)
        return p

    # The data chunk is found by its header, not by the word: a title with "data" in a LIST
    # chunk before it gave a wrong size, and one 64 KiB on hid it.
    title = b"INFOINAM" + struct.pack("<I", 16) + b"metadata: rec 7\0"
    for before in (b"", b"LIST" + struct.pack("<I", len(title)) + title, b"JUNK" + struct.pack("<I", 70_000) + bytes(70_000)):
        source = _SoundfileSource(wav("open.wav", 0xFFFFFFFF, before))
        assert source.open_wav == "a WAV over 4 GiB whose header leaves its data size open", before[:4]
        source.close()
        source = _SoundfileSource(wav("zero.wav", 0, before, to=200_000))
        assert source.open_wav is not None and "gives its data no size" in source.open_wav, before[:4]
        source.close()
    wav("open.wav", 0xFFFFFFFF)
    if _has_av():
        with AudioStream(tmp_path / "open.wav", SR) as stream:
            assert stream.duration == pytest.approx((size - 44) / 2 / SR)  # not 0xFFFFFFFF bytes' worth
    with pytest.raises(AudioError, match=r"sizes wrapped past 4 GiB"):
        _SoundfileSource(wav("wrapped.wav", (size - 44) % (1 << 32)))


def test_a_worker_making_progress_is_not_killed_as_hung(tmp_path):
    """The hang deadline is counted from the worker's last piece: one that sends a piece a
    second is alive, though its file takes longer than the whole-file allowance (slow storage
    read a long file below 10x real time, and it was killed with 70 % sent)."""
    path = _wav(tmp_path / "long.wav", 8 * int(4.0 * SR))  # eight pieces or more, a second each
    fe = SlowFrontend()
    with Slab.create(8, fe.n_mels * fe.max_frames) as slab, \
            WorkerPool(fe, slab, 1, FileTimeout(base_s=4.0, per_audio_s=0.0)) as pool:
        pool.submit(0, str(path))
        pieces, ends = _collect(pool, 1, slab)
    assert ends[0][0] == "done", ends[0]
    assert len(pieces[0]) >= 8  # over 8 s of work against a 4 s allowance


def test_a_prespawned_worker_is_given_its_startup_time_from_attach(tmp_path, monkeypatch):
    """Spares wait for the model to load; their startup clock started at spawn, so a load over
    STARTUP_S (a first TensorRT build, a cold download) killed them, and three kills ended
    the job ("preprocessing workers cannot start")."""
    import transcribe.workers as workers

    monkeypatch.setattr(workers, "STARTUP_S", 4.0)
    fe = SlowFrontend()  # its warm-up call before "ready" takes a second
    with Prespawned(1) as spares:
        time.sleep(5.0)  # the model loading
        with Slab.create(4, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 1, prespawned=spares) as pool:
            pid = pool._workers[0].process.pid
            pool.submit(0, str(_wav(tmp_path / "a.wav", 8_000)))
            _, ends = _collect(pool, 1, slab)
            assert ends[0][0] == "done" and pool._workers[0].process.pid == pid  # not replaced


def test_a_stopped_job_moves_its_clocks_on():
    """SIGSTOP / ^Z / Slurm's suspend stop the whole job; on SIGCONT the pool's loop finds its
    deadlines passed by the time stopped: they move on by it, not fail the files as hung."""
    from transcribe.workers import STALL_S

    fe = ToyFrontend()
    with Slab.create(2, fe.n_mels * fe.max_frames) as slab, WorkerPool(fe, slab, 1) as pool:
        w = pool._workers[0]
        w.deadline, w.started = 100.0, 50.0
        pool._move_clocks(STALL_S / 2)  # a busy loop, not a stop
        assert (w.deadline, w.started) == (100.0, 50.0)
        pool._move_clocks(65.0)
        assert (w.deadline, w.started) == (165.0, 115.0)


@pytest.mark.parametrize("signum", WORKERS_IGNORE)
def test_a_stop_signal_to_the_process_group_leaves_the_workers_to_the_main_process(signum):
    """A ^C, SIGHUP or SIGUSR1 reaches the whole process group; a worker still importing
    (before it ignores them) died with a KeyboardInterrupt traceback, or by the signal, its file
    failed as "worker process died" while the main process stopped in order. A worker starts
    with them blocked, then ignores them, sent early or late."""
    with Prespawned(2) as spares:
        processes = [p for p, _ in spares._spare]
        for p in processes:
            os.kill(p.pid, signum)  # at once: the child is still starting its interpreter
        time.sleep(4.0)
        for p in processes:
            os.kill(p.pid, signum)  # and once it is waiting
        time.sleep(0.5)
        assert all(p.is_alive() for p in processes), [p.exitcode for p in processes]
    # And the main thread's own mask is as it was: the signal still reaches this process.
    assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_a_worker_left_behind_still_ends_on_sigterm():
    """multiprocessing's exit handler ends a daemon worker a failed job left behind with
    SIGTERM, then joins it: a worker ignoring SIGTERM hung the command's exit for good."""
    assert signal.SIGTERM in STOP_SIGNALS and signal.SIGTERM not in WORKERS_IGNORE
    with Prespawned(1) as spares:
        process = spares._spare[0][0]
        time.sleep(3.0)  # started and waiting for its slab
        process.terminate()
        process.join(10)
        assert process.exitcode == -signal.SIGTERM


class _NoMoreProcesses:
    """A spawn context whose processes cannot start: a cluster's limit on processes (EAGAIN)."""

    def __init__(self, ctx):
        self.Pipe = ctx.Pipe

    def Process(self, *args, **kwargs):
        class Refused:
            def start(self):
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return Refused()


def test_a_worker_that_cannot_be_replaced_stops_the_job_saying_why(tmp_path):
    """A worker died and its replacement could not spawn: the pool thread's error was hidden by
    a second close of the dead worker's stderr ("Bad file descriptor", from `close`)."""
    fe = ToyFrontend()
    with Slab.create(4, fe.n_mels * fe.max_frames) as slab:
        pool = WorkerPool(fe, slab, 1, FileTimeout(base_s=30.0, per_audio_s=0.0))
        try:
            pool.submit(0, str(_wav(tmp_path / "good.wav", 16_000)))
            _collect(pool, 1, slab)  # the worker is ready, its stderr open; then none can spawn
            pool._ctx = _NoMoreProcesses(pool._ctx)
        except Exception:
            pool.close()
            raise
        pool.submit(1, str(_wav(tmp_path / "crash.wav", CRASH_LEN)))
        events = [pool.events.get(timeout=60) for _ in range(2)]
        pool.close()  # raised OSError: [Errno 9] Bad file descriptor
    assert events[0][:2] == ("error", 1) and "worker process died" in events[0][2], events
    assert events[1][0] == "fatal" and isinstance(events[1][1], WorkerStartError)
    assert "cannot start a preprocessing worker: Resource temporarily unavailable" in str(events[1][1])


def test_workers_compute_on_one_thread_and_the_main_process_keeps_its_environment(monkeypatch):
    """numpy's OpenBLAS (the resampler's products) started a thread per core in every worker:
    44.1 kHz resampling ran 10-170x slower on a busy machine. Workers start with one thread
    per library; the main process's environment is left as it was."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    with Prespawned(1) as spares:
        (process, _), = spares._spare
        deadline = time.monotonic() + 30
        while True:  # empty while the child is still in its exec (seen under load)
            environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
            if environ != [b""] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert {b"OPENBLAS_NUM_THREADS=1", b"MKL_NUM_THREADS=1", b"OMP_NUM_THREADS=1"} <= set(environ)
    assert os.environ["OMP_NUM_THREADS"] == "7" and "OPENBLAS_NUM_THREADS" not in os.environ
