"""Writers: a registry of pure functions Result -> text, and the atomic file and log writes.

Every output file is written to a temporary name in the same folder and renamed into place,
so a kill never leaves a truncated transcript; `results.jsonl` is appended one complete,
flushed line per file, so a kill leaves only whole lines.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
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
    if result.language_probability is not None:  # detected (--language auto), not given
        doc["language_probability"] = round(result.language_probability, 4)
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def write_srt(result) -> str:
    blocks = [
        f"{i}\n{_clock(c.start, ',')} --> {_clock(c.end, ',')}\n" + "\n".join(map(_srt_text, c.lines)) + "\n"
        for i, c in enumerate(cues(result), 1)
    ]
    return "\n".join(blocks)


def _srt_text(line: str) -> str:
    """SubRip cue text: it has no escapes, and readers take a line holding `-->` for the next
    cue's times, so the arrow is written shorter."""
    return re.sub(r"-{2,}>", "->", line)  # "--->" too, which one replace left as "-->"


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
    """`txt,json` -> ["txt", "json"]; `all` (alone or in a list) -> every format; each once.
    Unknown names raise ValueError."""
    names = list(dict.fromkeys(s.strip().lower() for s in spec.split(",") if s.strip()))
    bad = [n for n in names if n not in WRITERS and n != "all"]
    if bad or not names:
        raise ValueError(f"--format {spec!r}: unknown format(s) {bad}; choose from {', '.join(WRITERS)} or all")
    return list(WRITERS) if "all" in names else names


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Write errors that every later write would hit too: they stop a run instead of failing files.
STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})

TEMP_MARK = "transcribe-"  # in every temporary output's name: .NAME.transcribe-XXXXXXXX.tmp
# mkstemp creates its files 0600; outputs get the mode a plain open() would give them.
FILE_MODE = 0o666 & ~_umask()  # read once, at import (os.umask can only be read by setting it)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` so that readers see the old file or the new one, never a part."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text needs str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


def open_lock(path: Path) -> tuple[int, bool]:
    """A descriptor of the lock file `path` to flock, created if missing, and whether it is
    writable: a lock file this user cannot write (another user's in a shared folder, left 0644
    by their umask) is opened read-only, which flock needs no more than. One that cannot be
    opened at all (a folder in its place) raises OSError."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        return os.open(path, os.O_RDONLY), False


def atomic_write_bytes(path: Path, data) -> None:
    """Write `data` (bytes or any buffer, e.g. TensorRT's IHostMemory) so that readers see the
    old file or the whole new one, never a part: temp file in the same folder, fsync, rename."""
    writes = StagedWrites()
    writes.stage(path, data)
    for error in writes.commit().values():
        raise error


class StagedWrites:
    """Files written together, each atomically: `stage()` writes one to a temporary name in its
    folder; `commit()` fsyncs them all, then renames them all into place, so each is the old
    file or the whole new one, never a part, and is on disk before its name points to it.

    Together because writing file after file, each fsynced before the next is created, was the
    slow part of many short files: in a profile of 5,000 one-second files the fsyncs took 1.9 s
    and the creates 1.2 s of the 4.0 s spent writing. Staged a batch at a time (with the log
    fsynced once per batch, `ResultsLog.sync`), the write stage took 5.4-5.8 s against
    8.4-9.0 s one at a time on the same disk, three interleaved runs. (Our guess at why: the
    fsyncs of files created in one ext4 journal transaction share its commit.)

    `key` names the files of one input: `commit()` returns the error of each key that failed
    (a key whose fsync failed has none of its files renamed; a rename that fails leaves those
    renamed before it), and raises a write error that every later write would hit too (full,
    over quota, read-only disk) after removing every temporary file."""

    def __init__(self):
        self._staged: list[tuple[str, Path, object]] = []  # (temporary, final path, key)

    def stage(self, path: Path, data, key: object = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temporary name starts with at most 32 characters of the final one: the whole name
        # plus mkstemp's 14 would pass the 255-byte limit for a final name that fits it.
        # `TEMP_MARK` tells ours apart, so the startup sweep deletes no one else's temp file.
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:32]}.{TEMP_MARK}", suffix=".tmp", dir=path.parent)
        except OSError as e:
            raise naming_output(e, path)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), FILE_MODE)
                f.write(memoryview(data))
        except BaseException as e:
            # Any failure (disk full, ^C, SIGTERM) removes the temporary file; the old one stays intact.
            Path(tmp).unlink(missing_ok=True)
            raise naming_output(e, path) if isinstance(e, OSError) else e
        self._staged.append((tmp, path, key))

    def drop(self, key: object) -> None:
        """Remove the staged files of `key` (one of its outputs could not be staged)."""
        for tmp, _, k in self._staged:
            if k == key:
                Path(tmp).unlink(missing_ok=True)
        self._staged = [s for s in self._staged if s[2] != key]

    def commit(self) -> dict[object, OSError]:
        failed: dict[object, OSError] = {}
        try:
            for tmp, path, key in self._staged:
                if key not in failed:
                    failed.update(_fsync_path(tmp, path, key))
            for tmp, path, key in self._staged:
                if key not in failed:
                    try:
                        os.replace(tmp, path)
                    except OSError as e:
                        failed[key] = naming_output(e, path)
        finally:
            # Whatever is left (a failed key's files; everything, if an error stopped it)
            # is removed: the old files stay intact.
            for tmp, _, _ in self._staged:
                Path(tmp).unlink(missing_ok=True)
            self._staged = []
        for error in failed.values():
            if error.errno in STOP_ERRNOS:
                raise error
        return failed


def _fsync_path(tmp: str, path: Path, key: object) -> dict[object, OSError]:
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return {key: naming_output(e, path)}
    return {}


def naming_output(e: OSError, path: Path) -> OSError:
    """`e` naming the output it was for: "Is a directory: OUT/a.txt", not the temporary
    `.a.txt.transcribe-6o5pjpaj.tmp` the user never sees."""
    e.filename, e.filename2 = str(path), None
    return e


def output_paths(out_stem: Path, formats: list[str]) -> dict[str, Path]:
    """Format -> the file it is written to: `out_stem` + `.txt`, `.json`, ..."""
    return {fmt: out_stem.with_name(out_stem.name + "." + fmt) for fmt in formats}


def write_outputs(result, out_stem: Path, formats: list[str], writes: StagedWrites | None = None) -> None:
    """Write one file's transcript in each format (`output_paths`): at once, or staged in
    `writes` under the key `out_stem` until its `commit()`."""
    for fmt, path in output_paths(out_stem, formats).items():
        if writes is None:
            atomic_write_text(path, WRITERS[fmt](result))
        else:
            writes.stage(path, WRITERS[fmt](result).encode("utf-8"), key=out_stem)


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
    """`results.jsonl`, appended one complete line per file and flushed at once: in the file
    for every reader, and past a kill of this process. `sync()` makes the lines since the last
    one durable past a crash of the machine too; the pipeline calls it once per batch rather
    than per line (an fsync per line was 0.14 ms, a fifth of a short file's writing). A line
    appended after its file's outputs were fsynced and renamed can never be durable before
    them, so a crash loses at most the last lines, whose files the next run redoes (unless an
    old line by the same model and settings vouches for them: `resume.plan_resume`)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(path)
        self._f = open(path, "a", encoding="utf-8")
        self._unsynced = False

    def append(self, record: dict) -> None:
        self._f.write(results_line(record))
        self._f.flush()
        self._unsynced = True

    def sync(self) -> None:
        """fsync the lines since the last sync; FileNotFoundError when the log is no longer at
        its path (removed, or the whole --out with it, or replaced by another file): lines
        appended to an unlinked file are lost when it closes, and the run would end with exit 0,
        its work in no log (a rerun redoes all), and a second run free to take the folder."""
        if self._unsynced:
            os.fsync(self._f.fileno())
            self._unsynced = False
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            there = None
        if there is None or not os.path.samestat(there, os.fstat(self._f.fileno())):
            raise FileNotFoundError(errno.ENOENT, "removed or replaced while the run wrote to it", str(self.path))

    def close(self) -> None:
        """Sync and close; a sync that fails here leaves the lines to the kernel's writeback.
        A line a full disk did not take (its append already stopped the run) is dropped on
        close rather than raised again over the run's own message: its file has no line and is
        done again next time (a partial line is repaired when the log is next opened)."""
        try:
            self.sync()
        except OSError:
            pass
        try:
            self._f.close()
        except OSError:
            pass

    def __enter__(self) -> "ResultsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _repair_tail(path: Path) -> None:
    """Drop a trailing partial line (a kill mid-write on a filesystem without atomic appends).
    A whole record that lacks only its newline (a log rewritten by a script's "\\n".join, or an
    editor) gets the newline instead: cutting it lost that file's line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        last = data.rfind(b"\n") + 1  # where the last line starts
        if isinstance(_record(data[last:]), dict):
            f.write(b"\n")
        else:
            f.truncate(last)


def _record(raw: bytes):
    """A log line parsed, None if it is not JSON (or not UTF-8)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        return None


def read_results(path: Path, notes: bool = True) -> list[dict]:
    """Every complete record of a results.jsonl (a missing file has none); `notes`: say which
    lines are not records (a reader that only looks first says nothing, so the note comes once)."""
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # a blank line
            record = _record(raw)
            if not raw.endswith(b"\n") and not isinstance(record, dict):
                continue  # a last line a killed run left half written (a whole one only lost its newline)
            if not (isinstance(record, dict) and isinstance(record.get("audio_filepath"), str)
                    and _is_offset(record.get("offset"))):
                # Edited by hand or damaged on disk: a note, and its file, with no line that
                # says it is done, is done again.
                if notes:
                    print(f"note: {path}:{lineno}: not a results record, skipped", file=sys.stderr)
                continue
            out.append(record)
    return out


def _is_offset(value) -> bool:
    """A record's `offset`: none, or seconds (a number: `inputs.record_key` keys segments by it)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
