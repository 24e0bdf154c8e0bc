"""`transcribe merge`: shard runs' results.jsonl joined into one log.

A line's `outputs` are paths relative to the folder of the log that holds it (`resume.plan_resume`
reads them so, and so does anyone looking for a file's transcripts). A shard's are relative to
its own --out; the merged log is in another folder, so each is rewritten relative to that one
(`../shard1/talks/a.txt`): the transcripts stay where their shard wrote them, and every path in
every log, merged or not, and merged again, names the file from where the log is.
"""
from __future__ import annotations

import os
from pathlib import Path

from transcribe.resume import latest
from transcribe.writers import read_results


def merged_records(log_dirs: list[Path], out: Path) -> list[dict]:
    """The lines of every `log_dirs`/results.jsonl for a log in `out`: one per file (a segment
    of a file is its own), an ok line over an error line, else the last (each log's own last line
    of a file first, `resume.latest`: a shard stopped mid-run may hold two); `outputs` rebased
    (`rebased`)."""
    merged: dict[Path, dict] = {}
    # Both folders resolved (once per log, not per line): a `..` in the new paths is followed
    # from `out`'s real location, so a lexical relpath from an `out` reached through a link
    # would climb out of the wrong folder.
    dst = out.resolve()
    for d in log_dirs:
        src = d.resolve()
        for key, r in latest(read_results(d / "results.jsonl")).items():  # a shard stopped mid-run may hold a file twice
            old = merged.get(key)
            if old is None or not (old.get("status") == "ok" and r.get("status") != "ok"):
                merged[key] = rebased(r, src, dst)
    return list(merged.values())


def rebased(record: dict, src: Path, dst: Path) -> dict:
    """`record` from the log in the resolved folder `src`, its `outputs` made relative to the
    resolved folder `dst`. A path that is not a string (a hand-edited line) is left as it is,
    as is a line without `outputs` (from before they were logged: its files are not known)."""
    outputs = record.get("outputs")
    if not isinstance(outputs, list) or src == dst:
        return record
    return {**record, "outputs": [Path(os.path.relpath(src / p, dst)).as_posix() if isinstance(p, str) else p
                                  for p in outputs]}
