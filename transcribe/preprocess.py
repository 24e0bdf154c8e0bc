"""What runs in a preprocessing worker process: one file at a time -> features in slab slots.

The file is streamed (`transcribe/decode.py`: soundfile blocks or PyAV, downmix, resampling), cut at
pauses (`segmenting.PieceCutter`), and each piece's features (the engine's `frontend`) are
written into a slot the main process granted; a `Piece` descriptor goes back over the pipe.
Protocol on the worker's pipe (main -> worker): ("attach", slab spec, frontend bytes) once, followed
by the slab's descriptor (`Slab.share`: SCM_RIGHTS over the pipe's socket), then
("file", fid, path, span: (start s, length s) of a segment or None), ("slot", slot), ("stop",);
(worker -> main): ("ready", has stderr file) once, followed by that memory file's descriptor if it
has one (`NamedStderr`), then per file ("start", fid, header seconds bounded by the file's size), ("slot?",), ("piece", Piece),
("done", fid, n_pieces, samples, stage seconds), ("error", fid, reason, stage seconds).
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.reduction import send_handle

import numpy as np

from transcribe.decode import AudioError, AudioStream
from transcribe.segmenting import PieceCutter
from transcribe.shm import Slab, SlabSpec
from transcribe.signals import STOP_SIGNALS

WORKERS_IGNORE = tuple(s for s in STOP_SIGNALS if s != signal.SIGTERM)


@dataclass(frozen=True)
class Piece:
    """One piece's frontend output in the slab: float32 [n_mels, frames] at the start of `slot`
    (with features on the device, its audio: n_mels = 1, frames = samples)."""

    fid: int
    index: int  # position in its file
    slot: int
    n_mels: int
    frames: int
    offset_s: float  # start in the file (s)
    samples: int  # audio samples at the model's rate


class _Stop(Exception):
    """The main process asked this worker to stop while it waited for a slot."""


def worker_boot(conn) -> None:
    """Process entry: imports first, then wait for ("attach", slab spec, pickled frontend).

    Split from `worker_main` so workers can be spawned while the main process still loads the
    model (`workers.Prespawned`): the ~1.5 s of interpreter start and torch import overlap
    the load instead of following it."""
    # ^C, SIGHUP or SIGUSR1 to the process group reaches every worker; the main process stops
    # the workers in order (one killed by the signal first had its file fail as "worker process
    # died"). They came blocked from `workers._spawn`: ignored first, then unblocked, one
    # pending is dropped. Not SIGTERM: multiprocessing's exit handler stops a worker the job
    # left behind with it (ignored, the exit hung in its join). A worker also dies with the
    # main process (`_die_with_parent`).
    for s in WORKERS_IGNORE:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKERS_IGNORE)
    _die_with_parent()
    import torch

    torch.set_num_threads(1)  # one core per worker; the model keeps the main process's threads
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return  # never used: the job ended (nothing to do, or the model failed to load)
    if msg[0] == "attach":
        worker_main(conn, msg[1], msg[2])


def worker_main(conn, spec: SlabSpec, frontend_bytes: bytes) -> None:
    slab = Slab.attach(spec, conn)  # its descriptor follows the "attach" message
    frontend = pickle.loads(frontend_bytes)
    frontend(np.zeros(frontend.sample_rate, np.float32))  # build the module now, not on file one
    gc.freeze()
    stderr = NamedStderr()
    try:
        conn.send(("ready", stderr.fd is not None))
        if stderr.fd is not None:
            send_handle(conn, stderr.fd, 0)  # for the pool to read should this worker die mid-file
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
            try:
                stderr.path = msg[2]
                reply = _one_file(conn, slab, frontend, msg[1], msg[2], msg[3], stderr)
            finally:
                stderr.forward(end=True)
            conn.send(reply)
    except (EOFError, BrokenPipeError, _Stop):
        pass  # the main process is gone or stopping us
    finally:
        stderr.close()
        slab.close()


class NamedStderr:
    """What a C library writes to stderr in this worker, each line under the file's name.

    libmpg123 says "Note: Illegal Audio-MPEG-Header 0x77ee87a1 at offset 18861." of a damaged
    MP3 and names no file; among thousands of files that tells the user nothing. A worker reads
    one file at a time, so its fd 2 goes to an anonymous memory file (`fd`), and `forward`
    (after each block and at the file's end) passes the lines on to the real stderr as
    `PATH: line`. The pool holds the same memory file (sent with "ready"): what a decoder said
    just before it crashed or hung there is read and named by the pool when it replaces the
    worker (`workers.WorkerPool._replace`). Without memfd_create (not Linux) stderr is left alone."""

    def __init__(self) -> None:
        self.path = ""
        self.fd: int | None = None
        try:
            fd = os.memfd_create("transcribe-stderr", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return
        sys.stderr.flush()
        self._real = os.dup(2)
        os.dup2(fd, 2)  # fd 2 shares the memory file's offset: rewinding one rewinds both
        self.fd = fd

    def forward(self, end: bool = False) -> None:
        """Pass on the whole lines written so far (and, at the file's `end`, a last partial one)."""
        if self.fd is None:
            return
        sys.stderr.flush()
        size = os.fstat(self.fd).st_size
        if not size:
            return
        text = os.pread(self.fd, size, 0)
        keep = b"" if end else text[text.rfind(b"\n") + 1:]  # a line still being written waits
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        if keep:
            os.write(self.fd, keep)
        write_named_lines(self._real, self.path, text[:len(text) - len(keep)])

    def close(self) -> None:
        if self.fd is None:
            return
        try:
            self.forward(end=True)
        finally:
            os.dup2(self._real, 2)
            os.close(self._real)
            os.close(self.fd)
            self.fd = None


def write_named_lines(fd: int, path: str, text: bytes) -> None:
    """`text`'s lines to `fd`, each as `PATH: line`, one write per line (a line under 4 KB stays
    whole in a pipe shared with the other workers). A stderr that takes no more (a closed or
    full pipe) loses them, as it would a C library's own fprintf, and the file goes on."""
    prefix = f"{path}: ".encode(errors="surrogateescape")
    for line in text.splitlines():
        data = prefix + line + b"\n"
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            return


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the main process dies, even by SIGKILL."""
    import ctypes
    from multiprocessing import parent_process

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return  # not glibc Linux: the closed pipe still ends the worker at its next message
    libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    parent = parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(0)  # the parent died before prctl took effect


def _one_file(conn, slab: Slab, frontend, fid: int, path: str, span=None, stderr: NamedStderr | None = None) -> tuple:
    """Preprocess one file (or its `span`) into slots; returns its closing message ("done" or "error")."""
    stages: dict[str, float] = defaultdict(float)
    try:
        with AudioStream(path, frontend.sample_rate, span=span) as stream:
            conn.send(("start", fid, stream.timeout_seconds, stream.duration))
            n = _pieces(conn, slab, frontend, fid, stream, stages, stderr)
        return ("done", fid, n, stream.samples, dict(stages))
    except AudioError as e:
        return ("error", fid, str(e), dict(stages))
    except (EOFError, BrokenPipeError, _Stop):
        raise
    except Exception as e:  # noqa: BLE001 -- a decoder or frontend failure on odd input must fail
        # this file alone, with its reason, and leave the worker serving the next files
        return ("error", fid, f"{path}: {type(e).__name__}: {e}", dict(stages))


def _pieces(conn, slab: Slab, frontend, fid: int, stream: AudioStream, stages: dict,
            stderr: NamedStderr | None = None) -> int:
    cutter = PieceCutter(frontend.sample_rate, frontend.max_piece_seconds, frontend.cut_seconds)
    blocks = stream.blocks()
    n = 0
    while True:
        t0 = time.perf_counter()
        block = next(blocks, None)
        t1 = time.perf_counter()
        if stderr is not None:
            stderr.forward()  # as it comes: a file that then hangs has said its part
        cut = cutter.push(block) if block is not None else cutter.finish()
        stages["preprocess_decode"] += t1 - t0
        stages["preprocess_vad_cut"] += time.perf_counter() - t1
        for offset, audio in cut:
            _send_piece(conn, slab, frontend, fid, n, offset, audio, stages)
            n += 1
        if block is None:
            return n


def _send_piece(conn, slab: Slab, frontend, fid: int, index: int, offset: int, audio: np.ndarray,
                stages: dict) -> None:
    t0 = time.perf_counter()
    feats = frontend(audio)
    stages["preprocess_features"] += time.perf_counter() - t0
    if feats.dtype != np.float32 or feats.ndim != 2 or feats.size > slab.spec.slot_floats:
        raise ValueError(f"frontend gave {feats.dtype} {feats.shape}; a slot holds {slab.spec.slot_floats} float32")
    conn.send(("slot?",))
    msg = conn.recv()  # blocks while the slab is full
    if msg[0] != "slot":
        raise _Stop()
    t0 = time.perf_counter()
    slab.view(msg[1], feats.shape)[...] = feats
    stages["preprocess_to_slab"] += time.perf_counter() - t0
    conn.send(("piece", Piece(fid, index, msg[1], feats.shape[0], feats.shape[1],
                              offset / frontend.sample_rate, audio.shape[0])))
