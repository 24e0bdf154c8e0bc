"""Resume state in `--out`: which files are done, and what a killed run left behind.

A file is done when results.jsonl has an ok line for its path with the same size and
modification time, by the same model and settings, and its outputs exist (`plan_resume`); a
rerun skips it and redoes everything else (failed or changed files). The old line of a redone
file stays beside its new one until the run ends (`drop_replaced`), so a run stopped early
leaves the files it did not reach as they were. A line by another model or settings
(`ResumePlan.superseded`) would vouch for outputs the run rewrites, so just before the run
replaces a file's outputs it appends an `error` line for it (`output_writer.OutputWriter`),
which its `ok` line then follows. With --force every redone file's line goes before the run
writes anything: stopped early, the rerun redoes the rest. Each file ends with exactly
one line; a run killed before its end can leave two or three, and a file's last line is the
one that counts (`latest`). A file redone only for a format its line lacks keeps
the formats it had on its new line (`ResumePlan.kept`). One run at a time holds a folder
(`out_dir_lock`).
"""
from __future__ import annotations

import fcntl
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from transcribe.inputs import InputFile, manifest_of_line, output_stems, record_key
from transcribe.writers import TEMP_MARK, atomic_write_text, open_lock, output_paths, read_results, results_line

# writers.StagedWrites' temporary names only: a look-alike (`.notes.abcd1234.tmp`) is the user's.
_TEMP_OUTPUT = re.compile(rf"^\..+\.{re.escape(TEMP_MARK)}[a-z0-9_]{{8}}\.tmp$")
LOCK_NAME = ".transcribe.lock"


class OutputBusy(Exception):
    """Another run holds the output folder."""


@contextmanager
def out_dir_lock(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir`/.transcribe.lock (flock, exclusive) while a run writes there. A second
    run into the same folder (overlapping cron jobs) would redo the same files, sweep the first
    one's temporary files from under it, and lose its log lines when it rewrites results.jsonl;
    it gets OutputBusy instead. The kernel drops the lock when the holder dies, so a killed
    run never leaves the folder locked; the file itself stays (removing it would race).
    A lock file this user cannot write is locked through a read-only descriptor (`open_lock`;
    the pid in it then stays the last writer's, so a busy message may name that one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    fd, writable = open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise OutputBusy(f"{out_dir} is in use by another transcribe run"
                             + (f" (pid {holder})" if holder else "")) from None
        except OSError as e:  # Lustre mounted without flock, some NFS setups: run unguarded
            print(f"note: {out_dir}: cannot lock it ({e.strerror}); make sure no other run writes there",
                  file=sys.stderr)
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above, nothing else
        yield
    finally:
        os.close(fd)


def writer_of(out_dir: Path) -> str | None:
    """The pid (or "" when unknown) of a run writing into `out_dir` now, None when none is. A
    shared, non-blocking probe of its lock file that creates and writes nothing (`merge` reads
    shard folders, which may be read-only); no lock file, or one that cannot be locked, is None."""
    try:
        fd = os.open(out_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file (`out_dir_lock`), "" if none."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip()


def file_identity(path: Path) -> dict:
    """Size and modification time: a rerun redoes a file whose content may have changed."""
    try:
        st = path.stat()
    except OSError:
        return {"size": None, "mtime": None}
    return {"size": st.st_size, "mtime": st.st_mtime_ns}


class ResumePlan(NamedTuple):
    todo: list[InputFile]  # the files to transcribe, in the order given
    skipped: int  # files already done
    # key -> outputs (paths relative to the log's folder) that an earlier transcription of the
    # same audio by the same model and settings wrote, that this run does not rewrite and that
    # its line still lists: they stay listed on the file's new line. Without this, a run with
    # `-f srt` after txt runs dropped txt from the lines and the next txt run redid every file.
    kept: dict[Path, list[str]]
    # Lines of manifest lines this run read that name none of its inputs: the error a broken
    # line left (`MANIFEST:LINE`), fixed or deleted since. Kept, the failure stayed in the log
    # for good (and `merge` counted it). Dropped when the run ends (`drop_replaced`). Shards go
    # to folders of their own (a broken line fails in the same shard each time): a shard run into
    # another shard's folder would drop that shard's failed lines of the manifest too.
    stale: frozenset[Path] = frozenset()
    # The log holds lines to drop when the run ends (`drop_replaced`): old lines of files this
    # run redoes, `stale` ones, a killed run's second lines. Without any, it is not read again.
    tidy: bool = False
    # Keys of files to redo whose last line is by another model or settings: it would vouch
    # for the outputs this run writes over. It stays until the run writes
    # those (a run stopped early leaves a finished job's lines as they were: dropped up front,
    # a run with another model stopped during its load lost the log of 20,000 files), and
    # `OutputWriter` appends the file's `error` line just before it does. Each maps to the
    # outputs the old line lists, which that line goes on listing: an earlier line of another
    # file that listed one (an `a.wav` of another input folder, same --out) would own it again.
    superseded: dict[Path, list[str]] = {}


def outputs_of(stems: dict[Path, Path], formats: list[str]) -> Callable[[InputFile], list[Path]]:
    """A file -> the outputs (relative to --out) that `formats` write for it, its stem from `stems`
    (`inputs.output_stems`)."""
    return lambda f: list(output_paths(stems[f.key], formats).values())


def latest(records: list[dict]) -> dict[Path, dict]:
    """One line per file (a segment of a file is its own), by its key (`record_key`): its last,
    where it stands in the log."""
    last: dict[Path, dict] = {}
    for r in records:
        key = record_key(r)
        last.pop(key, None)  # in the order they were written: the last line naming an output owns it
        last[key] = r
    return last


def drop_replaced(log_path: Path, stale: frozenset[Path] = frozenset()) -> None:
    """Rewrite the log with one line per file (`latest`) if a redone file has more, and without
    the `stale` lines (`ResumePlan.stale`). At the end of a run (`ResumePlan.tidy`), stopped or
    not; a log that cannot be rewritten (a full disk) keeps the old lines too, which every
    reader passes over and the next run drops."""
    try:
        records = read_results(log_path, notes=False)
        lines = [r for key, r in latest(records).items() if key not in stale]
        if len(lines) != len(records):
            atomic_write_text(log_path, "".join(results_line(r) for r in lines))
    except OSError:
        pass


def plan_resume(files: list[InputFile], log_path: Path, force: bool, identities: dict[Path, dict],
                model: str | None = None, settings: dict[str, str] | None = None,
                outputs: Callable[[InputFile], list[Path]] = lambda f: [],
                names: Callable[[InputFile], list[Path]] = lambda f: []) -> ResumePlan:
    """Drop files already done (same path, size and mtime as `identities` holds for it, the
    run's `file_identity` of each input path, status ok, by `model` and with
    `settings` when given, so a rerun with another model, or Whisper with another --language
    or --task, transcribes again rather than keep the old text, and `outputs`: the files
    this run would write for it (paths relative to the log's folder) exist and are among the
    line's own `outputs`, so a rerun with `--format srt` after a txt-only run writes the
    subtitles, a deleted transcript is made again, and a json left by an earlier
    transcription, or by another file that had the name before, is not taken for this one's,
    nor is one that a later line lists, whose file wrote over it). A line from before `outputs`
    were logged vouches for any that exist. Every old line stays until the run replaces it
    (`ResumePlan.superseded` says which need an `error` line first, as their outputs are
    rewritten): stopped early, a `-f srt` run over a 400-file folder done in txt left 209 lines
    when they went first, and the next txt run redid the other 191. With `force` the log is
    rewritten now without the lines of the files to redo (an OSError if it cannot be), so that
    a forced run stopped early leaves the rest to redo.
    `names`: every output the file's name has this run (all formats): only those can be `kept`
    (a name another file had in an earlier run, before two files' names clashed, is not)."""
    lines = read_results(log_path)
    records = latest(lines)
    twice = len(records) != len(lines)  # a killed run's: its redone files' old lines too
    by_key = {f.key: f for f in files}
    done, kept = (set(), {}) if force else _done(records, by_key, log_path.parent, identities, model,
                                                 settings, outputs, names)
    todo = [f for f in files if f.key not in done]
    redo = {f.key for f in todo}
    if force and not redo.isdisjoint(records):
        # --force redoes every file, whatever its line says: a run stopped early must leave the
        # rest to redo, so their lines go now (an OSError if the log cannot be rewritten). An
        # output a dropped line owned goes with it: an earlier line of another file that listed
        # it (an `a.wav` of another input folder, same --out) would own it again.
        owner = _owners(records)
        records = {k: _without(r, {p for p in listed_outputs(r) if owner[p] in redo})
                   for k, r in records.items() if k not in redo}
        atomic_write_text(log_path, "".join(results_line(r) for r in records.values()))
        twice = False
    superseded = {k: listed_outputs(r) for k, r in records.items() if k in redo and not _same_run(r, model, settings)}
    stale = _stale(files, records, by_key)
    tidy = twice or bool(stale) or not redo.isdisjoint(records)
    return ResumePlan(todo, len(files) - len(todo), {k: v for k, v in kept.items() if v and k not in done},
                      stale, tidy, superseded)


def _owners(records: dict[Path, dict]) -> dict[str, Path]:
    """Each output to the key of the last line (`latest`) that lists it: a later run that gave
    its name to another file (an `a.wav` of another input folder, into the same --out) wrote
    over it."""
    return {p: key for key, r in records.items() for p in listed_outputs(r)}


def _without(record: dict, outputs: set[str]) -> dict:
    """`record` no longer listing `outputs`."""
    return {**record, "outputs": [p for p in record["outputs"] if p not in outputs]} if outputs else record


def _same_run(record: dict, model: str | None, settings: dict[str, str] | None) -> bool:
    """The line is by `model` with `settings` (None: any), as `_done` asks of a line that is done."""
    return (model is None or record.get("model") == model) and (
        settings is None or record.get("settings", {}) == settings)


def _stale(files: list[InputFile], keys, by_key: dict) -> frozenset[Path]:
    """`ResumePlan.stale`: the keys among the log's `keys` (its lines' `latest`) of lines of a
    manifest `files` came from that name none of them."""
    other = [k for k in keys if k not in by_key]
    if not other:  # the usual case, and the cron fast path's: no name built for 20,000 inputs
        return frozenset()
    read = {manifest_of_line(f.line or f.path) for f in files} - {None}
    return frozenset(k for k in other if manifest_of_line(k) in read)


def _done(records: dict[Path, dict], by_key: dict, out_dir: Path, identities: dict[Path, dict],
          model: str | None, settings: dict[str, str] | None, outputs: Callable[[InputFile], list[Path]],
          names: Callable[[InputFile], list[Path]]) -> tuple[set, dict[Path, list[str]]]:
    """The keys of `by_key` that `records` (`latest`) show done, and the outputs kept for the
    others (`plan_resume` says what each argument is and why)."""
    # An output is the last listing line's: the earlier line's file is done again rather than
    # vouched for by the other file's transcript.
    owner = _owners(records)
    done, kept = set(), {}
    for key, r in records.items():
        if r.get("status") == "ok" and key in by_key and identities[by_key[key].path] == {
            "size": r.get("size"), "mtime": r.get("mtime")
        } and _same_run(r, model, settings) and not _past_cap(r, by_key[key]):
            f = by_key[key]
            wanted = outputs(f)
            if _vouched(r, wanted, out_dir) and all(owner.get(p.as_posix(), key) == key for p in wanted):
                done.add(key)
                continue
            ours, named = {p.as_posix() for p in wanted}, {p.as_posix() for p in names(f)}
            kept[key] = [p for p in listed_outputs(r) if p not in ours and p in named
                         and owner.get(p) == key and (out_dir / p).exists()]
    return done, kept


def _past_cap(record: dict, f: InputFile) -> bool:
    """The line transcribed more of the file than its lone `offset: 0` line now asks
    (`InputFile.cap`): read whole by a run before caps were read, or under a longer one."""
    duration = record.get("duration")
    return f.cap is not None and isinstance(duration, (int, float)) and duration > f.cap + 1e-3


def all_done(files: list[InputFile], out_dir: Path, formats: list[str], model: str, settings: dict[str, str]) -> bool:
    """Every one of `files` is done in `out_dir` (`plan_resume`'s test, by `model` with
    `settings`, writing these `formats`), and no run is writing there now: a rerun from cron
    over a folder with nothing new can end before any worker spawns or weights load. Reads
    only; a broken log line is left for the run's own plan to name."""
    log_path = out_dir / "results.jsonl"
    if not log_path.is_file() or writer_of(out_dir) is not None:
        return False
    records = latest(read_results(log_path, notes=False))
    by_key = {f.key: f for f in files}
    if not by_key.keys() <= records.keys():  # a new file (cron's usual case): said before the names,
        return False  # which cost most here (20,000 files: 0.65 s of 1.1)
    if _stale(files, records, by_key):  # the run drops them
        return False
    stems = output_stems(files)
    identities = {f.path: file_identity(f.path) for f in files}
    done, _ = _done(records, by_key, out_dir, identities, model, settings, outputs_of(stems, formats),
                    lambda f: [])
    return done == set(by_key)


def _vouched(record: dict, outputs: list[Path], out_dir: Path) -> bool:
    """Every one of `outputs` exists and, where the line lists its outputs, is one of them; and
    none is empty where the line has text (our writes are atomic, so an empty transcript of a
    file that said something was emptied since: a copy cut short, a `> a.txt`; it stayed done
    for good, only --force, which redoes every file, made it again)."""
    listed = None if record.get("outputs") is None else listed_outputs(record)
    empty_ok = not record.get("text")
    return all(_there(out_dir / p, empty_ok) and (listed is None or p.as_posix() in listed) for p in outputs)


def _there(path: Path, empty_ok: bool) -> bool:
    """`path` exists (followed through links) and, unless `empty_ok`, holds something."""
    try:
        return path.stat().st_size > 0 or empty_ok
    except (OSError, ValueError):  # not there, or a name the system refuses (as Path.exists says False)
        return False


def listed_outputs(record: dict) -> list[str]:
    """A line's `outputs` that are paths; none when it is not a list (a hand-edited `5` made
    every later run of the folder a TypeError, a string was searched for substrings)."""
    outputs = record.get("outputs")
    return [p for p in outputs if isinstance(p, str)] if isinstance(outputs, list) else []


def sweep_leftovers(out_dir: Path) -> None:
    """Remove what a killed run left: its temporary outputs in `out_dir` (its shared memory had
    no name, so the kernel freed it with the last process: `transcribe/shm.py`)."""
    if out_dir.is_dir():
        for p in out_dir.rglob(".*.tmp"):
            if _TEMP_OUTPUT.match(p.name):
                p.unlink(missing_ok=True)
