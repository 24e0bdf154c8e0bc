"""Pipeline: files -> preprocessing workers -> shared-memory slab -> length buckets -> engine ->
stitched results -> writers.

Worker processes (`transcribe/workers.py`) decode, resample, cut long files at pauses and
compute features into slots of a shared-memory slab (`transcribe/shm.py`); this process
batches the pieces by length (`transcribe/batching.py`), runs the engine on views of the
slots, frees them, and has the files each batch finished written together, outputs first,
then their `results.jsonl` lines (`transcribe/output_writer.py`, in a thread of its own while
the next batch runs). A bad file, a crashed or hung worker, or a piece the model fails on (a
failing batch runs again in halves, which also gets a batch that ran out of memory through)
fails those files alone (`status: error`, with the reason), as does an output that cannot be
written (a name too long, say); a full, over-quota or read-only output disk stops the run
(`OutputStopped`), since every later write would fail too. ^C and SIGTERM stop at once. Every
way of stopping leaves each finished file written and no worker, segment or temporary file
behind; rerunning the command resumes.
"""
from __future__ import annotations

import contextlib
import gc
import os
import queue
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from transcribe import heap
from transcribe.audio import AudioError, audio_info
from transcribe.batching import Batcher, PaddingStats
from transcribe.engine_api import Engine, Frontend
from transcribe.file_language import FileLanguages
from transcribe.inputs import InputFile, output_stems
from transcribe.output_writer import OutputStopped, OutputWriter
from transcribe.results import Result
from transcribe.resume import (ResumePlan, drop_replaced, file_identity, out_dir_lock, outputs_of, plan_resume,
                               sweep_leftovers)
from transcribe.shm import Slab
from transcribe.signals import Interrupted, signals_raise, stop_if_signalled
from transcribe.stitching import stitch
from transcribe.workers import FileTimeout, Piece, Prespawned, WorkerPool, default_workers
from transcribe.writers import WRITERS, ResultsLog

SLAB_BYTES = 128 << 20  # shared memory for features waiting for the model
MAX_SLOTS = 1024
IDLE_S = 0.05  # poll interval of the main loop while no piece waits


@dataclass
class RunStats:
    files_ok: int = 0
    files_failed: int = 0
    files_skipped: int = 0
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    texts: dict[Path, str] = field(default_factory=dict)
    padding: PaddingStats = field(default_factory=PaddingStats)
    workers_peak_bytes: int = 0  # the preprocessing workers' peak resident memory, summed

    @property
    def rtfx(self) -> float:
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def padding_fraction(self) -> float:
        return self.padding.fraction


def slab_slots(frontend: Frontend, n_workers: int) -> int:
    """Slots of the slab: SLAB_BYTES worth, but always a batch's worth per worker and more."""
    slot_bytes = 4 * frontend.n_mels * frontend.max_frames
    return max(4 * n_workers + 8, min(MAX_SLOTS, SLAB_BYTES // slot_bytes))


def run(engine: Engine, files: list[InputFile], out_dir: Path, formats: list[str], *,
        batch_seconds: float = 300.0, force: bool = False, workers: int | None = None,
        progress: bool | None = None, file_timeout: FileTimeout = FileTimeout(),
        prespawned: Prespawned | None = None) -> RunStats:
    """Transcribe `files` into `out_dir`; returns counts, audio seconds, wall time and stage times.

    `prespawned`: worker processes started while the model loaded (`Prespawned`), used first.

    Raises `Interrupted` on SIGINT/SIGTERM, after writing everything finished and cleaning up.
    """
    t_start = time.perf_counter()
    stats = RunStats()
    with out_dir_lock(out_dir):  # OutputBusy if another run writes there
        sweep_leftovers(out_dir)
        stems = output_stems(files)
        # Each file's size and mtime, once, before any worker opens it: what resume compares with
        # the log, and what the log records. A file still growing or replaced while the run
        # reads it is logged as it was here, so the next run sees the change and does it again.
        identities = {f.path: file_identity(f.path) for f in files}
        try:
            plan = plan_resume(files, out_dir / "results.jsonl", force, identities, model=engine.name,
                               settings=engine.settings, outputs=outputs_of(stems, formats),
                               names=outputs_of(stems, list(WRITERS)))
        except OSError as e:  # the log could not be read or (--force) rewritten: nothing is written yet
            raise OutputStopped(f"{out_dir / 'results.jsonl'}: {e.strerror or e}") from e
        todo, stats.files_skipped = plan.todo, plan.skipped
        # Longest first: the biggest pieces meet the memory limit at once, and stragglers are short.
        with _decoder_chatter_dropped():
            todo.sort(key=lambda f: -(f.duration if f.duration is not None else _header_seconds(f.path)))
        bar = _Progress(len(todo), enabled=sys.stderr.isatty() if progress is None else progress)
        n_workers = min(workers or default_workers(), max(len(todo), 1))  # a worker per file at most
        stats.stage_seconds["plan"] += time.perf_counter() - t_start
        try:
            with signals_raise(), ResultsLog(out_dir / "results.jsonl") as log:
                if todo:
                    job = _Job(engine, todo, stems, identities, plan, out_dir, formats, log, stats, bar)
                    job.run(n_workers, batch_seconds, file_timeout, prespawned)
        finally:
            if plan.tidy:  # the old lines of the files redone
                drop_replaced(out_dir / "results.jsonl", plan.stale)
            bar.close()
            for k, v in engine.stage_seconds.items():
                stats.stage_seconds[k] += v
            stats.wall_seconds = time.perf_counter() - t_start
    return stats


@contextlib.contextmanager
def _decoder_chatter_dropped() -> Iterator[None]:
    """Reading a damaged MP3's header has libmpg123 write "Warning: Xing stream size off ..."
    to stderr, naming no file. The worker that decodes the file says it again, under the
    file's name (`preprocess.NamedStderr`), so here it is dropped."""
    sys.stderr.flush()
    real = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(real, 2)
        os.close(real)


def _header_seconds(path: Path) -> float:
    try:
        return audio_info(path)[0]
    except (AudioError, OSError):  # OSError: a path the system refuses (too long): it fails later
        return 0.0


@dataclass
class _File:
    file: InputFile
    pieces: dict[int, tuple[float, Result]] = field(default_factory=dict)  # index -> (offset, result)
    expected: int | None = None  # pieces, once the worker is done with the file
    samples: int = 0


class _Job:
    """One run's moving parts: the pool's events in, batches through the engine, files out."""

    def __init__(self, engine: Engine, todo: list[InputFile], stems: dict[Path, Path], identities: dict[Path, dict],
                 plan: ResumePlan, out_dir: Path, formats: list[str], log: ResultsLog, stats: RunStats,
                 bar: "_Progress"):
        self.engine, self.stats = engine, stats
        self.outputs = OutputWriter(out_dir, formats, stems, log, engine.name, engine.settings, stats, bar,
                                    identities, plan.kept, getattr(engine, "runtime", ""), plan.superseded)
        self.files = {fid: _File(f) for fid, f in enumerate(todo)}  # until transcribed or failed
        # A model that detects the language: a file's later pieces wait for its language (file_language).
        self.languages = FileLanguages() if engine.detects_language else None
        self.split_at_s = float("inf")  # padded batch seconds that ran out of memory: halve from there

    def run(self, n_workers: int, batch_seconds: float, timeout: FileTimeout,
            prespawned: Prespawned | None = None) -> None:
        """The job, then the wait for its last writes (also when it stops on an exception:
        whatever was handed to the writing thread is written before the log closes)."""
        try:
            done_at = self._run(n_workers, batch_seconds, timeout, prespawned)
        except BaseException:
            self.outputs.close(stopping=True)
            raise
        self.outputs.close()
        self.stats.stage_seconds["finish"] += time.perf_counter() - done_at

    def _run(self, n_workers: int, batch_seconds: float, timeout: FileTimeout,
             prespawned: Prespawned | None) -> float:
        """The job's loop between its "startup" (slab, workers attached, the engine's buffers)
        and its "finish" (workers stopped, last writes): returns when its last file was done."""
        t0 = time.perf_counter()
        frontend = self.engine.frontend
        with Slab.create(slab_slots(frontend, n_workers), frontend.n_mels * frontend.max_frames) as slab, \
                WorkerPool(frontend, slab, n_workers, timeout, prespawned) as pool:
            max_items = slab.spec.n_slots - n_workers  # a full batch can wait while each worker fills a slot
            batcher: Batcher[Piece] = Batcher(self.engine.bucket_edges_s, batch_seconds, max_items)
            self.stats.padding = batcher.padding
            self.engine.reserve(max_items)
            gc.collect()
            gc.freeze()  # long-lived startup objects: out of every collection's scan while we run
            self.stats.stage_seconds["startup"] += time.perf_counter() - t0
            try:
                for fid, f in list(self.files.items()):
                    if f.file.problem:  # a manifest line that names nothing we can open
                        self._fail(fid, f.file.problem, pool)
                    else:
                        pool.submit(fid, str(f.file.path), f.file.span)
                # Their error lines now: when every file left is such a line, the loop below
                # never runs, and a failure not flushed would be neither logged nor counted.
                self.outputs.flush()
                while self.files:
                    stop_if_signalled()  # one whose Interrupted was lost (see signals._received)
                    # Take every piece that has arrived (full buckets run as they fill), then,
                    # the model being free, run the fullest bucket rather than wait for more:
                    # pieces arriving meanwhile make the next batch, so batches grow exactly
                    # when the model is the bottleneck.
                    for event in _events(pool, 0.0 if len(batcher) else IDLE_S, self.stats.stage_seconds):
                        self._on_event(event, batcher, pool, slab)
                    if len(batcher):
                        self._run_batch(batcher.take(), batcher, pool, slab)
                    self.outputs.flush()
                done_at = time.perf_counter()
            except Interrupted:
                self.outputs.flush()  # what was transcribed before ^C is written
                raise
            finally:
                gc.unfreeze()
        for k, v in pool.stage_seconds.items():
            self.stats.stage_seconds[k] += v
        self.stats.workers_peak_bytes += pool.peak_rss_bytes
        return done_at

    def _on_event(self, event: tuple, batcher: Batcher[Piece], pool: WorkerPool, slab: Slab) -> None:
        kind, fid = event[0], (event[1].fid if event[0] == "piece" else event[1])
        f = self.files.get(fid) if isinstance(fid, int) else None
        if kind == "piece":
            self._add(event[1], batcher, pool, slab)
        elif kind == "done":
            if f is not None:
                f.expected, f.samples = event[2], event[3]
                if self.languages is not None:  # its last probes may decide now
                    self._settle(*self.languages.ended(fid, f.expected), batcher, pool, slab)
                if fid in self.files:
                    self._maybe_finish(fid)
        elif kind == "error":
            if f is not None:
                pool.release([p.slot for p in batcher.drop(lambda p: p.fid == fid)])
                self._fail(fid, event[2], pool, event[3])
        elif kind == "fatal":
            raise event[1]

    def _add(self, piece: Piece, batcher: Batcher[Piece], pool: WorkerPool, slab: Slab) -> None:
        """Into its length bucket (a full bucket runs now), unless it waits for its file's
        language; a piece of a file that has failed already gives its slot back (one a worker
        was still cutting, or a held piece released into a batch that failed the file)."""
        if piece.fid not in self.files:
            pool.release([piece.slot])
            return
        if self.languages is not None and not self.languages.admit(piece):
            return
        batch = batcher.add(piece, piece.samples / self.engine.sample_rate)
        if batch:
            self._run_batch(batch, batcher, pool, slab)

    def _run_batch(self, batch: list[Piece], batcher: Batcher[Piece], pool: WorkerPool, slab: Slab) -> None:
        try:
            outcomes = self._transcribe(batch, slab)
        except BaseException:
            pool.release([p.slot for p in batch])
            raise
        finally:
            heap.trim()  # what the batch's tensors freed goes back to the system
        t0 = time.perf_counter()
        self._store(batch, outcomes, batcher, pool, slab)
        self.stats.stage_seconds["settle"] += time.perf_counter() - t0

    def _store(self, batch: list[Piece], outcomes: list[Result | str], batcher: Batcher[Piece], pool: WorkerPool,
               slab: Slab) -> None:
        """A batch's outcomes into their files (stitched and handed to the writer when complete);
        the time this takes on the job's thread is the stage "settle"."""
        failed: dict[int, str] = {}
        for p, r in zip(batch, outcomes):
            if isinstance(r, str) and p.fid in self.files:
                failed.setdefault(p.fid, r)
        for fid, reason in failed.items():
            f = self.files[fid]  # its length is known once its worker is done with it
            self._fail(fid, f"{f.file.path}: model failed on a piece of it: {reason}", pool,
                       f.samples / self.engine.sample_rate if f.samples else None)
        final: list[tuple[Piece, Result]] = []
        again: list[Piece] = []
        for p, r in zip(batch, outcomes):
            if p.fid not in self.files:  # failed: its slot goes back
                pool.release([p.slot])
            elif self.languages is None:
                final.append((p, r))
            else:  # an unsure probe of its file's language is in neither list: it keeps its slot
                stands, later = self.languages.decided(p, r)
                final += stands
                again += later
        self._settle(final, again, batcher, pool, slab)
        self.outputs.flush()  # the batch's files written together (the loop flushes those its events finish)

    def _settle(self, final: list[tuple[Piece, Result]], again: list[Piece], batcher: Batcher[Piece],
                pool: WorkerPool, slab: Slab) -> None:
        """Store the results that stand (their slots go back; files complete), then batch
        `again`: pieces that waited for their file's language, or decode again in it."""
        pool.release([p.slot for p, _ in final])
        for p, r in final:
            self.files[p.fid].pieces[p.index] = (p.offset_s, r)
        for fid in dict.fromkeys(p.fid for p, _ in final):
            self._maybe_finish(fid)
        for q in again:
            self._add(q, batcher, pool, slab)

    def _transcribe(self, batch: list[Piece], slab: Slab) -> list[Result | str]:
        """The engine's Result per piece, or the error (str) that piece failed with. A batch the
        model cannot run (torch raises RuntimeError: out of memory, or an error one piece sets
        off) runs again in halves, so only pieces that fail on their own fail their files; a
        batch that ran out of memory also sets the size from which later batches are halved
        before they run, instead of failing first every time."""
        size = _padded_seconds(batch, self.engine.sample_rate)
        if len(batch) > 1 and size >= self.split_at_s:
            return self._halves(batch, slab)
        views = [torch.from_numpy(slab.view(p.slot, (p.n_mels, p.frames))) for p in batch]
        languages = [self.languages.language(p) for p in batch] if self.languages is not None else None
        try:
            return list(self.engine.transcribe_features(views, languages, after_pause=[p.index > 0 for p in batch]))
        except RuntimeError as e:  # torch's error type, torch.OutOfMemoryError included
            error = e
        finally:
            del views
        if heap.out_of_memory(error):
            self.split_at_s = min(self.split_at_s, size)
            _release_cached_memory(self.engine.device)
        if len(batch) == 1:
            return [f"{type(error).__name__}: {error}"]
        print(f"note: the model failed on a batch of {len(batch)} pieces ({size:.0f} s padded): "
              f"{type(error).__name__}: {_first_line(error)}; running it in halves", file=sys.stderr)
        return self._halves(batch, slab)

    def _halves(self, batch: list[Piece], slab: Slab) -> list[Result | str]:
        half = len(batch) // 2
        return self._transcribe(batch[:half], slab) + self._transcribe(batch[half:], slab)

    def _maybe_finish(self, fid: int) -> None:
        f = self.files[fid]
        if f.expected is None or len(f.pieces) < f.expected:
            return
        parts = [f.pieces[k] for k in range(f.expected)]
        seconds = f.samples / self.engine.sample_rate
        start = f.file.offset or 0.0  # a segment's times too are seconds from the start of the file
        result = stitch([r for _, r in parts], [start + o for o, _ in parts], start + seconds,
                        self.engine.sentence_delimiters)
        del self.files[fid]
        if self.languages is not None:
            self.languages.forget(fid)
        self.outputs.finished(f.file, result, seconds)

    def _fail(self, fid: int, error: str, pool: WorkerPool, seconds: float | None = None) -> None:
        if self.languages is not None:  # pieces held for the language: their slots go back
            pool.release([p.slot for p in self.languages.forget(fid)])
        self.outputs.fail(self.files.pop(fid).file, error, seconds)


def _padded_seconds(batch: list[Piece], sample_rate: int) -> float:
    """Audio seconds the batch's encoder input spans: rows x its longest piece."""
    return len(batch) * max(p.samples for p in batch) / sample_rate


def _release_cached_memory(device: str) -> None:
    """Return the caching allocator's free blocks, so the retry's halves can use them."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _events(pool: WorkerPool, timeout: float, stage_seconds: dict[str, float]) -> Iterator[tuple]:
    """The events waiting now, after waiting up to `timeout` s for the first one. That wait is
    the model idle for want of pieces (nothing batched): charged to the stage
    "wait_for_pieces", which says whether a run was bound by its workers or by the engine."""
    try:
        if timeout > 0:
            t0 = time.perf_counter()
            try:
                event = pool.events.get(timeout=timeout)
            finally:
                stage_seconds["wait_for_pieces"] += time.perf_counter() - t0
            yield event
        else:
            yield pool.events.get_nowait()
    except queue.Empty:
        return
    while True:
        try:
            yield pool.events.get_nowait()
        except queue.Empty:
            return


class _Progress:
    """A one-line progress bar on stderr, only on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled and total > 0, time.perf_counter()

    def step(self) -> None:
        self.n += 1
        if self.enabled:
            bar = "#" * int(30 * self.n / self.total)
            print(f"\r[{bar:<30}] {self.n}/{self.total} {time.perf_counter() - self.t0:6.1f}s", end="",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)
