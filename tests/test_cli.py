"""The command line end to end: NeMo parity through files on disk, exit codes, resume."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import OFFLINE_VARIANTS, SPEECH, Reference, needs_shared


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "transcribe.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def _manifest(ref: Reference, path: Path) -> Path:
    path.write_text("".join(json.dumps({"audio_filepath": str(ref.audio_path(i))}) + "\n" for i in range(len(ref.files))))
    return path


@needs_shared
@pytest.mark.parametrize("options", [("--batch-seconds", "45"),
                                     ("--features-on", "device", "--workers", "2", "--batch-seconds", "1")],
                         ids=["batched", "features-on-device-one-file-batches"])
@pytest.mark.parametrize("variant", OFFLINE_VARIANTS)
def test_cli_reproduces_nemo(variant, options, tmp_path):
    """NeMo's text and word times for every file, under options that must not change them
    (the second: log-mel on the engine's device, two workers, batches of ~one file)."""
    ref = Reference(variant)
    out = tmp_path / "out"
    p = run_cli(str(_manifest(ref, tmp_path / "m.jsonl")), "--model", str(ref.nemo), "--out", str(out),
                "--format", "json,txt", *options)
    assert p.returncode == 0, p.stderr
    rows = {r["audio_filepath"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert len(rows) == len(ref.files)
    for i, f in enumerate(ref.files):
        audio = ref.audio_path(i)
        row = rows[str(audio)]
        assert row["status"] == "ok" and row["error"] is None and row["model"] == str(ref.nemo)
        assert row["text"] == f["transcribe_text"]
        assert abs(row["duration"] - f["samples"] / 16000) < 1e-3
        (json_out,) = list(out.rglob(audio.stem + ".json"))
        doc = json.loads(json_out.read_text())
        # NeMo's times, except that none runs past the end of the file (NeMo's last word does).
        end = f["samples"] / 16000
        assert [(w["word"], w["start"], w["end"]) for w in doc["words"]] == [
            (w["word"], round(min(w["start"], end), 3), round(min(w["end"], end), 3)) for w in f["words"]]
        assert doc["words"][-1]["end"] <= row["duration"] and doc["segments"][-1]["end"] <= row["duration"]
    assert "RTFx" in p.stderr


@needs_shared
def test_cli_transcribes_the_streaming_model_offline_as_nemo(tmp_path):
    """The cache-aware streaming model run offline (causal convolutions, chunked_limited
    attention, batched and padded): NeMo's `transcribe()` text for every file."""
    ref = Reference("rnnt_streaming_tiny")
    out = tmp_path / "out"
    p = run_cli(str(_manifest(ref, tmp_path / "m.jsonl")), "--model", str(ref.nemo), "--out", str(out),
                "--format", "txt", "--batch-seconds", "45")
    assert p.returncode == 0, p.stderr
    rows = {r["audio_filepath"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert [rows[str(ref.audio_path(i))]["text"] for i in range(len(ref.files))] == [
        f["transcribe_text"] for f in ref.files]


@needs_shared
def test_bad_files_fail_alone_with_exit_3_and_rerun_resumes(tmp_path):
    ref = Reference("tdt_tiny")
    inp = tmp_path / "in"
    inp.mkdir()
    good = [inp / "a.flac", inp / "b.flac"]
    for i, g in enumerate(good):
        g.write_bytes(ref.audio_path(i).read_bytes())
    (inp / "empty.wav").write_bytes(b"")
    (inp / "text.wav").write_text("not audio at all")
    sf.write(inp / "nan.wav", np.full(1600, np.nan, dtype=np.float32), 16000, subtype="FLOAT")
    out = tmp_path / "out"
    p = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 3, p.stderr
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    status = {Path(r["audio_filepath"]).name: r for r in rows}
    assert {k for k, r in status.items() if r["status"] == "ok"} == {"a.flac", "b.flac"}
    for bad in ("empty.wav", "text.wav", "nan.wav"):
        assert status[bad]["status"] == "error" and bad in status[bad]["error"]
    assert (out / "a.txt").read_text().strip() == ref.files[0]["transcribe_text"].strip()

    # A rerun skips the finished files, retries the failed ones, and keeps one line per file.
    mtime = (out / "a.txt").stat().st_mtime_ns
    p2 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out))
    assert p2.returncode == 3
    rows2 = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(Path(r["audio_filepath"]).name for r in rows2) == sorted(status)
    assert (out / "a.txt").stat().st_mtime_ns == mtime
    assert "2 already done" in p2.stderr

    # A file is done when the outputs asked for exist: a rerun that asks for subtitles too
    # writes them, and a deleted transcript is made again, the rest left alone.
    p3 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "txt,srt")
    assert "0 already done" in p3.stderr and (out / "a.srt").is_file() and (out / "b.srt").is_file()
    (out / "b.srt").unlink()
    mtime = (out / "a.srt").stat().st_mtime_ns
    p4 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "txt,srt")
    assert "1 already done" in p4.stderr and (out / "b.srt").is_file()
    assert (out / "a.srt").stat().st_mtime_ns == mtime
    rows4 = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(Path(r["audio_filepath"]).name for r in rows4) == sorted(status)

    # Another model transcribes again: the old model's text is not kept as this one's.
    other = Reference("rnnt_tiny")
    p5 = run_cli(str(inp), "--model", str(other.nemo), "--out", str(out), "--format", "txt,srt")
    assert "0 already done" in p5.stderr
    rows5 = {Path(r["audio_filepath"]).name: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows5["a.flac"]["model"] == str(other.nemo) and len(rows5) == len(status)
    assert (out / "a.txt").read_text().strip() == other.files[0]["transcribe_text"].strip()

    # Each ok line names its outputs; a format this run did not write (the other model's srt,
    # left in place) is not taken as done by a later run that asks for it again.
    assert rows5["a.flac"]["outputs"] == ["a.txt", "a.srt"]
    p6 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "txt")
    assert "0 already done" in p6.stderr
    stale = (out / "a.srt").stat().st_mtime_ns
    p7 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "txt,srt")
    assert "0 already done" in p7.stderr and (out / "a.srt").stat().st_mtime_ns != stale
    rows7 = {Path(r["audio_filepath"]).name: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows7["a.flac"]["outputs"] == ["a.txt", "a.srt"] and rows7["a.flac"]["model"] == str(ref.nemo)
    assert "2 already done" in run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "srt").stderr

    # A run for a format the lines lack keeps the formats they had (same audio, model and
    # settings): a txt,srt run after it finds every file done, rather than redo them all.
    p8 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "json")
    assert "0 already done" in p8.stderr
    rows8 = {Path(r["audio_filepath"]).name: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows8["a.flac"]["outputs"] == ["a.json", "a.txt", "a.srt"]
    assert "2 already done" in run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out), "--format", "txt,srt").stderr


@needs_shared
def test_mp3_decoder_warnings_name_their_file_once(tmp_path):
    """libmpg123's "Warning: Xing stream size off ..." and "Note: Illegal Audio-MPEG-Header ..."
    named no file, and the Xing warning came twice (the header read for ordering, then the
    worker's decode). Each now comes once, as `PATH: ...`; the file is still transcribed."""
    ref = Reference("tdt_tiny")
    inp = tmp_path / "in"
    inp.mkdir()
    audio, rate = sf.read(ref.audio_path(0), dtype="float32")
    sf.write(tmp_path / "a.mp3", audio[:3 * rate], rate, format="MP3")
    whole = (tmp_path / "a.mp3").read_bytes()  # ~1 kB of junk inside: > 1 % (mpg123's Xing warning),
    junk = bytes(range(7, 200)) * 5  # < 8 kB (not taken for MP3s joined end to end, which PyAV reads)
    (inp / "damaged.mp3").write_bytes(whole[:len(whole) // 2] + junk + whole[len(whole) // 2:])
    (inp / "b.flac").write_bytes(ref.audio_path(1).read_bytes())
    p = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.splitlines() if "Xing" in line or "MPEG-Header" in line]
    assert sum("Xing" in line for line in said) == 1 and len(said) >= 2, p.stderr
    assert all(line.startswith(f"{inp / 'damaged.mp3'}: ") for line in said), p.stderr


@needs_shared
def test_a_model_path_is_recorded_absolute_so_the_same_name_elsewhere_is_another_model(tmp_path):
    """`--model m.nemo` typed in two folders names two checkpoints: the second run must not
    keep the first one's transcripts as done."""
    a, b = Reference("tdt_tiny"), Reference("rnnt_tiny")
    for folder, ref in (("ma", a), ("mb", b)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.nemo").write_bytes(ref.nemo.read_bytes())
    audio, out = a.audio_path(0), tmp_path / "out"
    first = run_cli(str(audio), "--model", "m.nemo", "--out", str(out), cwd=tmp_path / "ma")
    assert first.returncode == 0, first.stderr
    second = run_cli(str(audio), "--model", "m.nemo", "--out", str(out), cwd=tmp_path / "mb")
    assert second.returncode == 0 and "0 already done" in second.stderr, second.stderr
    (row,) = map(json.loads, (out / "results.jsonl").read_text().splitlines())
    assert row["model"] == str(tmp_path / "mb" / "m.nemo") and row["text"] == b.files[0]["transcribe_text"]


@needs_shared
def test_a_lone_offset_0_line_is_the_whole_file_read_to_its_duration(tmp_path):
    """`{"offset": 0, "duration": D}` alone: named and resumed as the whole file (tools write
    it so for whole files), and read to D at most, as NeMo (lhotse) reads any line with an
    offset. It was transcribed whole: bench scored a 72 s file's words against a 15 s text.
    The first utterance of the long-form join, cut so, is NeMo's transcript of it."""
    ref = Reference("tdt_tiny")
    joined = SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"
    first = ref.files[0]
    row = {"audio_filepath": str(joined), "offset": 0, "duration": first["samples"] / 16000,
           "text": first["transcribe_text"]}
    manifest = tmp_path / "first.jsonl"
    manifest.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    p = run_cli(str(manifest), "--model", str(ref.nemo), "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr
    (log,) = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert "offset" not in log and log["duration"] == round(row["duration"], 3)
    assert log["runtime"] and f"({log['runtime']})" in p.stderr  # how it ran, as the startup line says
    doc = json.loads((out / f"{joined.stem}.json").read_text())
    assert doc["text"] == first["transcribe_text"]
    report = tmp_path / "r.json"
    assert run_cli("bench", str(manifest), "--model", str(ref.nemo), "--json", str(report)).returncode == 0
    assert json.loads(report.read_text())["wer"] == 0.0
    assert json.loads(report.read_text())["audio_seconds"] == pytest.approx(row["duration"], abs=1e-3)


@needs_shared
def test_manifest_segments_are_transcribed_each_as_the_file_it_was_cut_from(tmp_path):
    """The long-form join holds test-other 1688-142285-0000.. back to back with 0.5 s gaps,
    sample for sample: a manifest cutting it with offset + duration transcribes each segment
    as NeMo transcribed the utterance, with times from the start of the joined file, scores
    each against its own text, and a rerun finds every segment done."""
    ref = Reference("tdt_tiny")
    joined = SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"
    rows, offset = [], 0.0
    for f in ref.files[:3]:
        rows.append({"audio_filepath": str(joined), "offset": offset, "duration": f["samples"] / 16000,
                     "text": f["transcribe_text"]})
        offset += f["samples"] / 16000 + 0.5
    manifest = tmp_path / "segments.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    p = run_cli(str(manifest), "--model", str(ref.nemo), "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr
    log = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["offset"], r["duration"]) for r in log) == [(r["offset"], r["duration"]) for r in rows]
    for row, f in zip(rows, ref.files):
        doc = json.loads((out / f"{joined.stem}_{row['offset']:.2f}-{row['offset'] + row['duration']:.2f}.json").read_text())
        assert doc["text"] == f["transcribe_text"]
        end = f["samples"] / 16000
        assert [(w["word"], w["start"], w["end"]) for w in doc["words"]] == [
            (w["word"], round(row["offset"] + min(w["start"], end), 3), round(row["offset"] + min(w["end"], end), 3))
            for w in f["words"]]
    assert "3 already done" in run_cli(str(manifest), "--model", str(ref.nemo), "--out", str(out), "--format",
                                       "json").stderr
    report = tmp_path / "r.json"
    assert run_cli("bench", str(manifest), "--model", str(ref.nemo), "--json", str(report)).returncode == 0
    assert json.loads(report.read_text())["wer"] == 0.0 and json.loads(report.read_text())["files"] == 3


@needs_shared
def test_broken_manifest_lines_fail_alone_and_the_rest_is_transcribed(tmp_path):
    """A 100,000-line manifest with one bad line must not lose the night's run: the bad lines
    fail in results.jsonl with the manifest, line and reason, the good ones are transcribed."""
    ref = Reference("tdt_tiny")
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join([
        json.dumps({"audio_filepath": str(ref.audio_path(0))}),
        '{"audio_filepath": "x.flac",',
        json.dumps({"audio_filepath": str(ref.audio_path(1)), "duration": "n/a"}),
        json.dumps({"audio_filepath": str(ref.audio_path(2))}),
    ]) + "\n")
    out = tmp_path / "out"
    p = run_cli(str(m), "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr
    rows = {r["audio_filepath"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert len(rows) == 4
    for i in (0, 2):
        assert rows[str(ref.audio_path(i))]["text"] == ref.files[i]["transcribe_text"]
    broken = rows[f"{m.resolve()}:2"]
    assert broken["status"] == "error" and broken["error"].startswith(f"{m.resolve()}:2: not valid JSON")
    bad_duration = rows[str(ref.audio_path(1))]
    assert bad_duration["status"] == "error" and "duration 'n/a'" in bad_duration["error"]
    assert f"{m.resolve()}:3: duration" in p.stderr
    # A rerun has only the bad lines left, none of them opened: they fail again, logged and
    # counted, not lost from the log with an exit 0 (the cron job's record of what failed).
    p = run_cli(str(m), "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 3, p.stderr
    assert "0 files transcribed, 2 failed, 2 already done" in p.stderr
    rows = {r["audio_filepath"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert len(rows) == 4 and rows[f"{m.resolve()}:2"]["status"] == "error"
    assert rows[str(ref.audio_path(1))]["status"] == "error"


@needs_shared
def test_same_named_files_under_two_roots_both_keep_their_transcripts(tmp_path):
    ref = Reference("tdt_tiny")
    for k, root in enumerate(("a", "b")):
        (tmp_path / root).mkdir()
        (tmp_path / root / "x.flac").write_bytes(ref.audio_path(k).read_bytes())
    out = tmp_path / "out"
    p = run_cli(str(tmp_path / "a"), str(tmp_path / "b"), "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 0, p.stderr
    for k, root in enumerate(("a", "b")):
        assert (out / root / "x.txt").read_text().strip() == ref.files[k]["transcribe_text"].strip()


@needs_shared
def test_file_names_that_are_not_utf8_are_transcribed_logged_and_resumed(tmp_path):
    """A name with a Latin-1 byte (os.fsdecode keeps it as a lone surrogate) once crashed the
    whole run in soundfile's strict UTF-8 encoding of the path. Now it transcribes like any
    other file, its results line is valid UTF-8 JSON that reads back to the same name, and a
    rerun finds it done. A garbage .mp3 fails alone with a reason that is not libsndfile's
    misleading "File does not exist"."""
    ref = Reference("tdt_tiny")
    inp = tmp_path / "in"
    inp.mkdir()
    latin1 = os.path.join(os.fsencode(inp), b"caf\xe9.flac")
    with open(latin1, "wb") as f:
        f.write(ref.audio_path(0).read_bytes())
    (inp / "garbage.mp3").write_bytes(bytes(range(256)) * 20)
    out = tmp_path / "out"
    p = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr
    raw = (out / "results.jsonl").read_bytes()
    rows = {os.fsencode(r["audio_filepath"]): r for r in map(json.loads, raw.decode("utf-8").splitlines())}
    assert rows[latin1]["status"] == "ok" and rows[latin1]["text"] == ref.files[0]["transcribe_text"]
    assert os.path.exists(os.path.join(os.fsencode(out), b"caf\xe9.txt"))
    garbage = rows[os.fsencode(inp / "garbage.mp3")]
    assert garbage["status"] == "error" and "does not exist" not in garbage["error"], garbage["error"]
    p2 = run_cli(str(inp), "--model", str(ref.nemo), "--out", str(out))
    assert "1 already done" in p2.stderr, p2.stderr


def test_usage_and_nothing_to_do_exit_codes(tmp_path):
    assert run_cli(str(tmp_path), "--format", "docx").returncode == 2
    assert run_cli(str(tmp_path)).returncode == 1  # an empty folder: no inputs
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    (tmp_path / "out" / "results.jsonl").mkdir(parents=True)  # was a traceback
    p = run_cli(str(tmp_path / "a.wav"), "--out", str(tmp_path / "out"))
    assert p.returncode == 1 and "results.jsonl is not a file" in p.stderr and "Traceback" not in p.stderr
    assert run_cli(str(tmp_path / "missing.wav"), "--model", str(tmp_path / "none.nemo")).returncode == 1
    assert run_cli("bench").returncode == 2  # missing INPUT argument
    assert run_cli(str(tmp_path), "--shard", "3/2").returncode == 2  # checked before the inputs


def test_an_empty_input_is_a_usage_error_not_the_working_folder(tmp_path):
    """An INPUT that is an empty string (`transcribe "$DIR"` with DIR unset) is Path(""), which
    is ".": the whole working folder (a cron job's $HOME) was walked and transcribed. It exits 2
    before anything is read or written."""
    sf.write(tmp_path / "home.wav", np.zeros(16000, dtype=np.float32), 16000)
    for args in (["", "--out", "out"], [str(tmp_path / "home.wav"), "", "--out", "out"],
                 ["bench", ""]):
        p = run_cli(*args, "--model", "none.nemo", cwd=tmp_path)
        assert p.returncode == 2, (args, p.stderr)
        assert "is empty" in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["home.wav"]


def test_an_empty_model_or_stream_file_is_a_usage_error_not_the_default(tmp_path):
    """`--model "$MODEL"` with MODEL unset fell through to the default model: transcribe ran
    whisper-base and exited 0, export-engine went for parakeet-tdt-0.6b-v2, stream and serve
    said " is a Whisper model". `stream ""` read the working folder ("."). Each exits 2 before
    anything is read, loaded or written."""
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    for args in (["a.wav", "--model", "", "--out", "out"], ["bench", "a.wav", "-m", ""],
                 ["stream", "a.wav", "--model", ""], ["serve", "--model", "", "--port", "0"],
                 ["export-engine", "--model", "", "--onnx-only"]):
        p = run_cli(*args, cwd=tmp_path)
        assert p.returncode == 2 and "--model is empty" in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    p = run_cli("stream", "", "--model", "none.nemo", cwd=tmp_path)
    assert p.returncode == 2 and "FILE is empty" in p.stderr, p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["a.wav"]


def test_an_empty_out_is_a_usage_error_not_the_working_folder(tmp_path):
    """`--out "$OUT"` with OUT unset was Path("") too: the transcripts, results.jsonl and the
    lock went into the working folder, over a same-named .txt there (`notes.wav` -> the user's
    `notes.txt`); `merge` wrote its log there. Each exits 2 before writing anything."""
    sf.write(tmp_path / "notes.wav", np.zeros(16000, dtype=np.float32), 16000)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "results.jsonl").write_text("")
    for args in (["notes.wav", "--out", "", "--model", "none.nemo"], ["notes.wav", "-o", "", "--model", "none.nemo"],
                 ["bench", "notes.wav", "--out", "", "--model", "none.nemo"], ["merge", "s1", "--out", ""]):
        p = run_cli(*args, cwd=tmp_path)
        assert p.returncode == 2 and "--out is empty" in p.stderr, (args, p.stderr)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["notes.txt", "notes.wav", "s1"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # `merge "$S1" s1` with S1 unset: the working folder's own log is no shard's
    (tmp_path / "results.jsonl").write_text(json.dumps({"audio_filepath": "/x.wav", "status": "ok", "text": "x"}) + "\n")
    p = run_cli("merge", "", "s1", "--out", "all", cwd=tmp_path)
    assert p.returncode == 2 and "a SHARD_OUT_DIR is empty" in p.stderr, p.stderr
    assert not (tmp_path / "all").exists()
    # export-engine --cache-dir "$C": the engine and its ONNX would be cached in the working folder
    p = run_cli("export-engine", "--model", "none.nemo", "--onnx-only", "--cache-dir", "", cwd=tmp_path)
    assert p.returncode == 2 and "--cache-dir is empty" in p.stderr, p.stderr


@needs_shared
def test_unwritable_outputs_fail_before_the_model_loads(tmp_path):
    """An --out (or bench --json folder) with a file in the way exits 1 naming it, before any
    model is loaded (the model here is no archive: loading it would fail differently)."""
    audio = str(Reference("tdt_tiny").audio_path(0))
    (tmp_path / "no.nemo").write_bytes(b"not a tar archive")
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    for args in ([audio, "--out", str(blocker)], [audio, "--out", str(blocker / "sub")],
                 ["bench", audio, "--json", str(blocker / "r.json")],
                 ["merge", str(tmp_path), "--out", str(blocker)]):
        if args[0] == "merge":
            (tmp_path / "results.jsonl").write_text("")
        p = run_cli(*args, "--model", str(tmp_path / "no.nemo")) if args[0] != "merge" else run_cli(*args)
        assert p.returncode == 1, (args, p.stderr)
        assert str(blocker) in p.stderr and "cannot write there" in p.stderr and "Traceback" not in p.stderr
        if args[-1] == str(blocker):  # mkdir says "File exists"
            assert "(not a folder)" in p.stderr, p.stderr
    assert blocker.read_text() == "keep me"
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    p = run_cli(audio, "--out", str(tmp_path / "dangling"), "--model", str(tmp_path / "no.nemo"))
    assert p.returncode == 1 and "(a symlink to nothing)" in p.stderr, p.stderr
    p = run_cli(audio, "--out", str(tmp_path / "dangling" / "sub"), "--model", str(tmp_path / "no.nemo"))
    assert p.returncode == 1 and f"({tmp_path / 'dangling'} is a symlink to nothing)" in p.stderr, p.stderr


@needs_shared
def test_an_out_whose_lock_or_log_cannot_be_opened_fails_before_the_model_loads(tmp_path):
    """A folder where the lock file should be, or a results.jsonl that is a symlink to nothing,
    was a traceback (the log's: once the model had loaded); each exits 1 naming the file, before
    any model loads (the model is no archive). Unwritable ones: tests/test_resume.py."""
    audio = str(Reference("tdt_tiny").audio_path(0))
    (tmp_path / "no.nemo").write_bytes(b"not a tar archive")
    lock_out, log_out = tmp_path / "lock", tmp_path / "log"
    (lock_out / ".transcribe.lock").mkdir(parents=True)
    log_out.mkdir()
    (log_out / "results.jsonl").symlink_to(tmp_path / "gone" / "results.jsonl")
    for out, says in ((lock_out, f"its lock file {lock_out / '.transcribe.lock'} cannot be opened (Is a directory)"),
                      (log_out, f"{log_out / 'results.jsonl'} is a symlink to nothing")):
        p = run_cli(audio, "--out", str(out), "--model", str(tmp_path / "no.nemo"))
        assert p.returncode == 1 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


_TORCH_AFTER = """
import sys
from transcribe.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules)
"""


@needs_shared
@pytest.mark.parametrize("args, code", [
    (["AUDIO", "--device", "tpu"], 2), (["AUDIO", "--dtype", "fp8"], 2), (["AUDIO", "--decoder-mode", "bogus"], 2),
    (["AUDIO", "--language", "German"], 2), (["AUDIO", "--task", "translate"], 2), (["AUDIO", "--shard", "3/2"], 2),
    (["EMPTY"], 1), (["AUDIO", "--out", "BLOCKED"], 1), (["bench", "AUDIO", "--prompt", "Kennedy"], 2),
    (["serve", "--device", "tpu"], 2), (["serve", "--log-level", "loud"], 2), (["stream", "AUDIO", "--chunk-ms", "0"], 2),
    (["export-engine", "--precision", "fp8"], 2),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_usage_error_is_said_before_torch_is_imported(tmp_path, args, code):
    """Options are checked as typed, and the model's name against them, before anything heavy
    is imported: a typo is answered in a fraction of a second, not after torch's 2-4 s."""
    ref = Reference("tdt_tiny")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blocked").write_text("")
    names = {"AUDIO": str(ref.audio_path(0)), "EMPTY": str(tmp_path / "empty"), "BLOCKED": str(tmp_path / "blocked")}
    args = [names.get(a, a) for a in args]
    if args[0] not in ("serve", "stream", "export-engine") and "--out" not in args:
        args += ["--out", str(tmp_path / "x")]
    p = subprocess.run([sys.executable, "-c", _TORCH_AFTER, *args, "--model", str(ref.nemo)], capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.split() == ["exit", str(code), "False"], (p.stdout, p.stderr)
    assert p.stderr.startswith("error: ") and "Traceback" not in p.stderr


@needs_shared
@pytest.mark.parametrize("command", [["AUDIO", "--out", "OUT"], ["bench", "AUDIO", "--out", "OUT", "--json", "OUT/r.json"],
                                     ["stream", "AUDIO"], ["serve", "--port", "0"]], ids=lambda v: v[0].lower())
@pytest.mark.parametrize("model", ["parakeet-tdt-0.6b-v2x", "GONE"])
def test_a_model_there_is_none_of_is_said_before_torch_is_imported(tmp_path, command, model):
    """A misspelt name or a missing .nemo ends the command (1) with the load's message in a
    fraction of a second: no torch imported, no worker spawned, and no --out folder made. It
    used to be said after 2-6 s, from the load, and left an empty --out holding a lock file."""
    names = {"AUDIO": str(Reference("tdt_tiny").audio_path(0)), "OUT": str(tmp_path / "x"),
             "OUT/r.json": str(tmp_path / "x" / "r.json"), "GONE": str(tmp_path / "gone.nemo")}
    args = [names.get(a, a) for a in [*command, "--model", model]]
    p = subprocess.run([sys.executable, "-c", _TORCH_AFTER, *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.stdout.split() == ["exit", "1", "False"], (p.stdout, p.stderr)
    says = "unknown model 'parakeet-tdt-0.6b-v2x' (did you mean" if model != "GONE" else "gone.nemo: no such checkpoint"
    assert p.stderr.startswith(f"error: cannot load model: ") and says in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


@needs_shared
def test_a_model_that_fails_to_load_leaves_no_out_folder_it_made(tmp_path):
    """A checkpoint that cannot be read (cut short) is found only when the model loads, after
    --out was made and locked: the run removes the folder it made, and leaves one that was
    there before as it was, with what it held."""
    ref = Reference("tdt_tiny")
    broken = tmp_path / "broken.nemo"
    broken.write_bytes(ref.nemo.read_bytes()[:10_000])
    audio = str(ref.audio_path(0))
    p = run_cli(audio, "--model", str(broken), "--out", str(tmp_path / "new" / "out"))
    assert p.returncode == 1 and "cannot load model: " in p.stderr and "cut short" in p.stderr, p.stderr
    assert not (tmp_path / "new" / "out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    p = run_cli(audio, "--model", str(broken), "--out", str(kept))
    assert p.returncode == 1 and (kept / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(audio, "--model", str(broken), "--out", str(empty)).returncode == 1
    assert empty.is_dir()  # made by the user, not by the run: stays


@needs_shared
def test_a_rerun_with_every_file_done_ends_before_the_model_loads(tmp_path):
    """A rerun from cron over a folder with nothing new imports no torch, spawns no worker and
    reads no weights (half a second, not the model's load), ends with the usual last line and
    exit 0, and leaves the log as it was; --force loads the model and redoes every file."""
    ref = Reference("tdt_tiny")
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    for i in range(2):
        (inp / f"{i}.flac").write_bytes(ref.audio_path(i).read_bytes())
    args = [str(inp), "--model", str(ref.nemo), "--out", str(out)]
    assert run_cli(*args).returncode == 0
    log = (out / "results.jsonl").read_text()
    p = subprocess.run([sys.executable, "-c", _TORCH_AFTER, *args], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["exit", "0", "False"], (p.stdout, p.stderr)
    assert "not loaded: every file is done already" in p.stderr
    assert "0 files transcribed, 0 failed, 2 already done" in p.stderr
    assert (out / "results.jsonl").read_text() == log
    forced = run_cli(*args, "--force")
    assert forced.returncode == 0 and "2 files transcribed, 0 failed, 0 already done" in forced.stderr
    assert "not loaded" not in forced.stderr


@needs_shared
def test_option_values_no_model_takes_are_usage_errors(tmp_path):
    """A value that is no device, task or language code, or a Whisper option given to a
    Parakeet model, exits 2 (usage) before any work, like a bad --dtype."""
    ref = Reference("tdt_tiny")
    audio, out = str(ref.audio_path(0)), str(tmp_path / "x")
    for flags, says in ((("--device", "tpu"), "expected auto, cpu, cuda or cuda:N"),
                        (("--task", "summarise"), "expected transcribe or translate"),
                        (("--language", "klingon"), "not a Whisper language code or name"),
                        (("--language", "germn"), "did you mean german?"),
                        (("--language", "German"), "--language is for Whisper models"),
                        (("--language", "DE"), "--language is for Whisper models"),
                        (("--task", "translate"), "--task translate is for Whisper models"),
                        (("--prompt", "Kennedy"), "--prompt is for Whisper models"),
                        (("--batch-seconds", "inf"), "expected a finite number of seconds")):
        p = run_cli(audio, "--model", str(ref.nemo), "--out", out, *flags)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (flags, p.stderr)


@needs_shared
@pytest.mark.parametrize("command", [["stream", "AUDIO"], ["serve", "--port", "0"],
                                     ["export-engine", "--onnx-only", "--onnx", "OUT/x.onnx"]],
                         ids=["stream", "serve", "export-engine"])
def test_a_whisper_model_where_only_parakeet_runs_is_a_usage_error(tmp_path, command):
    """stream, serve and export-engine take Parakeet models: a Whisper one is the user's to
    change, like --language for Parakeet (2), said before anything loads or torch is imported."""
    audio = SPEECH / "jfk" / "jfk.flac"
    args = [str(audio) if a == "AUDIO" else a.replace("OUT", str(tmp_path)) for a in command]
    p = subprocess.run([sys.executable, "-c", _TORCH_AFTER, *args[:1], "--model", "whisper-base", *args[1:]],
                       capture_output=True, text=True, timeout=120)
    _, code, torch_imported = p.stdout.split()
    assert code == "2", p.stderr
    assert "whisper-base is a Whisper model" in p.stderr and "Traceback" not in p.stderr
    assert torch_imported == "False"


@needs_shared
def test_encoder_backend_and_decoder_mode_options(tmp_path):
    """Bad names are usage errors; a graph decoder mode on the CPU falls back to eager (said
    once on stderr) with NeMo's transcript; a GPU-only encoder backend on the CPU is refused."""
    ref = Reference("tdt_tiny")
    audio = str(ref.audio_path(0))
    for flag in ("--encoder-backend", "--decoder-mode"):
        p = run_cli(audio, "--model", str(ref.nemo), "--out", str(tmp_path / "x"), flag, "bogus")
        assert p.returncode == 2 and flag in p.stderr and "auto" in p.stderr
    out = tmp_path / "fg"
    p = run_cli(audio, "--model", str(ref.nemo), "--out", str(out), "--device", "cpu", "--decoder-mode", "full-graph")
    assert p.returncode == 0, p.stderr
    assert "decoder eager" in p.stderr and p.stderr.count("requested full-graph") == 1
    assert json.loads((out / "results.jsonl").read_text())["text"] == ref.files[0]["transcribe_text"]
    p = run_cli(audio, "--model", str(ref.nemo), "--out", str(tmp_path / "cg"), "--device", "cpu",
                "--encoder-backend", "cuda-graphs")
    assert p.returncode == 1 and "cannot run on this device: encoder backend 'cuda-graphs' needs a CUDA device" in p.stderr
    assert "cannot load model" not in p.stderr  # the model is fine


@needs_shared
def test_bench_report_has_the_contract_fields(tmp_path):
    ref = Reference("tdt_tiny")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(
        json.dumps({"audio_filepath": str(ref.audio_path(i)), "text": ref.files[i]["transcribe_text"]}) + "\n"
        for i in range(3)))
    p = run_cli("bench", str(manifest), "--model", str(ref.nemo), "--json", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    for key in ("audio_seconds", "wall_seconds", "rtfx", "wer", "files", "stages", "device", "model", "peak_memory_bytes",
                "padding_fraction"):
        assert key in r
    assert r["files"] == 3 and r["wer"] == 0.0  # references are the model's own transcripts
    assert r["rtfx"] > 0 and r["stages"]["encoder"] > 0 and "RTFx" in p.stdout
    # the worker counts too (each is a process importing torch: 0.27 GB, which went unreported)
    assert r["peak_memory_bytes"] - r["peak_memory_main_bytes"] > 100e6, r
    # the job's thread: waiting for its workers with nothing to run (at least the first piece:
    # workers start and decode before it) and storing results; each within the run's wall time
    assert 0 < r["stages"]["wait_for_pieces"] < r["wall_seconds"] and 0 < r["stages"]["settle"] < r["wall_seconds"]
    # ... whose stages account for its whole run, its startup (the engine's buffers and its
    # thread-count probe: a second on a busy machine) and end included: none untimed
    own = ("plan", "startup", "wait_for_pieces", "batch", "encoder", "decoder", "detokenize", "settle", "finish")
    assert all(r["stages"][k] > 0 for k in own), r["stages"]
    assert 0.9 * r["transcribe_seconds"] < sum(r["stages"][k] for k in own) < r["transcribe_seconds"] + 0.01
    # how the model ran, as the startup line says it: two reports can say why they differ
    assert r["runtime"] and f"({r['runtime']})" in p.stderr and r["settings"] == {}
    for folder in (str(tmp_path), ""):  # refused before the run, not after it with a traceback
        p = run_cli("bench", str(manifest), "--model", str(ref.nemo), "--json", folder)
        assert p.returncode == 2 and "names a folder, not a file" in p.stderr and "Traceback" not in p.stderr


def test_merge_joins_shard_logs_preferring_ok_lines(tmp_path):
    def log(d: Path, rows: list[dict]) -> Path:
        d.mkdir()
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    def row(name: str, status: str) -> dict:
        return {"audio_filepath": f"/a/{name}", "duration": 1.0, "text": name, "status": status,
                "error": None if status == "ok" else "bad", "model": "m"}

    s1 = log(tmp_path / "s1", [row("x.wav", "ok"), row("y.wav", "error")])
    s2 = log(tmp_path / "s2", [row("z.wav", "ok"), row("y.wav", "ok"), row("x.wav", "error")])
    p = run_cli("merge", str(s1), str(s2), "--out", str(tmp_path / "all"))
    assert p.returncode == 0, p.stderr
    rows = [json.loads(l) for l in (tmp_path / "all" / "results.jsonl").read_text().splitlines()]
    assert sorted((Path(r["audio_filepath"]).name, r["status"]) for r in rows) == [
        ("x.wav", "ok"), ("y.wav", "ok"), ("z.wav", "ok")]
    log(tmp_path / "s3", [row("w.wav", "error")])
    # Merged again into the same folder: the lines already there stay (x, y, z: ok) under s3's.
    p = run_cli("merge", str(tmp_path / "s3"), "--out", str(tmp_path / "all"))
    assert p.returncode == 3 and "1 shards and the log already there" in p.stderr, p.stderr
    rows = [json.loads(l) for l in (tmp_path / "all" / "results.jsonl").read_text().splitlines()]
    assert sorted((Path(r["audio_filepath"]).name, r["status"]) for r in rows) == [
        ("w.wav", "error"), ("x.wav", "ok"), ("y.wav", "ok"), ("z.wav", "ok")]
    # Into a shard's own folder: its lines are kept once, whether listed or not.
    for args in ((str(s2),), (str(s2), str(s1))):
        assert run_cli("merge", *args, "--out", str(s1)).returncode == 0
        rows = [json.loads(l) for l in (s1 / "results.jsonl").read_text().splitlines()]
        assert sorted((Path(r["audio_filepath"]).name, r["status"]) for r in rows) == [
            ("x.wav", "ok"), ("y.wav", "ok"), ("z.wav", "ok")], args
    assert run_cli("merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "all")).returncode == 1
    assert run_cli("merge", "--out", str(tmp_path / "all")).returncode == 2


def test_merge_onto_a_full_disk_says_so_and_leaves_the_log_there(tmp_path, monkeypatch):
    """A merged log the disk cannot take was a traceback (exit 1 all the same)."""
    import errno

    from typer.testing import CliRunner

    import transcribe.writers
    from transcribe.cli import sub_app

    shard, out = tmp_path / "s1", tmp_path / "all"
    for d in (shard, out):
        d.mkdir()
        (d / "results.jsonl").write_text(json.dumps({"audio_filepath": f"/a/{d.name}.wav", "duration": 1.0,
                                                     "text": "", "status": "ok", "error": None, "model": "m"}) + "\n")
    before = (out / "results.jsonl").read_text()

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transcribe.writers, "atomic_write_text", full)
    done = CliRunner().invoke(sub_app, ["merge", str(shard), "--out", str(out)])
    assert done.exit_code == 1 and not isinstance(done.exception, OSError), done.output
    assert f"cannot write {out / 'results.jsonl'}: No space left on device" in done.output
    assert (out / "results.jsonl").read_text() == before


def test_merge_refuses_a_shard_that_is_still_being_written(tmp_path):
    """A shard run still going has logged only the files it has finished: merging it then
    would give a log without the rest and exit 0. It exits 1 naming the shard instead, and
    merges once the run is over."""
    from transcribe.resume import out_dir_lock

    for name in ("s1", "s2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(json.dumps(
            {"audio_filepath": f"/a/{name}.wav", "duration": 1.0, "text": "", "status": "ok", "error": None,
             "model": "m"}) + "\n")
    with out_dir_lock(tmp_path / "s2"):  # this test stands in for the shard's run
        p = run_cli("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "all"))
        assert p.returncode == 1, p.stderr
        assert f"{tmp_path / 's2'} is still being written by a transcribe run (pid {os.getpid()})" in p.stderr
        assert not (tmp_path / "all" / "results.jsonl").exists()
    p = run_cli("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "all"))
    assert p.returncode == 0, p.stderr
    assert len((tmp_path / "all" / "results.jsonl").read_text().splitlines()) == 2



def _shard_log(d: Path, names: list[str]) -> Path:
    """A shard's --out as a run leaves it: talks/NAME.txt for each name, and an ok line
    listing it (relative to `d`)."""
    (d / "talks").mkdir(parents=True)
    rows = []
    for name in names:
        (d / "talks" / f"{name}.txt").write_text(f"{name} from {d.name}\n")
        rows.append({"audio_filepath": f"/a/talks/{name}.wav", "duration": 1.0, "text": name, "status": "ok",
                     "error": None, "model": "m", "outputs": [f"talks/{name}.txt"]})
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _transcripts(out: Path) -> dict[str, str]:
    """Audio file name -> the text of the transcript its line in `out`/results.jsonl lists,
    read through the path as given, from `out`."""
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    return {Path(r["audio_filepath"]).name: (out / r["outputs"][0]).read_text() for r in rows}


def test_merge_lists_each_output_relative_to_the_merged_folder(tmp_path):
    """A line's `outputs` are relative to its log's folder: in a merged log they named files
    in the shard's folder as if they were in --out, where nothing (or another file of that
    name) is. They are rewritten from --out, for shard folders given as absolute or relative
    paths, with a shard's own folder as --out, and for a merged folder merged again."""
    s1, s2 = _shard_log(tmp_path / "s1", ["a"]), _shard_log(tmp_path / "s2", ["b"])
    want = {"a.wav": "a from s1\n", "b.wav": "b from s2\n"}
    assert run_cli("merge", str(s1), str(s2), "--out", str(tmp_path / "all")).returncode == 0
    assert _transcripts(tmp_path / "all") == want
    assert sorted(json.loads(l)["outputs"][0] for l in (tmp_path / "all" / "results.jsonl").read_text().splitlines()) \
        == ["../s1/talks/a.txt", "../s2/talks/b.txt"]
    p = run_cli("merge", "s1", "s2", "--out", "nested/all", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert _transcripts(tmp_path / "nested" / "all") == want
    p = run_cli("merge", "s1", "s2", "--out", "s1", cwd=tmp_path)  # s1's own lines keep their names
    assert p.returncode == 0, p.stderr
    assert _transcripts(s1) == want
    assert [json.loads(l)["outputs"] for l in (s1 / "results.jsonl").read_text().splitlines()] == [
        ["talks/a.txt"], ["../s2/talks/b.txt"]]
    s3 = _shard_log(tmp_path / "s3", ["c"])
    p = run_cli("merge", str(tmp_path / "nested" / "all"), str(s3), "--out", str(tmp_path / "x" / "y"))
    assert p.returncode == 0, p.stderr
    assert _transcripts(tmp_path / "x" / "y") == {**want, "c.wav": "c from s3\n"}


def test_merge_leaves_outputs_it_cannot_read_as_they_are(tmp_path):
    """A hand-edited line (`outputs` not a list, or holding a number) or one from before
    outputs were logged is merged as it is, not a traceback."""
    from transcribe.merging import rebased

    line = {"audio_filepath": "/a/x.wav", "status": "ok"}
    for outputs in ("x.txt", None, 3):
        assert rebased({**line, "outputs": outputs}, tmp_path / "s1", tmp_path / "all")["outputs"] == outputs
    assert rebased(line, tmp_path / "s1", tmp_path / "all") == line
    assert rebased({**line, "outputs": [1, "x.txt"]}, tmp_path / "s1", tmp_path / "all")["outputs"] == [
        1, "../s1/x.txt"]

def test_merge_into_a_folder_reached_through_a_link(tmp_path):
    """`..` in a path is followed from the folder's real place: a path climbing from the link's
    own place (`../s1/...` from `tmp/link`) would name `tmp/real/deep/s1`."""
    s1 = _shard_log(tmp_path / "s1", ["a"])
    (tmp_path / "real" / "deep" / "all").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep" / "all")
    p = run_cli("merge", str(s1), "--out", str(tmp_path / "link"))
    assert p.returncode == 0, p.stderr
    assert _transcripts(tmp_path / "link") == {"a.wav": "a from s1\n"}

@needs_shared
def test_shards_with_workers_merge_into_one_log(tmp_path):
    ref = Reference("tdt_tiny")
    files = [str(ref.audio_path(i)) for i in range(4)]
    for i in (1, 2):
        p = run_cli(*files, "--model", str(ref.nemo), "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2",
                    "--workers", str(i), "--format", "txt")
        assert p.returncode == 0, p.stderr
    # An array job with more tasks than files: the empty shard succeeds without loading the
    # model and leaves an empty log, so the merge of every shard's folder works.
    p = run_cli(*files, "--model", str(tmp_path / "never-loaded.nemo"), "--out", str(tmp_path / "s9"),
                "--shard", "9/9")
    assert p.returncode == 0 and "shard 9/9 has no files (4 files in 9 shards)" in p.stderr, p.stderr
    assert (tmp_path / "s9" / "results.jsonl").read_text() == ""
    p = run_cli("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), str(tmp_path / "s9"), "--out", str(tmp_path / "all"))
    assert p.returncode == 0, p.stderr
    rows = [json.loads(l) for l in (tmp_path / "all" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["audio_filepath"] for r in rows) == sorted(files)
    assert {r["text"] for r in rows} == {ref.files[i]["transcribe_text"] for i in range(4)}



@needs_shared
def test_a_run_into_a_merged_folder_writes_its_own_outputs_and_leaves_the_shards_alone(tmp_path):
    """A merged log lists transcripts in the shard folders (`../s2/x.txt`). A later run with
    --out at the merged folder takes none of them for its own: a file is done only when the
    outputs it would write are in its --out and listed, so it transcribes again there, and a
    shard's files are never rewritten, removed or listed as the run's own. With a shard's
    folder as the merge's --out, that shard's files are done and the others' are written
    there, over a stale file of the same name (another model's, say, from an earlier run into
    that folder), which the merged log's plain `x.txt` of shard 2 passed off as done."""
    ref = Reference("tdt_tiny")
    files = [str(ref.audio_path(i)) for i in range(4)]
    for i in (1, 2):
        p = run_cli(*files, "--model", str(ref.nemo), "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2",
                    "--format", "txt")
        assert p.returncode == 0, p.stderr
    s2_files = {q: (q.read_bytes(), q.stat().st_mtime_ns) for q in (tmp_path / "s2").glob("*.txt")}
    assert 0 < len(s2_files) < 4  # shards go by a hash of the name (inputs.shard): 1 of the 4 here
    stale = tmp_path / "s1" / next(iter(s2_files)).name
    stale.write_text("another model's words\n")

    def rerun(out: Path, formats: str) -> tuple[str, list[dict]]:
        assert run_cli("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(out)).returncode == 0
        p = run_cli(*files, "--model", str(ref.nemo), "--out", str(out), "--format", formats)
        assert p.returncode == 0, p.stderr
        rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
        for r in rows:  # every listed output is the run's own, in its --out, and holds its text
            assert [o for o in r["outputs"] if "/" in o] == []
            assert (out / r["outputs"][0]).read_text().strip() == r["text"]
        return p.stderr, rows

    stderr, rows = rerun(tmp_path / "all", "txt,json")
    assert "4 files transcribed, 0 failed, 0 already done" in stderr
    assert sorted(o for r in rows for o in r["outputs"]) == sorted(
        f"{Path(f).stem}.{ext}" for f in files for ext in ("txt", "json"))
    stderr, rows = rerun(tmp_path / "s1", "txt")
    assert f"{len(s2_files)} files transcribed, 0 failed, {4 - len(s2_files)} already done" in stderr
    assert stale.read_text() != "another model's words\n"
    assert {q: (q.read_bytes(), q.stat().st_mtime_ns) for q in (tmp_path / "s2").glob("*.txt")} == s2_files


def test_a_missing_optional_package_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """`--encoder-backend tensorrt` on a GPU machine without `tensorrt` raised the loader's
    ImportError as a traceback; it is "cannot load model: ..." with the extra to install, exit 1."""
    from engines import loader
    from engines.encoder_tensorrt_build import TensorRTUnavailable
    from transcribe.cli import main

    def load_engine(*args, **kwargs):
        raise TensorRTUnavailable("the TensorRT encoder needs the `tensorrt` package: pip install 'transcribe[tensorrt]'")

    monkeypatch.setattr(loader, "load_engine", load_engine)
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "a.wav"), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "cannot load model: the TensorRT encoder needs the `tensorrt` package" in err and "Traceback" not in err


def test_the_main_help_names_every_other_command():
    """`transcribe --help` is where a user looks first: it named only bench and models."""
    from transcribe.cli import sub_app

    names = [c.name or c.callback.__name__.replace("_", "-") for c in sub_app.registered_commands]
    assert {"bench", "merge", "models", "stream", "serve", "export-engine"} <= set(names)
    p = run_cli("--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert all(f"transcribe {n}" in text for n in names), (names, text)


def test_usage_lines_read_as_the_readme_and_every_option_says_what_it_does():
    """The usage lines said `{inputs}...` (typer's required-argument braces, the parameter's
    name); bench's --device and --batch-seconds and serve's --host and --port had no help."""
    import typer

    from transcribe.cli import main_app, sub_app

    for args, usage in ((["--help"], "Usage: transcribe [OPTIONS] INPUT..."),
                        (["bench", "--help"], "Usage: transcribe bench [OPTIONS] INPUT..."),
                        (["merge", "--help"], "Usage: transcribe merge [OPTIONS] SHARD_OUT_DIR..."),
                        (["stream", "--help"], "Usage: transcribe stream [OPTIONS] FILE")):
        p = run_cli(*args)
        assert p.returncode == 0 and usage in p.stdout and "{" not in p.stdout.split("\n", 3)[1], p.stdout
    commands = [typer.main.get_command(main_app)] + list(typer.main.get_command(sub_app).commands.values())
    undocumented = [f"{c.name} {p.opts[0]}" for c in commands for p in c.params if not p.help]
    assert not undocumented, undocumented


def test_python_dash_m_transcribe_is_the_command():
    """`python -m transcribe` said "'transcribe' is a package and cannot be directly executed"."""
    p = subprocess.run([sys.executable, "-m", "transcribe", "bench", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0 and "Usage: transcribe bench" in p.stdout, p.stderr


def test_a_shard_log_that_cannot_be_read_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A shard's results.jsonl without read permission (another user's shard) raised
    PermissionError out of merge as a traceback; it exits 1 naming the log, writing nothing."""
    import builtins

    from conftest import refusing_open
    from transcribe.cli import main

    for d in ("s1", "s2"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "results.jsonl").write_text(json.dumps({"audio_filepath": f"/{d}.wav", "status": "ok"}) + "\n")
    locked = tmp_path / "s2" / "results.jsonl"
    monkeypatch.setattr(builtins, "open", refusing_open(locked))
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "all")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"cannot read {locked}: Permission denied" in err and "Traceback" not in err
    assert not (tmp_path / "all" / "results.jsonl").exists()


@needs_shared
def test_a_manifest_line_fixed_since_leaves_no_failure_behind(tmp_path):
    """A broken manifest line fails under `MANIFEST:LINE`; once it was fixed (or deleted), no
    input had that name again, so its error line stayed in the log for good and `merge` of
    the folder exited 3 with every file transcribed."""
    audio = sorted((SPEECH / "librispeech_misc").glob("*.flac"))[:2]
    manifest = tmp_path / "m.jsonl"
    good = [json.dumps({"audio_filepath": str(a)}) for a in audio]
    manifest.write_text(f'{good[0]}\n{good[1][:-1]}\n')  # line 2 cut short
    args = (str(manifest), "--model", str(Reference("tdt_tiny").nemo), "--out", str(tmp_path / "out"))
    assert run_cli(*args).returncode == 3
    rows = lambda: [json.loads(l) for l in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["audio_filepath"] for r in rows() if r["status"] == "error"] == [f"{manifest}:2"]
    manifest.write_text("".join(line + "\n" for line in good))
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    assert sorted(r["audio_filepath"] for r in rows()) == sorted(map(str, audio))
    assert run_cli("merge", str(tmp_path / "out"), "--out", str(tmp_path / "merged")).returncode == 0
    manifest.write_text(f"{good[0]}\n{{\n")  # a line broken again, then deleted: nothing else to do
    assert run_cli(*args).returncode == 3 and len(rows()) == 3
    manifest.write_text(f"{good[0]}\n")
    p = run_cli(*args)
    assert p.returncode == 0 and "1 already done" in p.stderr, p.stderr
    assert sorted((r["audio_filepath"], r["status"]) for r in rows()) == sorted((str(a), "ok") for a in audio)


@needs_shared
def test_workers_are_never_more_than_the_files(tmp_path, monkeypatch):
    """`--workers 1000` on one file spawned 1000 processes importing torch (0.5 GB more a
    second, until the machine ran out): the workers, started while the model loads and in the
    job, number at most the files."""
    from typer.testing import CliRunner

    import transcribe.pipeline
    import transcribe.workers
    from transcribe.cli import main_app

    spawned, pools = [], []
    real_spares, real_pool = transcribe.workers.Prespawned, transcribe.pipeline.WorkerPool
    monkeypatch.setattr(transcribe.workers, "Prespawned", lambda n: (spawned.append(n), real_spares(n))[1])
    monkeypatch.setattr(transcribe.pipeline, "WorkerPool",
                        lambda frontend, slab, n, *a: (pools.append(n), real_pool(frontend, slab, n, *a))[1])
    audio = str(Reference("tdt_tiny").audio_path(0))
    done = CliRunner().invoke(main_app, [audio, "--model", str(Reference("tdt_tiny").nemo), "--out",
                                         str(tmp_path / "o"), "--workers", "1000", "--no-progress"])
    assert done.exit_code == 0, done.output
    assert spawned == [1] and pools == [1]


@needs_shared
def test_a_bad_model_from_the_environment_says_where_it_came_from(tmp_path, monkeypatch):
    """`TRANSCRIBE_MODEL=bogus` said "unknown model 'bogus'" and not that no --model was given."""
    audio = str(Reference("tdt_tiny").audio_path(0))
    monkeypatch.setenv("TRANSCRIBE_MODEL", str(tmp_path / "gone.nemo"))
    p = run_cli(audio, "--out", str(tmp_path / "o"))
    assert p.returncode == 1 and "cannot load model (from $TRANSCRIBE_MODEL):" in p.stderr, p.stderr
    p = run_cli(audio, "--out", str(tmp_path / "o"), "--model", str(tmp_path / "gone.nemo"))
    assert p.returncode == 1 and "cannot load model: " in p.stderr, p.stderr


_CTRL_C_IN_IMPORTS = """
import sys


class CtrlC:  # a ^C landing while the CLI's imports run
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            raise KeyboardInterrupt


sys.meta_path.insert(0, CtrlC())
from transcribe.__main__ import main
main()
"""


def test_a_ctrl_c_during_the_imports_ends_by_sigint_without_a_traceback():
    """The console script's target imports the CLI under a ^C guard: a ^C in its first tenth of
    a second printed twenty lines of KeyboardInterrupt traceback. It ends by SIGINT, as a ^C
    later does (a shell reads 130; transcribe/__main__.py says why)."""
    p = subprocess.run([sys.executable, "-c", _CTRL_C_IN_IMPORTS, "--help"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (-signal.SIGINT, "", "")


@needs_shared
def test_bench_refuses_an_out_holding_other_formats_and_leaves_its_log_alone(tmp_path):
    """bench writes txt only and redoes every file: into a transcribe folder with json/srt its
    new lines listed only the txt, so the next transcribe redid every file and merge named only
    the txt. Such an --out is a usage error, its log left as it was; one whose other formats
    are other files' is used, as is a txt-only one."""
    ref = Reference("tdt_tiny")
    audio, other = str(ref.audio_path(0)), str(ref.audio_path(1))
    out = tmp_path / "out"
    assert run_cli(audio, "--model", str(ref.nemo), "--out", str(out), "-f", "txt,srt").returncode == 0
    log = (out / "results.jsonl").read_bytes()
    p = run_cli("bench", audio, "--model", str(ref.nemo), "--out", str(out))
    assert p.returncode == 2 and "holds a transcribe run's .srt outputs" in p.stderr, p.stderr
    assert (out / "results.jsonl").read_bytes() == log
    assert run_cli("bench", other, "--model", str(ref.nemo), "--out", str(out)).returncode == 0
    assert run_cli(audio, "--model", str(ref.nemo), "--out", str(tmp_path / "txt"), "-f", "txt").returncode == 0
    assert run_cli("bench", audio, "--model", str(ref.nemo), "--out", str(tmp_path / "txt")).returncode == 0
