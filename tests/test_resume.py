"""`plan_resume`: which files a rerun skips, by the log's lines and the outputs they name."""
from __future__ import annotations

import json
from pathlib import Path

from transcribe.inputs import InputFile
from transcribe.resume import file_identity, plan_resume


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
    todo, done, _ = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert [f.path.stem for f in todo] == ["unnamed"] and done == 2
    (out / "named.json").unlink()  # named, but gone
    todo, done, _ = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
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
