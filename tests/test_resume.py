"""`plan_resume`: which files a rerun skips, by the log's lines and the outputs they name; `all_done`:
whether a rerun needs the model at all."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from transcribe.inputs import InputFile
from transcribe.resume import all_done, file_identity, out_dir_lock, plan_resume


def _inputs(tmp_path, names):
    """Audio files `names` (.flac), an out folder with a .txt for each, their identities, and
    `line(name, model="m", **more)`: an ok results.jsonl record for one of them."""
    audio = {name: tmp_path / f"{name}.flac" for name in names}
    for p in audio.values():
        p.write_bytes(b"x")
    out = tmp_path / "out"
    out.mkdir()
    for name in audio:
        (out / f"{name}.txt").write_text("t")
    ident = {p: file_identity(p) for p in audio.values()}
    line = lambda name, model="m", **more: {"audio_filepath": str(audio[name]), "status": "ok", "model": model,
                                            **ident[audio[name]], **more}
    return audio, out, ident, line


def _same_names(tmp_path, name: str, text: str):
    """Two audio files `name`, in folders A/ and B/ (a, b: different sizes), an out folder whose
    `a.txt` holds `text`, and their identities."""
    out = tmp_path / "out"
    out.mkdir()
    a, b = tmp_path / "A" / name, tmp_path / "B" / name
    for p, data in ((a, b"x"), (b, b"yy")):
        p.parent.mkdir()
        p.write_bytes(data)
    (out / "a.txt").write_text(text)
    return a, b, out, {p: file_identity(p) for p in (a, b)}


def test_a_line_vouches_for_the_outputs_it_names_and_old_lines_for_any_that_exist(tmp_path):
    audio, out, ident, line = _inputs(tmp_path, ("old", "named", "unnamed"))
    for name in audio:
        (out / f"{name}.json").write_text("{}")  # all exist: only what the lines say differs
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        line("old"),  # logged before lines named their outputs
        line("named", outputs=["named.txt", "named.json"]),
        line("unnamed", outputs=["unnamed.txt"]))))  # its json is another run's
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    outputs = lambda f: [Path(f.path.stem + ".txt"), Path(f.path.stem + ".json")]
    todo, done, *_ = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert [f.path.stem for f in todo] == ["unnamed"] and done == 2
    (out / "named.json").unlink()  # named, but gone
    todo, done, *_ = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert sorted(f.path.stem for f in todo) == ["named", "unnamed"] and done == 1


def test_a_redone_file_keeps_the_formats_its_line_listed_when_audio_model_and_settings_match(tmp_path):
    audio, out, ident, line = _inputs(tmp_path, ("same", "other_model", "changed", "gone", "clash"))
    (out / "same.srt").write_text("s")  # gone.srt, listed below, is not there
    log = "".join(json.dumps(r) + "\n" for r in (
        line("same", outputs=["same.txt", "same.srt"]),
        line("other_model", model="n", outputs=["other_model.txt"]),  # another model's text
        {**line("changed", outputs=["changed.txt"]), "size": 2},  # the audio changed since
        line("gone", outputs=["gone.txt", "gone.srt"]),  # its srt was deleted
        line("clash", outputs=["clash.txt"])))  # this run names the file clash_1
    (out / "results.jsonl").write_text(log)
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    stem = lambda f: "clash_1" if f.path.stem == "clash" else f.path.stem
    plan = plan_resume(files, out / "results.jsonl", False, ident, model="m",
                       outputs=lambda f: [Path(stem(f) + ".json")],
                       names=lambda f: [Path(stem(f) + e) for e in (".txt", ".json", ".srt", ".vtt")])
    assert len(plan.todo) == 5 and plan.skipped == 0
    assert plan.kept == {audio["same"]: ["same.txt", "same.srt"], audio["gone"]: ["gone.txt"]}
    (out / "results.jsonl").write_text(log)  # --force trusts nothing earlier
    assert plan_resume(files, out / "results.jsonl", True, ident, model="m",
                       outputs=lambda f: [Path(stem(f) + ".json")],
                       names=lambda f: [Path(stem(f) + ".txt")]).kept == {}


def test_an_output_another_file_took_since_is_no_longer_the_first_files(tmp_path):
    """Two input folders into one --out, each with an `a.wav`: the second run writes `a.txt`
    over the first's, and its line lists it after the first's. A rerun of the first folder took
    `a.txt` for its own (it exists, its line lists it) and skipped the file, the transcript being
    the other file's. The last line listing an output owns it: the first file is done again,
    and a file redone for another format does not keep listing what another file wrote."""
    a, b, out, ident = _same_names(tmp_path, "a.wav", "b's text")
    (out / "a.srt").write_text("a's subtitles")
    line = lambda p, outputs: {"audio_filepath": str(p), "status": "ok", "model": "m", **ident[p], "outputs": outputs}
    log = "".join(json.dumps(r) + "\n" for r in (line(a, ["a.txt", "a.srt"]), line(b, ["a.txt"])))
    (out / "results.jsonl").write_text(log)
    names = lambda f: [Path("a" + e) for e in (".txt", ".json", ".srt", ".vtt")]
    for p in (a, b):
        todo, done, *_ = plan_resume([InputFile(p, Path("a.wav"))], out / "results.jsonl", False, ident, model="m",
                                    outputs=lambda f: [Path("a.txt")], names=names)
        assert (len(todo), done) == ((1, 0) if p == a else (0, 1)), p
        (out / "results.jsonl").write_text(log)
    plan = plan_resume([InputFile(a, Path("a.wav"))], out / "results.jsonl", False, ident, model="m",
                       outputs=lambda f: [Path("a.json")], names=names)
    assert plan.kept == {a: ["a.srt"]}


def test_all_done_is_plan_resumes_test_reading_only_and_false_while_a_run_writes(tmp_path):
    """`all_done` lets a rerun end before any model loads: true only when the plan would skip
    every file (same audio, model, settings, outputs), never while another run holds the folder,
    and it rewrites nothing (the plan drops the lines of files it redoes; a look must not)."""
    audio, out, ident, line = _inputs(tmp_path, ("a", "b"))
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    log = out / "results.jsonl"
    assert not all_done(files, out, ["txt"], "m", {})  # no log yet
    lines = [line(n, settings={"language": "en"}, outputs=[f"{n}.txt"]) for n in audio]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert all_done(files, out, ["txt"], "m", {"language": "en"})
    assert not all_done(files, out, ["txt"], "n", {"language": "en"})  # another model
    assert not all_done(files, out, ["txt"], "m", {"language": "de"})  # other settings
    assert not all_done(files, out, ["txt", "srt"], "m", {"language": "en"})  # an output not written
    (tmp_path / "new.flac").write_bytes(b"x")  # a file with no line yet
    assert not all_done([*files, InputFile(tmp_path / "new.flac", Path("new.flac"))], out, ["txt"], "m",
                        {"language": "en"})
    with out_dir_lock(out):  # a run writing there now
        assert not all_done(files, out, ["txt"], "m", {"language": "en"})
    assert all_done(files, out, ["txt"], "m", {"language": "en"})  # and the kernel let go of it
    broken = [lines[0], {**lines[1], "status": "error"}]
    log.write_text(text := "".join(json.dumps(r) + "\n" for r in broken))
    assert not all_done(files, out, ["txt"], "m", {"language": "en"})
    assert log.read_text() == text  # read only: the failed file's line stays for the run to redo
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    audio["b"].write_bytes(b"changed")  # the audio changed since its line
    assert not all_done(files, out, ["txt"], "m", {"language": "en"})


def test_settings_known_before_the_load_are_the_loaded_engines(tmp_path):
    """What `settings_before_load` says without reading a model is what the engine `load_engine`
    makes reports (a mismatch would skip files another language or task must redo), and it
    says nothing where only the model knows."""
    from conftest import NEMO_REF
    from engines.loader import checked_model, load_engine, settings_before_load
    from engines.whisper_weights import WhisperWeightsError, bundled_base_dir

    nemo = NEMO_REF / "tdt_tiny" / "model.nemo"
    if not nemo.is_file():
        pytest.skip(f"shared fixtures not found at {NEMO_REF}")
    assert settings_before_load(checked_model(str(nemo))) == load_engine(str(nemo)).settings == {}
    try:
        bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    for language, task in ((None, "transcribe"), ("auto", "translate"), ("German", "transcribe")):
        engine = load_engine("whisper-base", language=language, task=task)
        assert settings_before_load("whisper-base", language, task) == engine.settings, (language, task)
    assert settings_before_load("whisper-base", prompt="Kennedy") is None  # cut by tokens
    assert settings_before_load("whisper-base.en") == {} and settings_before_load("whisper-base.en", "de") is None
    (tmp_path / "w.pt").write_bytes(b"x")
    assert settings_before_load(str(tmp_path / "w.pt")) is None  # multilingual or not: its vocabulary says
    assert settings_before_load(str(tmp_path / "gone.nemo")) is None  # its load says what is wrong


def _refusing_writes_to(monkeypatch, *refused: Path) -> None:
    """os.open that refuses to open `refused` for writing, as for a file another user owns with
    mode 0644 (tests may run as root, whom a chmod does not stop); reading still opens it."""
    import os

    real = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path) in {str(p) for p in refused} and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_a_lock_file_this_user_cannot_write_still_locks_the_folder(tmp_path, monkeypatch):
    """Another user's lock file in a shared folder (0644 by their umask) was a traceback: flock
    needs only a read descriptor, so the run locks through one, and a second run is still
    refused while the first holds it."""
    from transcribe.resume import LOCK_NAME, OutputBusy

    (tmp_path / LOCK_NAME).write_text("")
    _refusing_writes_to(monkeypatch, tmp_path / LOCK_NAME)
    with out_dir_lock(tmp_path):
        with pytest.raises(OutputBusy):
            with out_dir_lock(tmp_path):
                pass
    with out_dir_lock(tmp_path):  # released with the first
        pass


def test_an_out_whose_log_cannot_be_appended_to_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A results.jsonl this user cannot write (another user's, in a shared --out) was a
    traceback from the log's tail repair after the model had loaded: exit 1 naming it, first."""
    import typer

    from transcribe.cli_options import out_folder

    log = tmp_path / "results.jsonl"
    log.write_text(json.dumps({"audio_filepath": "/a.wav", "status": "ok"}) + "\n")
    out_folder(tmp_path)  # writable: passes
    _refusing_writes_to(monkeypatch, log)
    with pytest.raises(typer.Exit) as exit_:
        out_folder(tmp_path)
    assert exit_.value.exit_code == 1
    assert f"{log} cannot be written (Permission denied)" in capsys.readouterr().err
    assert json.loads(log.read_text())["audio_filepath"] == "/a.wav"


def test_a_files_last_line_counts_and_the_end_of_a_run_drops_the_ones_before(tmp_path):
    """A run keeps a redone file's old line by the same model until it ends; a kill leaves both.
    The last line is the file's: an earlier one by another model, whose outputs the later run
    wrote over, must not make it done for that model."""
    from transcribe.merging import merged_records
    from transcribe.resume import drop_replaced

    audio, out, ident, line = _inputs(tmp_path, ("a", "b"))
    log = out / "results.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in (
        line("a", model="m", outputs=["a.txt"]), line("b", outputs=["b.txt"]),
        line("a", model="n", outputs=["a.txt"])))  # a redone by model n, a kill before the run's end
    log.write_text(text)
    assert [r["model"] for r in merged_records([out], tmp_path / "merged")] == ["m", "n"]  # b's, then a's last
    drop_replaced(log)
    assert [(Path(r["audio_filepath"]).stem, r["model"]) for r in map(json.loads, log.read_text().splitlines())] == [
        ("b", "m"), ("a", "n")]
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    txt = lambda f: [Path(f.path.stem + ".txt")]
    for model, todo in (("m", ["a"]), ("n", ["b"])):
        log.write_text(text)
        plan = plan_resume(files, log, False, ident, model=model, outputs=txt)
        assert [f.path.stem for f in plan.todo] == todo, model
        assert plan.tidy and log.read_text() == text  # dropped at the run's end, not before (below)
        assert plan.superseded == {audio[todo[0]]: [f"{todo[0]}.txt"]}, model  # the other model's line


def test_lines_that_would_vouch_for_rewritten_outputs_are_superseded_not_dropped(tmp_path):
    """A line by another model would vouch for the outputs the run rewrites if it stopped
    between writing them and logging their new lines: the plan names those files
    (`superseded`, with the outputs their lines list) for the run to give an error line just
    before it writes. Planning leaves the log as it is: it used to drop those lines up front,
    and a run stopped before it wrote anything lost the log of the finished job. --force's go
    up front: it redoes every file, and stopped early, the rerun must redo the rest."""
    audio, out, ident, line = _inputs(tmp_path, ("a", "b"))
    log = out / "results.jsonl"
    text = "".join(json.dumps(line(n, outputs=[f"{n}.txt"])) + "\n" for n in audio)
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    txt = lambda f: [Path(f.path.stem + ".txt")]
    srt = lambda f: [Path(f.path.stem + ".txt"), Path(f.path.stem + ".srt")]
    every = {p: [f"{p.stem}.txt"] for p in audio.values()}
    for force, model, outputs, superseded, left in ((True, "m", txt, {}, ""), (True, "n", txt, {}, ""),
                                                    (False, "n", txt, every, text), (False, "m", srt, {}, text)):
        log.write_text(text)
        plan = plan_resume(files, log, force, ident, model=model, outputs=outputs)
        assert len(plan.todo) == 2 and plan.tidy == bool(left) and plan.superseded == superseded, (force, model)
        assert log.read_text() == left, (force, model)


def test_outputs_that_are_not_a_list_of_paths_vouch_for_nothing(tmp_path):
    """A hand-edited `"outputs": 5` made every later run of the folder a TypeError before the
    model loaded; a string was searched for substrings ("a.txt" in "xa.txt.bak")."""
    audio, out, ident, line = _inputs(tmp_path, ("five", "text", "mixed"))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        line("five", outputs=5), line("text", outputs="xtext.txt.bak"), line("mixed", outputs=[7, "mixed.txt"]))))
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    txt = lambda f: [Path(f.path.stem + ".txt")]
    plan = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=txt, names=txt)
    assert [f.path.stem for f in plan.todo] == ["five", "text"] and plan.skipped == 1
    assert not all_done(files, out, ["txt"], "m", {})


def test_an_output_a_superseded_line_owned_is_no_other_files_again(tmp_path):
    """`b/a.flac` then `a/a.flac` into one --out: `a.txt` is a's. A run over `a/` with another
    model gives a an error line before it writes, which must go on listing `a.txt` (and what
    a's line listed besides): without it, the earlier line of b owned `a.txt` again, and the
    next run over `b/` took the other model's transcript of a for b's."""
    from transcribe.output_writer import OutputStopped, OutputWriter
    from transcribe.pipeline import RunStats
    from transcribe.results import Result
    from transcribe.writers import ResultsLog, StagedWrites

    a, b, out, ident = _same_names(tmp_path, "a.flac", "a's text")
    log = out / "results.jsonl"
    log.write_text("".join(json.dumps({"audio_filepath": str(p), "status": "ok", "model": "m", **ident[p],
                                       "outputs": ["a.txt", "a.json"]}) + "\n" for p in (b, a)))
    txt = lambda f: [Path("a.txt")]
    fa = InputFile(a, Path("a.flac"))
    plan = plan_resume([fa], log, False, ident, model="n", outputs=txt)
    assert plan.superseded == {a: ["a.txt", "a.json"]}

    class Bar:
        def step(self):
            pass

    def stopped(self):  # a kill after the error line, before the renames
        raise OSError(5, "Input/output error")

    real_commit, StagedWrites.commit = StagedWrites.commit, stopped
    try:
        with ResultsLog(log) as results:
            writer = OutputWriter(out, ["txt"], {a: Path("a")}, results, "n", {}, RunStats(), Bar(), ident,
                                  superseded=plan.superseded)
            writer.finished(fa, Result("n's text"), 1.0)
            writer.flush()
            with pytest.raises(OutputStopped):
                writer.close()
    finally:
        StagedWrites.commit = real_commit
    last = json.loads(log.read_text().splitlines()[-1])
    assert (last["audio_filepath"], last["status"], last["model"], last["outputs"]) == (str(a), "error", "n",
                                                                                       ["a.txt", "a.json"])
    assert "stopped while n transcribed it again" in last["error"]
    for f, model in ((fa, "m"), (fa, "n"), (InputFile(b, Path("a.flac")), "m")):
        plan = plan_resume([f], log, False, ident, model=model, outputs=txt)
        assert [g.path for g in plan.todo] == [f.path], (f.path, model)


def test_a_file_read_past_its_lone_offset_0_lines_duration_is_done_again(tmp_path):
    """A lone `offset: 0` line is read to its `duration` (`InputFile.cap`); a line that
    transcribed more of the file (read whole before caps were read, or under a longer cap) kept
    that transcript as done, the wrong one the cap exists to fix."""
    audio, out, ident, line = _inputs(tmp_path, ("whole", "capped", "short"))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        line("whole", duration=71.665, outputs=["whole.txt"]),
        line("capped", duration=15.0, outputs=["capped.txt"]),
        line("short", duration=9.5, outputs=["short.txt"]))))  # a file shorter than its cap
    files = [InputFile(audio["whole"], Path("whole.flac"), cap=15.0),
             InputFile(audio["capped"], Path("capped.flac"), cap=15.0),
             InputFile(audio["short"], Path("short.flac"), cap=15.0)]
    outputs = lambda f: [Path(f.path.stem + ".txt")]
    todo, done, *_ = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert [f.path.stem for f in todo] == ["whole"] and done == 2


def test_an_emptied_transcript_of_a_file_that_said_something_is_made_again(tmp_path):
    """Our writes are atomic, so an empty output under a line with text was emptied since (a
    copy cut short, `> a.txt`): it stayed done for good, and only --force (every file) made it
    again. A line whose text is empty (silence) vouches for its empty transcript."""
    audio, out, ident, line = _inputs(tmp_path, ("said", "silent", "kept"))
    (out / "said.txt").write_text("")
    (out / "silent.txt").write_text("")
    log = out / "results.jsonl"
    log.write_text("".join(json.dumps(line(n, text=t, outputs=[f"{n}.txt"])) + "\n"
                           for n, t in (("said", "hello"), ("silent", ""), ("kept", "hi"))))
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    txt = lambda f: [Path(f.path.stem + ".txt")]
    plan = plan_resume(files, log, False, ident, model="m", outputs=txt, names=txt)
    assert [f.path.stem for f in plan.todo] == ["said"] and plan.skipped == 2
    assert not all_done(files, out, ["txt"], "m", {})
    (out / "said.txt").write_text("hello\n")
    assert all_done(files, out, ["txt"], "m", {})
