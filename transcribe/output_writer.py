"""Transcribed files -> their output files and results.jsonl lines, a batch at a time.

The pipeline hands each file over as its last piece is transcribed (`finished`) or as it fails
(`fail`) and calls `flush` after each batch: the outputs of the files since the last flush are
staged to temporary names, then all fsynced, then all renamed (`writers.StagedWrites`), then
their results.jsonl lines are appended (each flushed) and the log is fsynced once, so an `ok`
line never outlives its outputs and a crash loses at most a batch's lines, whose files the next
run redoes (or finds done by an old line of the same model and settings). An old line by
another model or settings (`resume.ResumePlan.superseded`) would vouch for the outputs about to
be replaced: before the renames, the file gets an `error` line, fsynced, that its `ok` line
follows, so a run stopped in between leaves it to redo, and one stopped before leaves the old
line, and the finished work it records, as it was. A full, over-quota or read-only disk stops
the run (`OutputStopped`) after the files staged before it are written; a file whose outputs
cannot be written (a name too long, say) fails alone.

The writing runs in one thread of its own, a batch at a time and in order, while the job's
thread goes on to the next batch: it is mostly waiting for fsync, which held the model up
(14 % of the wall time of a bf16 GPU run, 0.32 of 2.28 s, bench/results/gpu_h100_2026-11-23).
`flush` with files to hand over first waits for the batch handed over before, so at most one
is being written, and that one's `OutputStopped` is raised in the job's thread; `close` waits
for the last one. Every results.jsonl line, `ok` or `error`, is appended by that thread alone.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from transcribe.inputs import InputFile
from transcribe.results import Result
from transcribe.writers import STOP_ERRNOS, ResultsLog, StagedWrites, output_paths, write_outputs


class OutputStopped(Exception):
    """The output folder took no more writes (full, over quota, read-only): the run stopped."""


class OutputWriter:
    """One run's writing: `stats` (pipeline.RunStats) counts what is written, `bar` steps."""

    def __init__(self, out_dir: Path, formats: list[str], stems: dict[Path, Path], log: ResultsLog, model: str,
                 settings: dict[str, str], stats, bar, identities: dict[Path, dict],
                 kept: dict[Path, list[str]] | None = None, runtime: str = "",
                 superseded: dict[Path, list[str]] | None = None):
        self.out_dir, self.formats, self.stems, self.log = out_dir, formats, stems, log
        self.superseded = superseded or {}  # key -> its old line's outputs (resume.ResumePlan)
        # Each input path's size and mtime from before any worker read it (pipeline.run): taken
        # at the write, a file still growing while the run read it matched for good.
        self.identities = identities
        self.kept = kept or {}  # key -> earlier outputs its line goes on listing (resume.ResumePlan)
        # What a rerun compares besides the model (engine_api.Engine.settings); none: no key.
        self.made_by = {"model": model, **({"settings": settings} if settings else {})}
        # How it ran (backend, dtypes, decoder mode: the startup line's), not compared by a
        # rerun: shards run on unlike machines (bf16 here, float32 there) say so line by line.
        self.made_by.update({"runtime": runtime} if runtime else {})
        self.stats, self.bar = stats, bar  # both touched by the writing thread alone until close
        # Since the last flush: (file, Result, seconds) transcribed, or (file, error) failed.
        # (file, result, seconds) to write, or (file, error, seconds or None) to log as failed
        self.pending: list[tuple[InputFile, Result, float] | tuple[InputFile, str, float | None]] = []
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="outputs")
        self._writing: Future | None = None  # the batch handed over last

    def finished(self, file: InputFile, result: Result, seconds: float) -> None:
        self.pending.append((file, result, seconds))

    def fail(self, file: InputFile, error: str, seconds: float | None = None) -> None:
        """Say why now; the file's `error` line is logged with the next flush. seconds: its
        audio's length where known (its header was read), else None."""
        print(f"error: {error}", file=sys.stderr)
        self.pending.append((file, error, seconds))

    def flush(self) -> None:
        """Hand the files since the last flush to the writing thread, once the batch handed
        over before is written (its OutputStopped is raised here). With none, it returns at
        once: the job flushes after every batch and again after every loop over its events."""
        if self.pending:
            self.wait()
            batch, self.pending = self.pending, []
            self._writing = self._thread.submit(self._write, batch)

    def wait(self) -> None:
        """Until everything handed over is written; raises the OutputStopped that stopped it."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def close(self, stopping: bool = False) -> None:
        """Wait for the writing thread and end it (files not yet flushed are not written).
        `stopping`: the run is ending on another exception, which this does not replace: an
        OutputStopped met here is only said."""
        try:
            self.wait()
        except OutputStopped as e:
            if not stopping:
                raise
            print(f"error: {e}", file=sys.stderr)
        finally:
            self._thread.shutdown(wait=True)

    def _write(self, batch: list[tuple]) -> None:
        """The batch's outputs (all staged, then one `StagedWrites.commit`), then their
        results.jsonl lines, then a sync of the log: an `ok` line never outlives its outputs.
        A full disk stops the run after the files staged before it are written."""
        t0 = time.perf_counter()
        writes, staged, stop = StagedWrites(), [], None
        for item in batch:
            if isinstance(item[1], str):
                self._log_failure(*item)
                continue
            file, result, seconds = item
            stem = self.out_dir / self.stems[file.key]
            try:
                write_outputs(result, stem, self.formats, writes)
            except OSError as e:
                writes.drop(stem)
                if e.errno in STOP_ERRNOS:
                    stop = e
                    break
                self._cannot_write(file, e, seconds)
                continue
            staged.append((file, result, seconds, stem))
        self._supersede([file for file, _, _, _ in staged if file.key in self.superseded])
        try:
            failed = writes.commit()
        except OSError as e:
            raise OutputStopped(f"{self.out_dir}: {e.strerror}") from e
        for file, result, seconds, stem in staged:
            if stem in failed:
                self._cannot_write(file, failed[stem], seconds)
                continue
            self._log({**_names(file), "duration": round(seconds, 3), "text": result.text,
                       "status": "ok", "error": None, **self.made_by, **self.identities[file.path],
                       "outputs": [p.as_posix() for p in output_paths(self.stems[file.key], self.formats).values()]
                       + self.kept.get(file.key, [])})
            self.stats.files_ok += 1
            self.stats.audio_seconds += seconds
            self.stats.texts[file.key] = result.text
            self.bar.step()
        self._sync_log()
        self.stats.stage_seconds["write"] += time.perf_counter() - t0
        if stop is not None:
            raise OutputStopped(f"{self.out_dir}: {stop.strerror}") from stop

    def _supersede(self, files: list[InputFile]) -> None:
        """Before their outputs are replaced, an `error` line (fsynced) for each of `files` whose
        last line is by another model or settings: that line would vouch for the new outputs if
        the run stopped before their `ok` lines. It lists the outputs the run writes and those
        the old line listed: no other file's earlier line owns them again."""
        for file in files:
            ours = [p.as_posix() for p in output_paths(self.stems[file.key], self.formats).values()]
            old = [p for p in self.superseded[file.key] if p not in ours]
            self._log({**_names(file), "duration": None, "text": "", "status": "error",
                       "error": f"{file.path}: stopped while {self.made_by['model']} transcribed it again: run again to redo it",
                       **self.made_by, **self.identities[file.path], "outputs": ours + old})
        if files:
            self._sync_log()

    def _log_failure(self, file: InputFile, error: str, seconds: float | None) -> None:
        self._log({**_names(file), "duration": None if seconds is None else round(seconds, 3), "text": "", "status": "error",
                   "error": error, **self.made_by, **self.identities[file.path]})
        self.stats.files_failed += 1
        self.bar.step()

    def _cannot_write(self, file: InputFile, e: OSError, seconds: float) -> None:
        error = f"{file.path}: cannot write its transcript ({e.strerror or e}: {e.filename})"
        print(f"error: {error}", file=sys.stderr)
        self._log_failure(file, error, seconds)

    def _log(self, record: dict) -> None:
        """Append a results.jsonl line. The log is what a rerun resumes from: if it takes no
        more lines the run stops (a partial last line is dropped when it is next opened)."""
        try:
            self.log.append(record)
        except OSError as e:
            raise OutputStopped(f"{self.log.path}: {e.strerror or e}") from e

    def _sync_log(self) -> None:
        """Make the lines appended since the last sync durable (`ResultsLog.sync`)."""
        try:
            self.log.sync()
        except OSError as e:
            raise OutputStopped(f"{self.log.path}: {e.strerror or e}") from e


def _names(file: InputFile) -> dict:
    """How a results.jsonl line names its input: the path, and a segment's start (s) in the
    file (its length is the line's `duration`); `inputs.record_key` reads it back."""
    return {"audio_filepath": str(file.path), **({"offset": file.offset} if file.offset is not None else {})}
