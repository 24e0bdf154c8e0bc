"""`transcribe serve`'s model in a process of its own: the pool steps there, the event loop here.

Why: a streaming step is thousands of small torch ops (the label-looping decoder's loop, a
chunk's encoder layers), and between two ops the step thread needs the GIL back. In one
process it waits for the event loop, which holds the GIL for most of its work (parsing
audio messages, log-mel, building transcripts, asyncio itself): on the 2-core VM a thread
holding the GIL half the time made the same step 2.3x slower (a 14-chunk step of the tiny
cache-aware model, 50 ms alone, 112-120 ms beside it), and at 100 real-time 60 s streams
the server's steps ran at a third of their speed alone. In its own process the step keeps a
core to itself, as the pipeline's workers do for decoding and log-mel.

The split: the engine process loads the model and builds the slot pool (`StreamingModel`,
`new_pool`) and then only steps it: each request is the resets of slots released since the
last step and the step's chunks, each answer the step's hypotheses and the pool's seconds per
stage. The server process keeps the `StreamingFront` it sends over at startup (sessions,
features, transcripts: no weights) and a `RemotePool`, which hands out slot indices itself
and forwards steps and resets. Features and audio travel as numpy arrays through a pipe
(a 100-chunk step of the tiny model is ~3 MB; pickled in a few ms, next to its ~100 ms).

Failures: a load error (bad checkpoint, an option the model does not take) is raised in the
server process as the same exception, so the CLI says it as before; a step's exception is
raised by `RemotePool.step` as `StepFailed` (its streams fail, the server goes on); an engine
process that dies (killed, out of memory) raises `EngineDied`, and the server stops (exit 1),
as when its engine loop fails. The engine process ignores the stop signals (a terminal's ^C or
hang-up, or a stop signal to the whole process group, is the server's to handle) and exits when the
server closes the pipe, or goes away without closing it.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import pickle
import signal
import threading
from typing import Any, Sequence

import numpy as np
import torch

from engines.decode_stages import Hypothesis
from engines.slot_pool import SlotPool
from transcribe.signals import STOP_SIGNALS
from transcribe.streaming.protocol import describe

log = logging.getLogger("transcribe")
READY_POLL_S = 0.5  # how often the wait for a loading engine checks that it is still alive


class EngineDied(RuntimeError):
    """The engine process is gone: no step can run any more."""


class StepFailed(RuntimeError):
    """A step raised in the engine process (the message names the exception; its traceback was
    logged there). The pool is still there: the step's streams fail, the others go on."""


def _to_wire(chunk: Any) -> Any:
    """A chunk dataclass (`ChunkInput`, `ChunkWindow`) with its tensors as numpy arrays: plain
    pickling (torch's would pass CPU tensors through shared-memory file descriptors, one per
    tensor per step)."""
    return dataclasses.replace(chunk, **{f.name: getattr(chunk, f.name).numpy() for f in dataclasses.fields(chunk)
                                         if isinstance(getattr(chunk, f.name), torch.Tensor)})


def _from_wire(chunk: Any) -> Any:
    return dataclasses.replace(chunk, **{f.name: torch.from_numpy(getattr(chunk, f.name))
                                         for f in dataclasses.fields(chunk)
                                         if isinstance(getattr(chunk, f.name), np.ndarray)})


def _picklable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (ours do: OptionError, ValueError, OSError), else a
    RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(describe(e))


def _engine_main(conn, load_args: dict, max_streams: int, log_level: int) -> None:
    """The engine process: load, send the front (or the load error), then step until the pipe
    closes (or a None request). The stop signals are the server's (`signals.STOP_SIGNALS`): a
    ^C, a closed terminal's SIGHUP or a `kill` of the whole process group (systemd's stop)
    reaching this process first must not fail the step in flight and turn the server's clean
    stop (exit 128 + the signal) into an engine failure (exit 1)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    from transcribe import heap
    from transcribe.streaming.cli_commands import load_streaming_model, log_to_stderr

    log_to_stderr(log_level, "%(asctime)s %(levelname)s [engine] %(message)s")
    # A core is the event loop's: it builds transcripts and features while a step runs here
    # (the server's steps are pipelined). Threads that share it get descheduled mid-op and the
    # others wait for them: on the 2-core VM the encoder's two threads took 34 s of a 60 s
    # load against 21 s on one.
    torch.set_num_threads(max(torch.get_num_threads() - 1, 1))
    try:
        sm = load_streaming_model(**load_args)
        pool = sm.new_pool(max_streams)
    except BaseException as e:  # the server process raises it: the CLI says it and exits as before
        conn.send(("error", _picklable(e)))
        return
    conn.send(("ready", sm.front))
    gc.collect()
    gc.freeze()  # the model and pool live as long as the process: keep them out of every collection
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if request is None:
            return
        resets, chunks = request
        for slot in resets:  # released by the server since the last step: fresh for their next stream
            pool.reset(slot)
        try:
            hyps = pool.step([_from_wire(c) for c in chunks])
        except Exception as e:
            log.exception("stream step failed")
            answer = ("error", describe(e))
        else:
            answer = ("ok", hyps, dict(pool.stage_seconds))
        try:
            conn.send(answer)
        except OSError:  # the server went away during the step (killed): nobody to answer
            return
        heap.trim()  # at most once a second: shapes vary with every step (transcribe/heap.py)


class RemotePool(SlotPool):
    """A slot pool whose state lives in the engine process: slot indices are handed out here
    (`SlotPool`); a released slot is reset there before the next step's chunks run; `step`
    sends the chunks and waits for the hypotheses (the server calls it from its step thread,
    where the wait holds no GIL). Use as a context manager, or `close()`."""

    def __init__(self, load_args: dict, max_streams: int, log_level: int = logging.INFO):
        """load_args: `load_streaming_model`'s keyword arguments. Returns once the model is
        loaded and the pool built there; raises the engine's load error, or EngineDied."""
        super().__init__(max_streams)
        self.stage_seconds: dict[str, float] = {}
        self._resets: list[int] = []
        self._lock = threading.Lock()  # resets come from the event loop, steps from the step thread
        ctx = multiprocessing.get_context("spawn")  # never fork a process with torch's threads running
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child, load_args, max_streams, log_level),
                                   name="transcribe-engine", daemon=True)
        self.process.start()
        child.close()  # ours is the only other end: its death shows as EOF on our side
        try:
            kind, payload = self._recv_waiting()
        except BaseException:  # it died loading, or ^C here while it loads: not left running
            self.process.kill()
            self._conn.close()
            raise
        if kind == "error":
            self.close()
            raise payload
        self.front = payload

    def _recv_waiting(self):
        """The next message, checking while waiting that the engine is still alive (a model
        load takes seconds to minutes; a process killed meanwhile must not hang us)."""
        while not self._conn.poll(READY_POLL_S):
            if not self.process.is_alive():
                break
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> EngineDied:
        self.process.join(5.0)  # its exit status, once it has one
        return EngineDied(f"the engine process exited (status {self.process.exitcode})")

    def _reset(self, slot: int) -> None:
        with self._lock:
            self._resets.append(slot)

    def step(self, chunks: Sequence) -> list[Hypothesis]:
        """Run one step there: StepFailed if it raised, EngineDied if the process is gone."""
        with self._lock:
            resets, self._resets = self._resets, []
        try:
            self._conn.send((resets, [_to_wire(c) for c in chunks]))
        except OSError:  # BrokenPipeError, ConnectionError: it is gone
            raise self._died() from None
        answer = self._recv_waiting()
        if answer[0] == "error":
            raise StepFailed(answer[1])
        _, hyps, self.stage_seconds = answer
        return hyps

    def close(self) -> None:
        """Stop the engine process (a clean exit, else killed after 10 s: it ignores SIGTERM)."""
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass  # already gone
        self._conn.close()
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def __enter__(self) -> "RemotePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
