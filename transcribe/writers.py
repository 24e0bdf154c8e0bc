"""Writers: a registry of pure functions Result -> text, and the atomic file and log writes.

Every output file is written to a temporary name in the same folder and renamed into place,
so a kill never leaves a truncated transcript; `results.jsonl` is appended one complete,
flushed line per file, so a kill leaves only whole lines.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from transcribe.subtitles import cues


def _clock(seconds: float, sep: str) -> str:
    """HH:MM:SS,mmm (srt, sep=',') or HH:MM:SS.mmm (vtt, sep='.')."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def write_txt(result) -> str:
    return result.text.strip() + "\n"


def write_json(result) -> str:
    doc = {
        "text": result.text,
        "segments": [{"text": s.text, "start": round(s.start, 3), "end": round(s.end, 3)} for s in result.segments],
        "words": [w.to_json() for w in result.words],
    }
    if result.language is not None:
        doc["language"] = result.language
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def write_srt(result) -> str:
    blocks = [
        f"{i}\n{_clock(c.start, ',')} --> {_clock(c.end, ',')}\n" + "\n".join(c.lines) + "\n"
        for i, c in enumerate(cues(result), 1)
    ]
    return "\n".join(blocks)


def _vtt_text(line: str) -> str:
    """WebVTT cue text: `&` and `<` start escapes and tags there ("AT&T", "x < y"), and `>`
    is escaped too, so no line holds the `-->` that would end the cue's payload."""
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_vtt(result) -> str:
    blocks = [f"{_clock(c.start, '.')} --> {_clock(c.end, '.')}\n" + "\n".join(map(_vtt_text, c.lines)) + "\n"
              for c in cues(result)]
    return "WEBVTT\n\n" + "\n".join(blocks)


WRITERS: dict[str, Callable[[object], str]] = {
    "txt": write_txt,
    "json": write_json,
    "srt": write_srt,
    "vtt": write_vtt,
}


def needs_words(formats: list[str]) -> bool:
    """Whether these outputs use word times (json lists them; srt and vtt cut long segments
    into cues on them), so a model that computes them on request (Whisper) should."""
    return bool({"json", "srt", "vtt"} & set(formats))


def parse_formats(spec: str) -> list[str]:
    """`txt,json` -> ["txt", "json"]; `all` -> every format. Unknown names raise ValueError."""
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(WRITERS)
    bad = [n for n in names if n not in WRITERS]
    if bad or not names:
        raise ValueError(f"--format {spec!r}: unknown format(s) {bad}; choose from {', '.join(WRITERS)} or all")
    return names


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates its files 0600; outputs get the mode a plain open() would give them.
FILE_MODE = 0o666 & ~_umask()  # read once, at import (os.umask can only be read by setting it)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` so that readers see the old file or the new one, never a part."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text needs str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data) -> None:
    """Write `data` (bytes or any buffer, e.g. TensorRT's IHostMemory) so that readers see the
    old file or the whole new one, never a part: temp file in the same folder, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name starts with at most 32 characters of the final one: the whole name
    # plus mkstemp's 14 would pass the 255-byte limit for a final name that fits it.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:32]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Any failure (disk full, ^C, SIGTERM) removes the temporary file; the old one stays intact.
        Path(tmp).unlink(missing_ok=True)
        raise


def output_paths(out_stem: Path, formats: list[str]) -> dict[str, Path]:
    """Format -> the file it is written to: `out_stem` + `.txt`, `.json`, ..."""
    return {fmt: out_stem.with_name(out_stem.name + "." + fmt) for fmt in formats}


def write_outputs(result, out_stem: Path, formats: list[str]) -> None:
    """Write one file's transcript in each format (`output_paths`)."""
    for fmt, path in output_paths(out_stem, formats).items():
        atomic_write_text(path, WRITERS[fmt](result))


def results_line(record: dict) -> str:
    """One results.jsonl line. UTF-8 text as is; a record holding a file name that is not valid
    UTF-8 (Python keeps its bytes as lone surrogates, os.fsdecode) is written with \\u escapes,
    so the log stays valid UTF-8 JSON and reading it back gives the same name."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record)
    return line + "\n"


class ResultsLog:
    """`results.jsonl`, appended one complete line per file and flushed at once."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(path)
        self._f = open(path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self._f.write(results_line(record))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ResultsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _repair_tail(path: Path) -> None:
    """Drop a trailing partial line (a kill mid-write on a filesystem without atomic appends)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def read_results(path: Path) -> list[dict]:
    """Every complete record of a results.jsonl (a missing file has none)."""
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                out.append(json.loads(line))
    return out
