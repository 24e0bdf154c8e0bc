"""Pipeline: files -> audio pieces -> length-sorted batches -> engine -> stitched results -> writers.

Audio is decoded ahead of the model by a small thread pool (soundfile, soxr and torch release
the GIL), pieces are batched by padded length under a budget of audio seconds, and each file's
outputs and its `results.jsonl` line are written as soon as its last piece is transcribed.
A bad file becomes a `status: error` line and the job goes on.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from transcribe.audio import AudioError, load_audio
from transcribe.inputs import InputFile, output_stems
from transcribe.results import Result
from transcribe.segmenting import split_long
from transcribe.stitching import stitch
from transcribe.writers import ResultsLog, read_results, write_outputs


class Engine(Protocol):
    """What the pipeline needs of a model (Parakeet or Whisper)."""

    name: str
    sample_rate: int
    max_piece_seconds: float  # longest audio the model takes in one piece
    stage_seconds: dict[str, float]  # accumulated time per stage, filled by the engine

    def transcribe(self, pieces: list[np.ndarray]) -> list[Result]: ...


@dataclass
class RunStats:
    files_ok: int = 0
    files_failed: int = 0
    files_skipped: int = 0
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    texts: dict[Path, str] = field(default_factory=dict)

    @property
    def rtfx(self) -> float:
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


@dataclass
class _Loaded:
    file: InputFile
    audio: np.ndarray | None
    error: str | None
    seconds: float


def file_identity(path: Path) -> dict:
    """Size and modification time: a rerun redoes a file whose content may have changed."""
    try:
        st = path.stat()
    except OSError:
        return {"size": None, "mtime": None}
    return {"size": st.st_size, "mtime": st.st_mtime_ns}


def plan_resume(files: list[InputFile], log_path: Path, force: bool) -> tuple[list[InputFile], int]:
    """Drop files already done (same path, size, mtime, status ok) and rewrite the log without
    the lines of files about to be redone, so every file ends with exactly one line."""
    from transcribe.writers import atomic_write_text
    import json

    records = read_results(log_path)
    todo_paths = {str(f.path) for f in files}
    done = set()
    if not force:
        for r in records:
            p = Path(r["audio_filepath"])
            if r.get("status") == "ok" and str(p) in todo_paths and file_identity(p) == {
                "size": r.get("size"), "mtime": r.get("mtime")
            }:
                done.add(str(p))
    keep = [r for r in records if r["audio_filepath"] not in todo_paths or r["audio_filepath"] in done]
    if len(keep) != len(records):
        atomic_write_text(log_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep))
    todo = [f for f in files if str(f.path) not in done]
    return todo, len(files) - len(todo)


def _load(file: InputFile, sample_rate: int) -> _Loaded:
    t0 = time.perf_counter()
    try:
        audio = load_audio(file.path, sample_rate)
        return _Loaded(file, audio, None, time.perf_counter() - t0)
    except AudioError as e:
        return _Loaded(file, None, str(e), time.perf_counter() - t0)


def _prefetch(files: list[InputFile], sample_rate: int, workers: int, ahead: int) -> Iterator[_Loaded]:
    """Decode files in order on a thread pool, at most `ahead` files in flight."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode") as pool:
        pending = []
        it = iter(files)
        for f in it:
            pending.append(pool.submit(_load, f, sample_rate))
            if len(pending) >= ahead:
                break
        while pending:
            done = pending.pop(0).result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(_load, nxt, sample_rate))
            yield done


def run(
    engine: Engine,
    files: list[InputFile],
    out_dir: Path,
    formats: list[str],
    *,
    batch_seconds: float = 300.0,
    force: bool = False,
    decode_workers: int = 2,
    progress: bool | None = None,
) -> RunStats:
    """Transcribe `files` into `out_dir`; returns counts, audio seconds, wall time and stage times."""
    t_start = time.perf_counter()
    stats = RunStats()
    log_path = out_dir / "results.jsonl"
    stems = output_stems(files)
    todo, stats.files_skipped = plan_resume(files, log_path, force)
    # Longest first: the biggest batch meets the memory limit at once, and padding stays small.
    todo.sort(key=lambda f: -(f.duration if f.duration is not None else _header_seconds(f.path)))
    bar = _Progress(len(todo), enabled=sys.stderr.isatty() if progress is None else progress)

    with ResultsLog(log_path) as log:
        batcher = _Batcher(engine, batch_seconds)
        for loaded in _prefetch(todo, engine.sample_rate, decode_workers, ahead=16):
            stats.stage_seconds["decode_audio"] += loaded.seconds
            if loaded.error is not None:
                _finish_error(log, loaded.file, loaded.error, engine.name, stats)
                bar.step()
                continue
            pieces = split_long(loaded.audio, engine.sample_rate, engine.max_piece_seconds)
            for finished in batcher.add(loaded.file, loaded.audio, pieces):
                _finish_ok(log, finished, out_dir / stems[finished[0].path], formats, engine, stats)
                bar.step()
        for finished in batcher.flush():
            _finish_ok(log, finished, out_dir / stems[finished[0].path], formats, engine, stats)
            bar.step()
    bar.close()
    for k, v in engine.stage_seconds.items():
        stats.stage_seconds[k] += v
    stats.wall_seconds = time.perf_counter() - t_start
    return stats


def _header_seconds(path: Path) -> float:
    from transcribe.audio import audio_info

    try:
        return audio_info(path)[0]
    except AudioError:
        return 0.0


def _finish_ok(log: ResultsLog, finished, out_stem: Path, formats, engine, stats: RunStats) -> None:
    file, audio_seconds, result = finished
    t0 = time.perf_counter()
    write_outputs(result, out_stem, formats)
    log.append(
        {"audio_filepath": str(file.path), "duration": round(audio_seconds, 3), "text": result.text,
         "status": "ok", "error": None, "model": engine.name, **file_identity(file.path)}
    )
    stats.stage_seconds["write"] += time.perf_counter() - t0
    stats.files_ok += 1
    stats.audio_seconds += audio_seconds
    stats.texts[file.path] = result.text


def _finish_error(log: ResultsLog, file: InputFile, error: str, model: str, stats: RunStats) -> None:
    print(f"error: {error}", file=sys.stderr)
    log.append(
        {"audio_filepath": str(file.path), "duration": None, "text": "", "status": "error",
         "error": error, "model": model, **file_identity(file.path)}
    )
    stats.files_failed += 1


class _Batcher:
    """Collects pieces until the padded batch would exceed the budget, then runs the engine.

    Yields (file, audio seconds, stitched result) for every file whose pieces are all done.
    """

    def __init__(self, engine: Engine, batch_seconds: float):
        self.engine = engine
        self.budget = batch_seconds * engine.sample_rate  # padded samples per batch
        self.queue: list[tuple[int, np.ndarray]] = []  # (file index, piece)
        self.files: dict[int, list] = {}  # index -> [file, seconds, offsets, results, remaining]
        self.next_id = 0

    def add(self, file: InputFile, audio: np.ndarray, pieces: list[tuple[float, np.ndarray]]):
        fid = self.next_id
        self.next_id += 1
        self.files[fid] = [file, len(audio) / self.engine.sample_rate, [o for o, _ in pieces],
                           [None] * len(pieces), len(pieces)]
        out = []
        for k, (_, piece) in enumerate(pieces):
            longest = max([len(piece)] + [len(p) for _, _, p in self.queue])
            if self.queue and longest * (len(self.queue) + 1) > self.budget:
                out.extend(self._run())
            self.queue.append((fid, k, piece))
        return out

    def flush(self):
        return self._run() if self.queue else []

    def _run(self):
        batch, self.queue = self.queue, []
        results = self.engine.transcribe([p for _, _, p in batch])
        done = []
        for (fid, k, _), res in zip(batch, results):
            entry = self.files[fid]
            entry[3][k] = res
            entry[4] -= 1
            if entry[4] == 0:
                file, seconds, offsets, parts, _ = self.files.pop(fid)
                done.append((file, seconds, stitch(parts, offsets)))
        return done


class _Progress:
    """A one-line progress bar on stderr, only on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled and total > 0, time.perf_counter()

    def step(self) -> None:
        self.n += 1
        if self.enabled:
            frac = self.n / self.total
            bar = "#" * int(30 * frac)
            print(f"\r[{bar:<30}] {self.n}/{self.total} {time.perf_counter() - self.t0:6.1f}s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)
