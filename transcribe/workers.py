"""Preprocessing workers: processes that turn audio files into features in shared-memory slots.

Each worker (started with 'spawn': torch and fork do not mix) takes one file at a time, streams
it (`transcribe/decode.py`), cuts it at pauses (`segmenting.PieceCutter`), computes each piece's
features with the engine's picklable `frontend`, asks for a free slot, writes the features
there and sends a small `Piece` descriptor. Every message goes over the worker's own pipe and
only the main process hands out slots, so a worker killed at any moment leaves no lock taken
and the main process knows which slots it held.

The main-process side, `WorkerPool`, runs on its own thread so that workers get files and
slots while the model computes (torch releases the GIL). It grants slots (a worker asking
while the slab is full waits: bounded memory) and turns worker deaths and hangs (a deadline
per file, scaled by its duration, paused while the worker waits for a slot) into a failed file
and a fresh worker. The pipeline reads `events` and gives slots back with `release`.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from multiprocessing import get_context, resource_tracker
from multiprocessing.connection import wait
from multiprocessing.reduction import recv_handle

from transcribe.preprocess import WORKERS_IGNORE, Piece, worker_boot, write_named_lines
from transcribe.shm import Slab

__all__ = ["FileTimeout", "Piece", "Prespawned", "WorkerPool", "WorkerStartError", "default_workers"]

MAX_WAIT_S = 0.5  # the pool thread wakes at least this often to check deadlines
STARTUP_S = 300.0  # a worker not ready this long after "attach" (imports, frontend warm-up) is stuck
# A pool-thread loop this much longer than MAX_WAIT_S: the job was stopped (SIGSTOP, ^Z, Slurm's
# suspend, a frozen cgroup), not its workers hung; every clock is moved on by the gap.
STALL_S = 5.0
MAX_START_FAILURES = 3  # workers dying before ready this many times in a row: give up
# A worker computes on one thread in every library it loads (one worker per core, by design):
# numpy's OpenBLAS, which the resampler's products run on, started a thread per core in each
# worker, and 44.1 kHz audio resampled 10-170x slower on a busy machine, taking the model's
# cores. Read by the libraries as they load, so set in the environment a worker starts with.
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


class WorkerStartError(RuntimeError):
    """Workers keep dying before they are ready (e.g. a broken install): nothing can run."""


@dataclass(frozen=True)
class FileTimeout:
    """A file fails as hung after base_s + per_audio_s * its duration of preprocessing."""

    base_s: float = 60.0  # covers a worker's start (imports) and opening the file
    per_audio_s: float = 0.1  # 10x slower than real time: far below any healthy worker

    def limit(self, duration_s: float) -> float:
        return self.base_s + self.per_audio_s * max(duration_s, 0.0)


def default_workers() -> int:
    """Workers when --workers is not given: on 2 cores 1 (the model needs the other), else half."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cpus <= 2 else min(8, cpus // 2)


class Prespawned:
    """Worker processes started before the model is loaded, waiting for their slab and frontend.

    Spawning costs ~1.5 s per process (interpreter, torch import) that would otherwise follow
    the model load; `WorkerPool` takes these first and spawns only what is missing. Processes
    never taken are stopped by `close` (a closed pipe ends them; the kernel kills them with the
    main process in any case)."""

    def __init__(self, n: int):
        self._ctx = get_context("spawn")
        self._spare: list[tuple[object, object]] = [_spawn(self._ctx) for _ in range(max(n, 0))]

    def take(self) -> tuple[object, object] | None:
        return self._spare.pop() if self._spare else None

    def close(self, grace_s: float = 2.0) -> None:
        """Stop the spares: a closed pipe ends a waiting one; all share one `grace_s` (a ^C
        during the load waited 2 s for each spare still importing torch: 9 s with 8)."""
        spares, self._spare = self._spare, []
        for _, conn in spares:
            conn.close()  # EOF: the waiting worker returns
        deadline = time.monotonic() + grace_s
        for process, _ in spares:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> "Prespawned":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cannot_start(e: OSError) -> WorkerStartError:
    """A worker's spawn failed: no process or descriptor to be had (a cluster's limit), the
    working folder removed."""
    return WorkerStartError(f"cannot start a preprocessing worker: {e.strerror or e}")


def _spawn(ctx) -> tuple[object, object]:
    try:  # the tracker's fork and the pipe fail first under a process or descriptor limit
        resource_tracker.ensure_running()
        parent, child = ctx.Pipe(duplex=True)
    except OSError as e:
        raise _cannot_start(e) from e
    p = ctx.Process(target=worker_boot, args=(child,), daemon=True, name="transcribe-preprocess")
    # The signals a worker ignores blocked while it starts: the child inherits the mask, so a
    # ^C (or a SIGHUP) to the process group in its first seconds (before worker_boot ignores
    # them) waits, and is then ignored, rather than printing a KeyboardInterrupt traceback from
    # its imports or killing it. Ours arrives after. The resource tracker is started first
    # (above): starting it unblocks SIGINT (its own mask dance).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKERS_IGNORE)
    saved = {k: os.environ.get(k) for k in ONE_THREAD}
    os.environ.update(ONE_THREAD)
    try:
        p.start()
    except OSError as e:
        parent.close()
        child.close()
        raise _cannot_start(e) from e
    finally:
        for k, v in saved.items():  # ours as it was: the model keeps its threads
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    child.close()  # so the worker's death reads as EOF here
    return p, parent


@dataclass
class _Worker:
    process: object
    conn: object
    started: float
    ready: bool = False  # imports done, frontend warm: its file deadlines start counting
    fid: int | None = None  # the file it is on
    path: str = ""
    span: tuple[float, float | None] | None = None  # a segment of the file (InputFile.span)
    deadline: float = 0.0
    limit: float = 0.0
    seconds: float | None = None  # its file's length, from the header, once it has opened it
    waiting_since: float | None = None  # asked for a slot, none free yet
    granted: set[int] = field(default_factory=set)  # slots given, not yet sent back in a Piece
    stderr: int | None = None  # its fd 2's memory file (preprocess.NamedStderr), once ready


class WorkerPool:
    """Files in (`submit`), events out (`events`): ("piece", Piece), ("done", fid, n_pieces,
    samples), ("error", fid, why, seconds: the file's length if its header was read, else
    None); a bug in the pool thread arrives as ("fatal", exception)."""

    def __init__(self, frontend, slab: Slab, n_workers: int, timeout: FileTimeout = FileTimeout(),
                 prespawned: Prespawned | None = None):
        if n_workers < 1:
            raise ValueError(f"need at least one worker, got {n_workers}")
        self._ctx = get_context("spawn")
        self._frontend = pickle.dumps(frontend)  # plain pickle: no torch shared-memory tensors
        self._rate = frontend.sample_rate
        self._slab = slab
        self.timeout = timeout
        self.events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.stage_seconds: dict[str, float] = defaultdict(float)
        # The workers' peak resident memory, summed as each one ends (the bench report's).
        self.peak_rss_bytes = 0
        self._free: deque[int] = deque(range(slab.spec.n_slots))
        self._released: deque[int] = deque()  # from the pipeline's thread
        self._queue: deque[tuple[int, str, tuple | None]] = deque()  # (fid, path, span)
        self._waiting: deque[_Worker] = deque()
        self._start_failures = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._prespawned = prespawned
        self._last_step = time.monotonic()
        self._workers = [self._start() for _ in range(n_workers)]
        self._thread = threading.Thread(target=self._serve, name="transcribe-pool", daemon=True)
        self._thread.start()

    def _start(self) -> _Worker:
        """A worker: a prespawned process if one is left, else a new one; then attach it."""
        spare = self._prespawned.take() if self._prespawned is not None else None
        p, conn = spare if spare is not None else _spawn(self._ctx)
        # Its startup clock starts now: a prespawned worker waited for the model to load, and
        # a load over STARTUP_S (a first TensorRT build, a cold download) killed the spares.
        w = _Worker(p, conn, time.monotonic())
        self._send(w, ("attach", self._slab.spec, self._frontend))  # a dead one is replaced on EOF
        try:
            self._slab.share(w.conn)  # the slab's descriptor, right behind the message
        except OSError:
            pass  # as in _send
        return w

    # -- called from the pipeline's thread ----------------------------------------------------
    def submit(self, fid: int, path: str, span: tuple[float, float | None] | None = None) -> None:
        self._queue.append((fid, path, span))
        self._wake()

    def release(self, slots: list[int]) -> None:
        self._released.extend(slots)
        self._wake()

    @property
    def starved(self) -> bool:
        """A worker waits for a slot: the pipeline should run a batch to free some."""
        return bool(self._waiting)

    def close(self, grace_s: float = 2.0) -> None:
        """Stop the thread and every worker (ask, wait up to `grace_s`, then kill)."""
        self._stop.set()
        self._wake()
        self._thread.join()
        self.peak_rss_bytes += sum(_peak_rss_bytes(w.process.pid) for w in self._workers)
        for w in self._workers:
            try:
                w.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass  # already gone
        deadline = time.monotonic() + grace_s
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
            if w.stderr is not None:
                os.close(w.stderr)
        self._workers = []
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_w = -1  # a late release() must not write into a reused descriptor

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.close(2.0 if exc_type is None else 0.0)  # interrupted or failing: no waiting

    def _wake(self) -> None:
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    @staticmethod
    def _send(w: _Worker, msg: tuple) -> None:
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # it just died: its sentinel fires next and _replace fails its file

    # -- the pool thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception as e:  # noqa: BLE001 -- a bug here must stop the job, not hang it
            self.events.put(("fatal", e))

    def _step(self) -> None:
        now = time.monotonic()
        while self._released:
            self._free.append(self._released.popleft())
        while self._waiting and self._free:
            self._grant(self._waiting.popleft(), now)
        for w in self._workers:
            if w.ready and w.fid is None and self._queue:
                w.fid, w.path, w.span = self._queue.popleft()
                w.limit = self.timeout.limit(0.0)
                w.deadline = now + w.limit
                self._send(w, ("file", w.fid, w.path, w.span))
        ready = wait([w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
                     + [self._wake_r], MAX_WAIT_S)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        now = time.monotonic()
        self._move_clocks(now - self._last_step)
        self._last_step = now
        for w in list(self._workers):
            if w.conn in ready or w.process.sentinel in ready:
                self._drain(w, now)
        for w in list(self._workers):
            if w.fid is not None and w.waiting_since is None and now > w.deadline:
                w.process.kill()
                self._replace(w, f"timed out after {w.limit:.0f} s (preprocessing hung)")
            elif not w.ready and now - w.started > STARTUP_S:
                w.process.kill()
                self._replace(w, f"not ready after {STARTUP_S:.0f} s")

    def _move_clocks(self, elapsed: float) -> None:
        """After a stop of the whole job (a loop of `elapsed` s, over STALL_S), push every
        deadline and startup clock on by the time stopped: resumed after a minute, its files
        in flight failed as hung."""
        if elapsed <= STALL_S:
            return
        for w in self._workers:
            w.started += elapsed
            if w.waiting_since is None:  # a waiting one's wait is added to its deadline anyway
                w.deadline += elapsed

    def _grant(self, w: _Worker, now: float) -> None:
        slot = self._free.popleft()
        w.granted.add(slot)
        if w.waiting_since is not None:
            w.deadline += now - w.waiting_since  # waiting for the engine is not hanging
            w.waiting_since = None
        self._send(w, ("slot", slot))

    def _drain(self, w: _Worker, now: float) -> None:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), now)
        except (EOFError, OSError):
            pass  # the worker is gone; its exit code says how below
        if not w.process.is_alive():
            w.process.join()
            self._replace(w, f"worker process died ({_exit_reason(w.process.exitcode)})")

    def _handle(self, w: _Worker, msg: tuple, now: float) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready, self._start_failures = True, 0
            if msg[1]:
                w.stderr = recv_handle(w.conn)  # right behind the message
        elif kind == "slot?":
            if self._free:
                self._grant(w, now)
            else:
                w.waiting_since = now
                self._waiting.append(w)
        elif kind == "start":
            w.limit, w.seconds = self.timeout.limit(msg[2]), msg[3]
            w.deadline = now + w.limit
        elif kind == "piece":
            w.granted.discard(msg[1].slot)
            # Progress: it has a piece's allowance from here (slow storage read a long file
            # below 10x real time, and it was killed as hung with 70 % of it sent).
            renewed = self.timeout.limit(msg[1].samples / self._rate)
            if now + renewed > w.deadline:  # the message then names the allowance that ran out
                w.deadline, w.limit = now + renewed, renewed
            self.events.put(msg)
        else:  # "done" or "error": the file is over, the worker is free
            for k, v in msg[-1].items():
                self.stage_seconds[k] += v
            self.events.put(msg[:-1] + ((w.seconds,) if kind == "error" else ()))
            self._free.extend(w.granted)  # granted but unused: the file failed after asking
            w.granted.clear()
            w.fid, w.path, w.seconds = None, "", None

    def _replace(self, w: _Worker, why: str) -> None:
        """A dead or killed worker: fail its file, take back its slots, start another."""
        self.peak_rss_bytes += _peak_rss_bytes(w.process.pid)  # 0 once it has died: the kernel forgot
        w.process.join()
        if not w.ready:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                raise WorkerStartError(f"preprocessing workers cannot start: {why}")
        if w.stderr is not None:
            if w.fid is not None:  # what its decoder said last, before it died or hung
                size = os.fstat(w.stderr).st_size
                write_named_lines(2, w.path, os.pread(w.stderr, size, 0) if size else b"")
            os.close(w.stderr)
            w.stderr = None
        if w.fid is not None:
            self.events.put(("error", w.fid, f"{w.path}: {why}", w.seconds))
        self._free.extend(w.granted)
        if w in self._waiting:
            self._waiting.remove(w)
        w.conn.close()
        # Out of the list before its replacement spawns: a spawn that fails (no more processes
        # under a cluster's limit) leaves no dead worker for `close` to close again, whose
        # "Bad file descriptor" hid the real error.
        i = self._workers.index(w)
        del self._workers[i]
        self._workers.insert(i, self._start())


def _peak_rss_bytes(pid: int) -> int:
    """A live process's peak resident memory (Linux's VmHWM), 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
