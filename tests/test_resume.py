"""`plan_resume`: which files a rerun skips, by the log's lines and the outputs they name."""
from __future__ import annotations

import json
from pathlib import Path

from transcribe.inputs import InputFile
from transcribe.resume import file_identity, plan_resume


def test_a_line_vouches_for_the_outputs_it_names_and_old_lines_for_any_that_exist(tmp_path):
    audio = {name: tmp_path / f"{name}.flac" for name in ("old", "named", "unnamed")}
    for p in audio.values():
        p.write_bytes(b"x")
    out = tmp_path / "out"
    out.mkdir()
    for name in audio:
        (out / f"{name}.txt").write_text("t")
        (out / f"{name}.json").write_text("{}")  # all exist: only what the lines say differs
    ident = {p: file_identity(p) for p in audio.values()}
    line = lambda name, **more: {"audio_filepath": str(audio[name]), "status": "ok", "model": "m",
                                 **ident[audio[name]], **more}
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        line("old"),  # logged before lines named their outputs
        line("named", outputs=["named.txt", "named.json"]),
        line("unnamed", outputs=["unnamed.txt"]))))  # its json is another run's
    files = [InputFile(p, Path(p.name)) for p in audio.values()]
    outputs = lambda f: [Path(f.path.stem + ".txt"), Path(f.path.stem + ".json")]
    todo, done = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert [f.path.stem for f in todo] == ["unnamed"] and done == 2
    (out / "named.json").unlink()  # named, but gone
    todo, done = plan_resume(files, out / "results.jsonl", False, ident, model="m", outputs=outputs)
    assert sorted(f.path.stem for f in todo) == ["named", "unnamed"] and done == 1
