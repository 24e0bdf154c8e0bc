"""Bulk jobs that never lose work: bad inputs, crashed and hung workers, kills, signals, resume.

After every run here no worker process may survive its job (the last holder of the features'
shared memory, which has no name: the kernel frees it with them), and the output folder must
hold no temporary file and no truncated output.
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import ROOT, SPEECH, Reference, needs_shared
from transcribe.resume import _TEMP_OUTPUT
from transcribe.shm import MEMFD_NAME

pytestmark = needs_shared
CRASH_LEN, HANG_LEN = 23_456, 24_680  # 16 kHz samples: the faulty frontend's cues
N_JOB = 40  # files in the jobs that get killed: enough that the kill lands halfway


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "transcribe.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _rows(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    text = path.read_text() if path.exists() else ""
    assert text == "" or text.endswith("\n"), "a partial line in results.jsonl"
    return [json.loads(line) for line in text.splitlines()]


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (by parent links in /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                parent[int(d.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _assert_clean(out: Path, pids: list[int] = (), killed: bool = False) -> None:
    """No worker outlived its job, no output is truncated, and no temporary file is left;
    `killed`: the job died by SIGKILL, which may land while a batch's outputs are staged
    (`StagedWrites`) and leave their temporary files: only ours, which the next run sweeps."""
    deadline = time.monotonic() + 10
    while [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)  # the kernel finishes the cleanup of a killed run
    assert not [p for p in pids if _alive(p)], "a worker outlived its job"
    temps = [p for p in out.rglob("*.tmp") if not (killed and _TEMP_OUTPUT.match(p.name))]
    assert not temps, temps
    for p in out.rglob("*.json"):
        json.loads(p.read_text())  # no truncated output


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""  # gone


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_lines(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(_rows(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job did not get going"
        time.sleep(0.02)


def _copies(dst: Path, n: int) -> list[Path]:
    dst.mkdir(parents=True, exist_ok=True)
    srcs = sorted((SPEECH / "librispeech_test_other").rglob("*.flac"))
    out = []
    for i in range(n):
        p = dst / f"f{i:02d}.flac"
        shutil.copy(srcs[i % len(srcs)], p)
        out.append(p)
    return out


def _wav_header(path: Path, channels: int, rate: int, frames: int, data_bytes: int | None = None) -> None:
    data = np.zeros(frames * channels, "<i2").tobytes()
    size = len(data) if data_bytes is None else data_bytes
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * 2, channels * 2, 16)
    path.write_bytes(b"RIFF" + struct.pack("<I", 36 + size) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
                     + b"data" + struct.pack("<I", size) + data)


def _bad_inputs(inp: Path) -> dict[str, str]:
    """Every kind of bad input -> a word its error must contain."""
    flac = (SPEECH / "librispeech_test_other" / "1688" / "1688-142285-0000.flac").read_bytes()
    (inp / "empty.wav").write_bytes(b"")
    (inp / "text.wav").write_text("not audio at all\n" * 100)
    corrupt = bytearray(flac)
    corrupt[len(corrupt) // 3: len(corrupt) // 3 + 4000] = np.random.default_rng(0).bytes(4000)
    (inp / "corrupt.flac").write_bytes(bytes(corrupt))
    (inp / "truncated.flac").write_bytes(flac[: len(flac) // 2])
    _wav_header(inp / "truncated.wav", 1, 16000, 8000, data_bytes=64000)
    _wav_header(inp / "no_samples.wav", 1, 16000, 0)
    _wav_header(inp / "rate_2k.wav", 1, 2000, 4000)
    sf.write(inp / "channels_65.wav", np.zeros((1600, 65), np.float32), 16000)
    sf.write(inp / "nan.wav", np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT")
    (inp / "clip.m4a").write_bytes(b"\x00\x00\x00\x18ftypM4A " + bytes(64))
    (inp / "gone.wav").symlink_to(inp / "nowhere.wav")
    kinds = {"empty.wav": "empty", "text.wav": "not a readable audio file", "corrupt.flac": "lost sync",
             "truncated.flac": "corrupt or cut off: decoding failed before the end its header promises at 15.0 s",
             "truncated.wav": "truncated", "no_samples.wav": "no audio samples",
             "rate_2k.wav": "sample rate 2000", "channels_65.wav": "channel count 65",
             "nan.wav": "NaN", "clip.m4a": "av" if _no_av() else "not a readable audio file",
             "gone.wav": "no such file"}  # a broken link, logged under its own name
    if os.geteuid() != 0:  # root reads anything
        locked = inp / "locked.flac"
        locked.write_bytes(flac)
        locked.chmod(0)
        kinds["locked.flac"] = "permission denied"
    return kinds


def _no_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return True
    return False


def test_every_bad_input_fails_alone_with_its_reason_and_exit_3(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    good = _copies(inp, 2)
    shutil.copy(SPEECH / "jfk" / "jfk.flac", inp / "jfk_44k_stereo.flac")
    kinds = _bad_inputs(inp)
    sf.write(inp / "short.wav", np.zeros(10, np.float32), 16000)  # not bad: NeMo transcribes it
    p = _cli(str(inp), "--model", str(Reference("tdt_tiny").nemo), "--out", str(out), "--format", "txt,json")
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 3, stderr
    rows = {Path(r["audio_filepath"]).name: r for r in _rows(out)}
    assert len(rows) == len(kinds) + 4 == len(_rows(out))
    assert rows["short.wav"]["status"] == "ok" and rows["short.wav"]["duration"] == 0.001
    for g in [*(g.name for g in good), "jfk_44k_stereo.flac"]:
        assert rows[g]["status"] == "ok" and rows[g]["duration"] > 1, rows[g]
        assert (out / Path(g).with_suffix(".json").name).exists()
    for name, word in kinds.items():
        r = rows[name]
        assert r["status"] == "error" and name in r["error"] and word in r["error"], (name, r["error"])
    # an error line has the file's length where its header was read before it failed, else null
    assert rows["nan.wav"]["duration"] == 1.0
    assert all(rows[n]["duration"] is None for n in ("empty.wav", "text.wav", "gone.wav", "channels_65.wav"))
    _assert_clean(out)


class FaultyFrontend:
    """The engine's frontend, except that it kills or hangs its worker on cue (picklable)."""

    def __init__(self, inner):
        self.inner = inner
        for k in ("sample_rate", "n_mels", "max_piece_seconds", "cut_seconds", "max_frames"):
            setattr(self, k, getattr(inner, k))

    def __call__(self, audio):
        if audio.shape[0] == CRASH_LEN:
            os.kill(os.getpid(), signal.SIGKILL)
        if audio.shape[0] == HANG_LEN:
            time.sleep(600)
        return self.inner(audio)


def test_a_crashed_or_hung_worker_fails_its_file_and_the_job_goes_on(tmp_path):
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover
    from transcribe.pipeline import run
    from transcribe.workers import FileTimeout

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 4)
    noise = (np.random.default_rng(0).standard_normal(HANG_LEN) * 0.1).astype(np.float32)
    sf.write(inp / "crash.wav", noise[:CRASH_LEN], 16000)
    sf.write(inp / "hang.wav", noise, 16000)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    engine.frontend = FaultyFrontend(engine.frontend)
    stats = run(engine, discover([str(inp)]), out, ["txt"], workers=2, file_timeout=FileTimeout(10.0, 0.0))
    rows = {Path(r["audio_filepath"]).name: r for r in _rows(out)}
    assert (stats.files_ok, stats.files_failed) == (4, 2) and len(rows) == 6
    assert "worker process died (killed by SIGKILL)" in rows["crash.wav"]["error"]
    assert "timed out" in rows["hang.wav"]["error"]
    assert (rows["crash.wav"]["duration"], rows["hang.wav"]["duration"]) == (round(CRASH_LEN / 16000, 3),
                                                                              round(HANG_LEN / 16000, 3))
    assert all(r["status"] == "ok" for n, r in rows.items() if n.startswith("f"))
    _assert_clean(out)


def test_unwritable_outputs_fail_their_file_and_a_full_disk_stops_the_run(tmp_path, monkeypatch):
    """An output name over the file system's 255 bytes fails that file alone, with the reason.
    A full disk (ENOSPC from the writer at the third file) stops the run with OutputStopped:
    the files finished before keep their outputs and log lines, nothing is left half-written,
    and the rerun resumes after them."""
    import errno

    import transcribe.output_writer as output_writer
    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 5)
    long = inp / ("x" * 251 + ".wav")  # its transcript, "x" * 251 + ".json", is 256 bytes
    sf.write(long, sf.read(inp / "f00.flac")[0], 16000)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    stats = pipeline.run(engine, discover([str(inp)]), out, ["txt", "json"], workers=1)
    rows = {Path(r["audio_filepath"]).name: r for r in _rows(out)}
    assert (stats.files_ok, stats.files_failed) == (5, 1) and len(rows) == 6
    assert rows[long.name]["status"] == "error" and "cannot write its transcript" in rows[long.name]["error"]
    assert "File name too long" in rows[long.name]["error"] and rows[long.name]["duration"] > 1
    _assert_clean(out)

    out2, calls = tmp_path / "out2", []
    real_write = output_writer.write_outputs

    def filling_disk(result, stem, formats, writes=None):
        calls.append(stem)
        if len(calls) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(stem) + ".txt")
        real_write(result, stem, formats, writes)

    long.unlink()
    monkeypatch.setattr(output_writer, "write_outputs", filling_disk)
    with pytest.raises(output_writer.OutputStopped, match="No space left on device"):
        pipeline.run(engine, discover([str(inp)]), out2, ["txt", "json"], workers=1)
    done = _rows(out2)
    assert len(done) == 2 and all(r["status"] == "ok" for r in done)
    assert sorted(p.name for p in out2.glob("*.txt")) == sorted(Path(r["audio_filepath"]).stem + ".txt" for r in done)
    _assert_clean(out2)
    monkeypatch.setattr(output_writer, "write_outputs", real_write)
    stats = pipeline.run(engine, discover([str(inp)]), out2, ["txt", "json"], workers=1)
    assert (stats.files_skipped, stats.files_ok, len(_rows(out2))) == (2, 3, 5)


def test_outputs_are_written_in_a_thread_of_their_own_while_the_job_goes_on(tmp_path, monkeypatch):
    """Writing (mostly waiting for fsync) runs in a thread of its own: `flush` hands a batch's
    files over and returns while they are still being written, so the model runs the next
    batch meanwhile (the job's thread writing them itself held a bf16 GPU run up for 0.32 of
    its 2.28 s). The next flush with files waits for that write (at most one batch in
    flight), lines stay in order, an `error` line is logged by the same thread, and a full
    disk met by the thread is raised by the job's next flush."""
    import errno
    import threading

    import transcribe.output_writer as output_writer
    from transcribe.inputs import InputFile, output_stems
    from transcribe.pipeline import RunStats
    from transcribe.results import Result
    from transcribe.writers import ResultsLog

    inp, out = tmp_path / "in", tmp_path / "out"
    files = [InputFile(p, p.relative_to(inp)) for p in _copies(inp, 4)]
    disk_free, in_write, real_write = threading.Event(), threading.Event(), output_writer.write_outputs
    full = []

    def slow_disk(result, stem, formats, writes=None):
        in_write.set()
        assert disk_free.wait(timeout=30), "flush waited for the write it handed over"
        if stem.name in full:
            raise OSError(errno.ENOSPC, "No space left on device", str(stem) + ".txt")
        real_write(result, stem, formats, writes)

    class Bar:
        def step(self):
            pass

    monkeypatch.setattr(output_writer, "write_outputs", slow_disk)
    stats = RunStats()
    with ResultsLog(out / "results.jsonl") as log:
        writer = output_writer.OutputWriter(out, ["txt"], output_stems(files), log, "m", {}, stats, Bar(),
                                            {f.path: {"size": 1, "mtime": 1} for f in files})
        writer.finished(files[0], Result("zero"), 1.0)
        writer.fail(files[1], "bad audio")
        writer.flush()  # returns with the write blocked in the thread
        assert in_write.wait(timeout=30) and not (out / "f00.txt").exists()
        writer.finished(files[2], Result("two"), 1.0)
        disk_free.set()
        writer.flush()  # waits for the first batch, then hands the second over
        full.append("f03")
        writer.finished(files[3], Result("three"), 1.0)
        with pytest.raises(output_writer.OutputStopped, match="No space left on device"):
            writer.flush()
            writer.close()
    rows = _rows(out)
    assert [(Path(r["audio_filepath"]).name, r["status"], r["text"]) for r in rows] == [
        ("f01.flac", "error", ""), ("f00.flac", "ok", "zero"), ("f02.flac", "ok", "two")]
    assert sorted(p.name for p in out.glob("*.txt")) == ["f00.txt", "f02.txt"]
    assert (stats.files_ok, stats.files_failed) == (2, 1)
    _assert_clean(out)


def test_a_file_that_changes_while_the_run_reads_it_is_redone_by_the_rerun(tmp_path, monkeypatch):
    """A cron job picks up a recording still being copied in: the worker reads part of it, the
    copy then completes. Its results.jsonl line must carry the size and mtime from before the
    read, so the rerun sees the file changed and transcribes it again; logged with the size at
    the write, the partial transcript was 'done' for good."""
    import transcribe.output_writer as output_writer
    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 3)
    growing = inp / "f01.flac"
    before = growing.stat()
    real_flush = output_writer.OutputWriter.flush

    def copy_completes(self):  # by the time the transcripts are written, the file has changed
        if growing.stat().st_mtime_ns == before.st_mtime_ns:
            os.utime(growing, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
        real_flush(self)

    monkeypatch.setattr(output_writer.OutputWriter, "flush", copy_completes)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    stats = pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1)
    assert stats.files_ok == 3
    row = {Path(r["audio_filepath"]).name: r for r in _rows(out)}["f01.flac"]
    assert (row["size"], row["mtime"]) == (before.st_size, before.st_mtime_ns)
    monkeypatch.setattr(output_writer.OutputWriter, "flush", real_flush)
    stats = pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1)
    assert (stats.files_skipped, stats.files_ok) == (2, 1)
    assert {Path(r["audio_filepath"]).name for r in _rows(out)} == {"f00.flac", "f01.flac", "f02.flac"}
    _assert_clean(out)


@needs_shared
@pytest.mark.parametrize("removed", ["log", "out"])
def test_an_out_or_log_removed_mid_run_stops_it(tmp_path, monkeypatch, removed):
    """`rm -rf OUT` (or of OUT/results.jsonl) while a run writes there: the run went on appending
    to the unlinked log, remade the folder for its transcripts and ended with exit 0, its lines
    in no file (the rerun redid everything) and no lock on the folder. It now stops as on a disk
    that takes no more writes, naming the log."""
    import transcribe.output_writer as output_writer
    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 4)
    real_flush, flushed = output_writer.OutputWriter.flush, []

    def remove_after_the_first_batch(self):
        if self.pending and len(flushed) == 1:
            self.wait()  # the first batch's lines are in the log
            if removed == "out":
                shutil.rmtree(out)
            else:
                (out / "results.jsonl").unlink()
        flushed.extend([1] if self.pending else [])
        real_flush(self)

    monkeypatch.setattr(output_writer.OutputWriter, "flush", remove_after_the_first_batch)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    with pytest.raises(output_writer.OutputStopped, match=r"results\.jsonl: removed or replaced while the run wrote"):
        pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1, batch_seconds=1.0)
    assert len(flushed) == 3  # the second batch's write finds it, and the flush after says it: not 4 batches


@needs_shared
def test_a_run_with_another_model_stopped_early_leaves_the_finished_jobs_lines(tmp_path, monkeypatch):
    """A job done by model A, then a run with model B into the same --out stopped after its
    first batch: A's lines of the files B never wrote stay (they went when B's run began: a B
    run stopped during its load left A's 20,000-file job with no log), so A's rerun redoes
    only the files B wrote over; and B's end of run leaves one line per file."""
    import signal

    import transcribe.output_writer as output_writer
    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover
    from transcribe.signals import Interrupted

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 4)
    a = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    b = ParakeetEngine.from_nemo(Reference("rnnt_tiny").nemo, "cpu", name="model-b")
    assert pipeline.run(a, discover([str(inp)]), out, ["txt"], workers=1).files_ok == 4
    done_by_a = {r["audio_filepath"]: r for r in _rows(out)}
    real_flush = output_writer.OutputWriter.flush

    def stop_after_the_first_batch(self):
        if self.pending:
            if self._writing is not None:
                self.wait()
                raise Interrupted(signal.SIGTERM)
        real_flush(self)

    monkeypatch.setattr(output_writer.OutputWriter, "flush", stop_after_the_first_batch)
    with pytest.raises(Interrupted):
        pipeline.run(b, discover([str(inp)]), out, ["txt"], workers=1, batch_seconds=1.0)
    rows = _rows(out)
    by_b = [r["audio_filepath"] for r in rows if r["model"] == "model-b"]
    assert 1 <= len(by_b) < 4 and len(rows) == 4  # one line per file once the run ended
    assert [r for r in rows if r["model"] != "model-b"] == [r for p, r in done_by_a.items() if p not in by_b]
    monkeypatch.setattr(output_writer.OutputWriter, "flush", real_flush)
    stats = pipeline.run(a, discover([str(inp)]), out, ["txt"], workers=1)
    assert (stats.files_skipped, stats.files_ok) == (4 - len(by_b), len(by_b))
    assert {r["audio_filepath"]: r["text"] for r in _rows(out)} == {p: r["text"] for p, r in done_by_a.items()}
    _assert_clean(out)


def test_a_folder_that_cannot_be_listed_fails_in_the_job_and_the_rest_is_transcribed(tmp_path):
    """A folder past the system's 4096-byte path limit (tests/test_inputs.py makes the same):
    the job logs it failed with the reason, transcribes the rest and exits 3 (it stopped with
    a traceback while sorting the inputs by their audio headers)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 2)
    fd = os.open(inp, os.O_RDONLY)
    for i in range(22):
        name = f"{i:02d}" + "L" * 198
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    p = _cli(str(inp), "--model", str(Reference("tdt_tiny").nemo), "--out", str(out), "--format", "txt")
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 3, stderr
    rows = _rows(out)
    assert sorted(r["status"] for r in rows) == ["error", "ok", "ok"]
    assert "cannot list this folder (File name too long)" in [r for r in rows if r["status"] == "error"][0]["error"]
    _assert_clean(out)


def test_a_batch_the_model_fails_on_runs_again_in_halves(tmp_path, monkeypatch, capsys):
    """The model runs out of memory on batches of more than 2 pieces and raises on one piece
    whatever its batch: every other file is transcribed as in a plain run, the bad piece's file
    alone fails, with the model's message, and after an out-of-memory batch no batch at least
    that big (rows x longest piece) is tried again."""
    import time

    import torch

    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover

    inp, out, plain = tmp_path / "in", tmp_path / "out", tmp_path / "plain"
    _copies(inp, 8)
    bad = inp / "bad.wav"
    sf.write(bad, sf.read(inp / "f03.flac")[0][:16000 * 3 + 1234], 16000)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    bad_frames = engine.frontend(sf.read(bad, dtype="float32")[0]).shape[1]
    pipeline.run(engine, discover([str(inp)]), plain, ["txt"], workers=1)
    expected = {Path(r["audio_filepath"]).name: r["text"] for r in _rows(plain)}

    real, calls = engine.transcribe_features, []

    def fragile(views, languages=None, after_pause=None):
        if not calls:
            time.sleep(1.0)  # let the worker fill the slab: the next batches are big
        calls.append((len(views), len(views) * max(v.shape[1] for v in views)))  # rows x frames
        if len(views) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(v.shape[1] == bad_frames for v in views):
            raise RuntimeError("index out of range in self (a bad piece)")
        return real(views, languages)

    monkeypatch.setattr(engine, "transcribe_features", fragile)
    stats = pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1, batch_seconds=1000)
    rows = {Path(r["audio_filepath"]).name: r for r in _rows(out)}
    assert (stats.files_ok, stats.files_failed) == (8, 1)
    assert {n: r["text"] for n, r in rows.items() if r["status"] == "ok"} == \
        {n: t for n, t in expected.items() if n != "bad.wav"}
    assert rows["bad.wav"]["status"] == "error"
    assert "bad.wav: model failed on a piece of it: RuntimeError: index out of range" in rows["bad.wav"]["error"]
    assert max(n for n, _ in calls) > 2, "no batch of more than 2 pieces: the test did not test"
    for i, (n, padded) in enumerate(calls):  # a batch tried after one ran out of memory is smaller
        ran_out = [p for m, p in calls[:i] if m > 2]
        assert n == 1 or not ran_out or padded < min(ran_out), calls
    assert "running it in halves" in capsys.readouterr().err
    _assert_clean(out)


def test_a_model_that_detects_the_language_detects_it_once_per_file(tmp_path, monkeypatch):
    """With `detects_language` (Whisper, --language auto) each file's first piece detects and
    its later pieces wait, then decode in its language; transcripts are as in a plain run. A
    first piece that says nothing passes detection to the next; a file whose detecting piece
    the model fails on fails alone, and the slots of its waiting pieces go back to the pool:
    every piece's slot is released exactly once."""
    import dataclasses
    import time

    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover
    from transcribe.results import Result
    from transcribe.workers import WorkerPool

    inp = tmp_path / "in"
    short = _copies(inp, 3)
    long = inp / "long.flac"  # 816 s: about 25 pieces of at most 40 s
    shutil.copy(SPEECH / "longform" / "librispeech_test-other_100utt_concat.flac", long)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    pipeline.run(engine, discover([str(inp)]), tmp_path / "plain", ["txt"], workers=1)
    expected = {Path(r["audio_filepath"]).name: r["text"] for r in _rows(tmp_path / "plain")}

    engine.detects_language = True
    real, calls, first_frames = engine.transcribe_features, [], set()

    def detecting(views, languages=None, after_pause=None):
        rows = [(v.shape[1], lang) for v, lang in zip(views, languages)]
        calls.append(rows)
        results = real(views, languages)
        for i, (frames, lang) in enumerate(rows):
            if lang is None and frames in first_frames:
                time.sleep(1.0)  # the worker delivers the file's later pieces meanwhile: they wait
                results[i] = Result("")  # silent: the next piece detects
            elif lang is None and first_frames and frames not in short_frames:
                raise RuntimeError("a detecting piece the model fails on")
        return [dataclasses.replace(r, language=lang or (r.language if first_frames else "xx"))
                for r, (_, lang) in zip(results, rows)]

    monkeypatch.setattr(engine, "transcribe_features", detecting)
    stats = pipeline.run(engine, discover([str(inp)]), tmp_path / "out", ["txt"], workers=1)
    assert stats.files_ok == 4 and {Path(r["audio_filepath"]).name: r["text"]
                                    for r in _rows(tmp_path / "out")} == expected
    rows = [row for call in calls for row in call]
    assert sum(lang is None for _, lang in rows) == 4  # one detecting piece per file
    assert sum(lang == "xx" for _, lang in rows) >= 20 and {lang for _, lang in rows} == {None, "xx"}
    short_frames = {engine.frontend(sf.read(p, dtype="float32")[0]).shape[1] for p in short}
    first_frames.update(f for f, lang in rows if lang is None and f not in short_frames)
    assert len(first_frames) == 1  # the long file's first piece

    pieces, released = [], []
    on_event, release = pipeline._Job._on_event, WorkerPool.release
    monkeypatch.setattr(pipeline._Job, "_on_event", lambda self, event, *a: (
        pieces.append(event[1].slot) if event[0] == "piece" else None, on_event(self, event, *a))[1])
    monkeypatch.setattr(WorkerPool, "release", lambda self, slots: (released.extend(slots), release(self, slots))[1])
    calls.clear()
    stats = pipeline.run(engine, discover([str(inp)]), tmp_path / "failing", ["txt"], workers=1)
    failing = {Path(r["audio_filepath"]).name: r for r in _rows(tmp_path / "failing")}
    assert (stats.files_ok, stats.files_failed) == (3, 1)
    assert "model failed on a piece of it: RuntimeError: a detecting piece" in failing["long.flac"]["error"]
    assert {n: r["text"] for n, r in failing.items() if n != "long.flac"} == \
        {n: t for n, t in expected.items() if n != "long.flac"}
    detected = [lang for call in calls for _, lang in call]
    assert detected.count(None) == 5 and "xx" not in detected  # 3 short, the silent one, the failing one
    assert len(pieces) > 10 and sorted(released) == sorted(pieces)
    _assert_clean(tmp_path / "failing")


def test_an_unsure_first_piece_waits_for_a_sure_one_and_is_decoded_again_in_its_language(tmp_path, monkeypatch):
    """Music before the speech: the long file's first piece detects a language it is unsure of
    and writes text in it; its slot and result wait while the second piece detects, sure; then
    the first is decoded again in that language, so the file reads as a plain run's. Every
    piece's slot goes back exactly once, the re-decoded one's after its second batch."""
    import dataclasses

    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover
    from transcribe.results import Result
    from transcribe.workers import WorkerPool

    inp = tmp_path / "in"
    short = _copies(inp, 2)
    shutil.copy(SPEECH / "longform" / "librispeech_test-other_100utt_concat.flac", inp / "long.flac")
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    pipeline.run(engine, discover([str(inp)]), tmp_path / "plain", ["txt"], workers=1)
    expected = {Path(r["audio_filepath"]).name: r["text"] for r in _rows(tmp_path / "plain")}
    short_frames = {engine.frontend(sf.read(p, dtype="float32")[0]).shape[1] for p in short}

    engine.detects_language = True
    real, calls, probes = engine.transcribe_features, [], []

    def detecting(views, languages=None, after_pause=None):
        rows = [(v.shape[1], lang) for v, lang in zip(views, languages)]
        calls.append(rows)
        out = []
        for r, (frames, lang) in zip(real(views, languages), rows):
            if lang is None and frames not in short_frames:
                probes.append(frames)
                if len(probes) == 1:  # the long file's first piece: a tune, "Romanian" at 0.64
                    out.append(Result("ma de reine", language="ro", language_probability=0.64))
                    continue
            out.append(dataclasses.replace(r, language=lang or "xx", language_probability=None if lang else 0.99))
        return out

    pieces, released = [], []
    on_event, release = pipeline._Job._on_event, WorkerPool.release
    monkeypatch.setattr(engine, "transcribe_features", detecting)
    monkeypatch.setattr(pipeline._Job, "_on_event", lambda self, event, *a: (
        pieces.append(event[1].slot) if event[0] == "piece" else None, on_event(self, event, *a))[1])
    monkeypatch.setattr(WorkerPool, "release", lambda self, slots: (released.extend(slots), release(self, slots))[1])
    stats = pipeline.run(engine, discover([str(inp)]), tmp_path / "out", ["txt"], workers=1)
    assert stats.files_ok == 3 and {Path(r["audio_filepath"]).name: r["text"]
                                    for r in _rows(tmp_path / "out")} == expected
    assert len(probes) == 2  # the long file's first two pieces detected; the rest took "xx"
    rows = [row for call in calls for row in call]
    assert [lang for f, lang in rows if f == probes[0]] == [None, "xx"]  # decoded again, in "xx"
    assert sum(lang is None for _, lang in rows) == 4 and {lang for _, lang in rows} == {None, "xx"}
    assert len(pieces) > 10 and sorted(released) == sorted(pieces)
    _assert_clean(tmp_path / "out")


def test_a_second_run_into_the_same_out_is_refused_while_the_first_holds_it(tmp_path):
    """Overlapping cron jobs: while a run holds --out (here this test, through the same lock),
    another transcribe or merge into it exits 1 naming the holder's pid and touches nothing;
    once the holder is gone the same command runs."""
    from transcribe.resume import LOCK_NAME, out_dir_lock

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 2)
    model = str(Reference("tdt_tiny").nemo)
    with out_dir_lock(out):
        (out / ".f00.txt.transcribe-abcd1234.tmp").write_text("a live run's half-written output")
        busy = subprocess.run([sys.executable, "-m", "transcribe.cli", str(inp), "--model", model, "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert busy.returncode == 1, busy.stderr
        assert f"in use by another transcribe run (pid {os.getpid()})" in busy.stderr
        assert "model:" not in busy.stderr  # found before the model loads (minutes for a big one)
        assert (out / ".f00.txt.transcribe-abcd1234.tmp").exists() and not (out / "results.jsonl").exists()
        (out / ".notes.abcd1234.tmp").write_text("another program's temporary file")
        (tmp_path / "shard").mkdir()
        (tmp_path / "shard" / "results.jsonl").write_text("")
        merge = subprocess.run([sys.executable, "-m", "transcribe.cli", "merge", str(tmp_path / "shard"),
                                "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert merge.returncode == 1 and "in use by another transcribe run" in merge.stderr
        assert not (out / "results.jsonl").exists()
    done = subprocess.run([sys.executable, "-m", "transcribe.cli", str(inp), "--model", model, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(_rows(out)) == 2 and (out / LOCK_NAME).exists()
    assert (out / ".notes.abcd1234.tmp").read_text() == "another program's temporary file"  # not ours: kept
    (out / ".notes.abcd1234.tmp").unlink()
    _assert_clean(out)  # the dead run's temporary file was swept once the folder was free


def test_a_file_system_without_flock_runs_unguarded_with_a_note(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from transcribe.resume import out_dir_lock

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with out_dir_lock(tmp_path / "out"):
        pass
    assert "cannot lock it (Function not implemented)" in capsys.readouterr().err


def test_a_job_needs_no_room_in_dev_shm(tmp_path):
    """Docker gives /dev/shm 64 MB, less than the slab: the job had to shrink its batches, or
    stopped when not even a batch per worker fitted. The slab is anonymous memory now, so a
    /dev/shm of 1 MB (a mount namespace of its own, where the machine allows one) changes
    nothing."""
    if not shutil.which("unshare") or subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small /dev/shm here (needs unshare and CAP_SYS_ADMIN)")
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 6)
    cli = [sys.executable, "-m", "transcribe.cli", str(inp), "--model", str(Reference("tdt_tiny").nemo),
           "--out", str(out), "--format", "txt", "--workers", "2"]
    script = "mount -t tmpfs -o size=1m tmpfs /dev/shm && df -k /dev/shm | tail -1 && exec \"$@\""
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *cli], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[1] == "1024"  # the job did run beside a 1 MB /dev/shm
    assert [row["status"] for row in _rows(out)] == ["ok"] * 6
    _assert_clean(out)


def _start_and_kill(inp: Path, out: Path, model: str, group: bool, min_lines: int) -> list[int]:
    p = _cli(str(inp), "--model", model, "--out", str(out), "--format", "txt,json", "--batch-seconds", "10",
             "--workers", "2", start_new_session=group)
    _wait_lines(p, out, min_lines)
    pids = _descendants(p.pid)
    if group:  # the features' memory: held by the job and its workers only, so it dies with them
        holders = [q for q in [p.pid, *pids] if f"/memfd:{MEMFD_NAME}" in _maps(q)]
        assert p.pid in holders and len(holders) >= 3, holders
        os.killpg(p.pid, signal.SIGKILL)  # a scheduler killing the whole job
    else:
        p.kill()
    p.communicate(timeout=60)
    assert len(_rows(out)) < N_JOB, "the job finished before the kill; use more files"
    return pids


def test_killed_runs_resume_with_one_line_per_file_and_redo_nothing(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, N_JOB)
    model = str(Reference("tdt_tiny").nemo)
    pids = _start_and_kill(inp, out, model, group=True, min_lines=3)
    pids += _start_and_kill(inp, out, model, group=False, min_lines=len(_rows(out)) + 2)
    _assert_clean(out, pids, killed=True)
    done = {r["audio_filepath"] for r in _rows(out)}
    assert len(done) == len(_rows(out))
    stamps = {f: (out / Path(f).with_suffix(".txt").name).stat().st_mtime_ns for f in done}
    p = _cli(str(inp), "--model", model, "--out", str(out), "--format", "txt,json")
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    rows = _rows(out)
    assert sorted(Path(r["audio_filepath"]).name for r in rows) == [f"f{i:02d}.flac" for i in range(N_JOB)]
    assert all(r["status"] == "ok" for r in rows) and f"{len(done)} already done" in stderr
    assert all((out / Path(f).with_suffix(".txt").name).stat().st_mtime_ns == t for f, t in stamps.items())
    _assert_clean(out)  # what the kills left mid-write was swept (planted for sure in the lock test)


@pytest.mark.parametrize("sig, code, force", [(signal.SIGTERM, 143, ()), (signal.SIGINT, 130, ("--force",)),
                                              (signal.SIGHUP, 129, ()), (signal.SIGUSR1, 138, ())])
def test_stop_signals_stop_cleanly(tmp_path, sig, code, force):
    """SIGHUP (a terminal closed under a job without nohup) and SIGUSR1 (Slurm's `--signal`
    warning of a time limit) killed the process outright, dropping the files transcribed but
    not yet handed to the writer, with no word: they stop it as SIGTERM does."""
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, N_JOB)
    p = _cli(str(inp), "--model", str(Reference("tdt_tiny").nemo), "--out", str(out), "--batch-seconds", "10", *force)
    _wait_lines(p, out, 2)
    pids = _descendants(p.pid)
    p.send_signal(sig)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == code, stderr
    assert "interrupted" in stderr and 2 <= len(_rows(out)) < N_JOB
    # The same command resumes; with --force it would redo everything, so the note says so.
    assert ("run it again without --force to resume" if force else "run the same command again to resume") in stderr
    assert all(r["status"] == "ok" for r in _rows(out))
    _assert_clean(out, pids)


def test_a_run_stopped_while_redoing_files_for_another_format_keeps_the_rest_done(tmp_path):
    """A run redoing done files for another format dropped all their lines before it began:
    stopped after a few files, it left the others with none, and the next txt run redid them
    all, their transcripts intact (209 of 400 lines left). Lines by the same model (and by
    another: test_a_run_with_another_model_stopped_early_leaves_the_finished_jobs_lines) now go
    only when the run ends, and a new line is the one that counts; --force's still go first."""
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, N_JOB)
    args = [str(inp), "--model", str(Reference("tdt_tiny").nemo), "--out", str(out), "--batch-seconds", "10"]
    p = _cli(*args, "--format", "txt")
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    p = _cli(*args, "--format", "srt")
    _wait_lines(p, out, N_JOB + 2)  # its first lines, after the txt run's
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    rows = _rows(out)
    assert sorted(Path(r["audio_filepath"]).name for r in rows) == [f"f{i:02d}.flac" for i in range(N_JOB)]
    with_srt = [r for r in rows if any(o.endswith(".srt") for o in r["outputs"])]
    assert 2 <= len(with_srt) < N_JOB and all(any(o.endswith(".txt") for o in r["outputs"]) for r in rows)
    p = _cli(*args, "--format", "txt")
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0 and "every file is done already" in stderr, stderr
    # --force redoes every file: stopped, the rerun it advises redoes those it had not reached
    before = (out / "results.jsonl").stat().st_ino
    p = _cli(*args, "--format", "txt", "--force")
    deadline = time.monotonic() + 240
    while (out / "results.jsonl").stat().st_ino == before or len(_rows(out)) < 2:  # rewritten, then 2 lines
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 130 and "run it again without --force to resume" in stderr, stderr
    forced = len(_rows(out))
    assert 2 <= forced < N_JOB
    p = _cli(*args, "--format", "txt")
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0 and f"{N_JOB - forced} files transcribed, 0 failed, {forced} already done" in stderr, stderr
    assert len(_rows(out)) == N_JOB
    _assert_clean(out)


_SECOND_SIGINT = """
import os, signal, sys, time
import typer
from transcribe.cli_job import interruptible
from transcribe.signals import Interrupted, remember_sigint

def job():
    if sys.argv[1] == "interrupted":
        raise Interrupted(signal.SIGINT)
    raise KeyboardInterrupt  # a ^C after the job put Python's handler back, on its way out

remember_sigint()
try:
    interruptible(job)
except typer.Exit as e:
    print("exit", e.exit_code, flush=True)
os.kill(os.getpid(), signal.SIGINT)  # the impatient second press, while the process exits
time.sleep(5)
print("not stopped by the second ^C")
"""


@pytest.mark.parametrize("how", ["interrupted", "keyboard"])
def test_a_second_sigint_while_the_command_exits_ends_it_by_sigint_and_no_traceback(how):
    """A ^C pressed again while an interrupted command was exiting raised KeyboardInterrupt into
    an atexit callback ("Exception ignored", a traceback); a ^C landing just after the job had
    left said "Aborted!" and exited 1. Both end quietly by SIGINT (what a shell loop needs to
    stop: transcribe/__main__.py), the command's message said once. (A press after Python's
    finalization has put the default handler back still ends the process by the signal, which
    a shell reports as 130 all the same.)"""
    p = subprocess.run([sys.executable, "-c", _SECOND_SIGINT, how], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == -signal.SIGINT, (p.returncode, p.stdout, p.stderr)  # a shell reads 130
    assert p.stdout == "exit 130\n" and "Traceback" not in p.stderr and "Exception ignored" not in p.stderr
    assert p.stderr.count("interrupted by SIGINT: finished files are written") == 1, p.stderr


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed ^C itself
def test_a_sigint_whose_exception_was_swallowed_still_stops_the_job(tmp_path):
    """A ^C whose KeyboardInterrupt lands in a __del__ is only printed by Python ("Exception
    ignored"): a run whose model load met one went on to the end and exited 0. The signal is
    remembered all the same: the job stops at its start (Interrupted, nothing written), and
    the next job in the process, the ^C said, runs whole."""
    import transcribe.pipeline as pipeline
    from engines.parakeet import ParakeetEngine
    from transcribe import signals
    from transcribe.inputs import discover

    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 2)
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")

    class SwallowsItsInterrupt:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here; its KeyboardInterrupt dies with __del__

    before = signal.getsignal(signal.SIGINT)
    try:
        signals.remember_sigint()  # as a transcribing command does first
        SwallowsItsInterrupt().__class__  # made and dropped at once
        with pytest.raises(signals.Interrupted):
            pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1)
        assert _rows(out) == [] and not list(out.glob("*.txt"))
        stats = pipeline.run(engine, discover([str(inp)]), out, ["txt"], workers=1)
        assert stats.files_ok == 2
    finally:
        signal.signal(signal.SIGINT, before)
    _assert_clean(out)


def test_a_sigint_while_the_model_loads_ends_the_command_with_130_not_a_traceback(tmp_path, monkeypatch, capsys):
    """torch's reader turns a ^C in the middle of torch.load into an AttributeError: the
    command printed that traceback and exited 1. It exits 130 saying nothing was transcribed,
    and the ^C, said, does not stop a later job in the same process (it had failed the next
    test's run when the tests ran in another order)."""
    import engines.loader as loader
    from transcribe.signals import stop_if_signalled

    def load_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        try:
            time.sleep(1.0)
        except KeyboardInterrupt:  # what torch.load makes of it
            raise AttributeError("'ExFileObject' object has no attribute 'read'") from None

    monkeypatch.setattr(loader, "load_engine", load_interrupted)
    code, err = _prepare_exit(capsys)
    assert code == 130 and "interrupted by SIGINT while the model loaded: nothing was transcribed" in err
    stop_if_signalled()  # said, so forgotten: a later job in this process (a library caller's) runs


def _prepare_exit(capsys) -> tuple[int, str]:
    """(exit status, stderr) of `prepare` on one file, which must end the command."""
    import typer

    from transcribe.cli_job import prepare

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(typer.Exit) as stopped:
            # a checkpoint there is (a name there is none of ends the command before the load)
            prepare([str(SPEECH / "jfk" / "jfk.flac")], str(Reference("tdt_tiny").nemo), "cpu", None, 1)
    finally:
        signal.signal(signal.SIGINT, before)
    return stopped.value.exit_code, capsys.readouterr().err


def test_a_sigint_while_torch_imports_for_the_load_also_says_so(monkeypatch, capsys):
    """The engine's modules import torch (seconds): a ^C there is a ^C during the load. Moved
    out of the guarded block, it ended the command with 130 and no word."""
    import importlib.abc
    import sys

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "engines.encoder_backend":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)  # the KeyboardInterrupt arrives inside the import
            return None

    monkeypatch.delitem(sys.modules, "engines.encoder_backend", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    code, err = _prepare_exit(capsys)
    assert code == 130 and "interrupted by SIGINT while the model loaded" in err


def test_a_job_started_with_sigint_ignored_keeps_ignoring_it(tmp_path):
    """`cmd &` from a script (or nohup) starts the job with SIGINT ignored, so that a ^C meant
    for the shell spares it; it installed its own handler anyway and stopped (130). It runs
    on to the end; SIGTERM still stops it."""
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, N_JOB)
    p = _cli(str(inp), "--model", str(Reference("tdt_tiny").nemo), "--out", str(out), "--batch-seconds", "10",
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _wait_lines(p, out, 2)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 0 and "interrupted" not in stderr, stderr
    assert len(_rows(out)) == N_JOB and all(r["status"] == "ok" for r in _rows(out))
    _assert_clean(out)


def _closed_pipe() -> int:
    """The write end of a pipe nobody reads (`transcribe ... 2>&1 | head -1` once head is done)."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("how", ["stderr a closed pipe", "stderr a full disk", "stderr closed"])
def test_a_log_that_stops_taking_writes_does_not_stop_the_job(tmp_path, how):
    """A cron log on a full disk, `2>&1 | head -1` or `2>&-`: the first error line raised (EPIPE,
    ENOSPC, or sys.stderr None) and the job ended with exit 1, the files finished but not yet
    logged lost (results.jsonl empty with 4 of 5 files transcribed). Now what cannot be said is
    dropped and the job ends as it would have: every file logged, exit 3 for the bad one. Three
    workers, more than these cores: those spawned once the job runs inherit the /dev/null put
    in place of a closed stderr (private, it left each without a stderr: three deaths, exit 1)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    _copies(inp, 4)
    (inp / "bad.wav").write_text("not audio")
    streams = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    closed = None
    if how == "stderr a closed pipe":
        closed = streams["stderr"] = _closed_pipe()
    elif how == "stderr a full disk":
        streams["stderr"] = open("/dev/full", "w")
    p = subprocess.run([sys.executable, "-m", "transcribe.cli", str(inp), "--model", str(Reference("tdt_tiny").nemo),
                        "--out", str(out), "--workers", "3"], cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600,
                       preexec_fn=(lambda: os.close(2)) if how == "stderr closed" else None, **streams)
    if closed is not None:
        os.close(closed)
    rows = _rows(out)
    assert p.returncode == 3, how
    assert sorted((Path(r["audio_filepath"]).name, r["status"]) for r in rows) == \
        [("bad.wav", "error")] + [(f"f{i:02d}.flac", "ok") for i in range(4)]


def test_a_ctrl_c_stops_a_shell_loop_over_folders(tmp_path):
    """`for d in ...; do transcribe "$d" ...; done` and a ^C: the command exited 130, which a
    shell takes for a child that handled the signal, and went on to the next folder (one ^C
    per folder). It now ends by SIGINT itself once its work is written, as Python does for an
    uncaught KeyboardInterrupt; the shell still reports 130."""
    inp = tmp_path / "in"
    _copies(inp, N_JOB)
    model = str(Reference("tdt_tiny").nemo)
    loop = (f'for i in 1 2; do "{sys.executable}" -m transcribe "{inp}" --model "{model}" --out "{tmp_path}/out$i" '
            '--batch-seconds 10; echo "went on after run $i: $?"; done')
    # A shell of its own session whose ^C (SIGINT to the group) is not ignored, as a terminal's.
    shell = subprocess.Popen(["bash", "-c", loop], cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while len(_rows(tmp_path / "out1")) < 2:
        assert shell.poll() is None and time.monotonic() < deadline, shell.communicate()
        time.sleep(0.05)
    os.killpg(shell.pid, signal.SIGINT)
    stdout, stderr = shell.communicate(timeout=60)
    assert "went on" not in stdout and not (tmp_path / "out2").exists(), (stdout, stderr)
    # The shell too ends by the signal, as a loop of `sleep`s does (its caller's $? reads 130).
    assert shell.returncode == -signal.SIGINT and "interrupted by SIGINT: finished files are written" in stderr, stderr


_CHILD_HAS_STDERR = """
import subprocess, sys
from transcribe.stdio import steady_std_streams
steady_std_streams()
child = subprocess.run([sys.executable, "-c", "import sys; print(sys.stderr is not None)"], capture_output=False,
                       stdout=subprocess.PIPE, text=True, close_fds=True)
print(child.stdout.strip(), file=sys.stdout)
"""


def test_a_closed_stderr_is_replaced_by_one_the_workers_inherit():
    """Under `2>&-` the /dev/null put on fd 2 took the closed number from `os.open`, private to
    the process: a worker spawned then started without a stderr and died at its first flush
    (with 3 workers, on a 6-core machine, the run ended with exit 1 and nothing done)."""
    p = subprocess.run([sys.executable, "-c", _CHILD_HAS_STDERR], cwd=ROOT, capture_output=False,
                       stdout=subprocess.PIPE, text=True, timeout=60, preexec_fn=lambda: os.close(2))
    assert p.stdout.strip() == "True", p.stdout


_CHILD_WRITES_MUCH = """
import os, sys
from transcribe.stdio import steady_std_streams
steady_std_streams(stdout=False)
if sys.argv[2] == "later":
    os.set_blocking(2, False)
for i in range(4000):
    print(f"line {i:05d} " + "x" * 50, file=getattr(sys, sys.argv[1]))
"""


@pytest.mark.parametrize("stream, when", [("stderr", "at start"), ("stdout", "at start"), ("stderr", "later")])
def test_a_non_blocking_log_pipe_loses_no_line(stream, when):
    """A stream handed over non-blocking (a Node.js parent's pipe, some CI log pipes): a write
    the reader had not caught up with failed with EAGAIN, and stderr took that for a broken
    stream and went silent for the rest of the run; `stream`'s stdout (not wrapped) raised.
    Every line of 250 KB, four pipe buffers, must arrive though the reader starts late, and
    also where another holder of the pipe makes it non-blocking again during the run."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    p = subprocess.Popen([sys.executable, "-c", _CHILD_WRITES_MUCH, stream, when], cwd=ROOT,
                         **{stream: w, "stdout" if stream == "stderr" else "stderr": subprocess.DEVNULL})
    os.close(w)
    time.sleep(1.0)  # the child fills the pipe meanwhile
    with open(r, "rb") as f:
        got = f.read().decode().splitlines()
    assert p.wait(timeout=60) == 0
    assert got == [f"line {i:05d} " + "x" * 50 for i in range(4000)], (len(got), got[-1:])
