"""Transcribed files -> their output files and results.jsonl lines, a batch at a time.

The pipeline hands each file over as its last piece is transcribed (`finished`) and calls
`flush` after each batch: the outputs of the files since the last flush are staged to
temporary names, then all fsynced, then all renamed (`writers.StagedWrites`), then their
results.jsonl lines are appended (each flushed) and the log is fsynced once, so an `ok` line
never outlives its outputs and a crash loses at most a batch's lines, whose files the next run
redoes. A full, over-quota or read-only disk stops the run (`OutputStopped`) after the files
staged before it are written; a file whose outputs cannot be written (a name too long, say)
fails alone.
"""
from __future__ import annotations

import sys
import time
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
                 kept: dict[Path, list[str]] | None = None):
        self.out_dir, self.formats, self.stems, self.log = out_dir, formats, stems, log
        # Each input path's size and mtime from before any worker read it (pipeline.run): taken
        # at the write, a file still growing while the run read it matched for good.
        self.identities = identities
        self.kept = kept or {}  # key -> earlier outputs its line goes on listing (resume.ResumePlan)
        # What a rerun compares besides the model (engine_api.Engine.settings); none: no key.
        self.made_by = {"model": model, **({"settings": settings} if settings else {})}
        self.stats, self.bar = stats, bar
        self.pending: list[tuple[InputFile, Result, float]] = []  # transcribed, to write at `flush`

    def finished(self, file: InputFile, result: Result, seconds: float) -> None:
        self.pending.append((file, result, seconds))

    def flush(self) -> None:
        """Write the files transcribed since the last flush (all their outputs staged, then one
        `StagedWrites.commit`), then their
        results.jsonl lines, then sync the log: an `ok` line never outlives its outputs. A
        full disk stops the run after the files staged before it are written."""
        t0 = time.perf_counter()
        writes, staged, stop = StagedWrites(), [], None
        for file, result, seconds in self.pending:
            stem = self.out_dir / self.stems[file.key]
            try:
                write_outputs(result, stem, self.formats, writes)
            except OSError as e:
                writes.drop(stem)
                if e.errno in STOP_ERRNOS:
                    stop = e
                    break
                self._cannot_write(file, e)
                continue
            staged.append((file, result, seconds, stem))
        self.pending.clear()
        try:
            failed = writes.commit()
        except OSError as e:
            raise OutputStopped(f"{self.out_dir}: {e.strerror}") from e
        for file, result, seconds, stem in staged:
            if stem in failed:
                self._cannot_write(file, failed[stem])
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

    def fail(self, file: InputFile, error: str) -> None:
        print(f"error: {error}", file=sys.stderr)
        self._log({**_names(file), "duration": None, "text": "", "status": "error",
                   "error": error, **self.made_by, **self.identities[file.path]})
        self.stats.files_failed += 1
        self.bar.step()

    def _cannot_write(self, file: InputFile, e: OSError) -> None:
        self.fail(file, f"{file.path}: cannot write its transcript ({e.strerror or e}: {e.filename})")

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
