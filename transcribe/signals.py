"""SIGINT and the other signals that stop a job (`STOP_SIGNALS`), for a transcribing command:
SIGINT remembered from the command's start (`remember_sigint`), each raised as `Interrupted` in
the main thread while the job runs (`signals_raise`), and forgotten once said, so that a later
job in the same process starts afresh. Imports no torch: the command line checks its options
before torch's seconds of import.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator


# Each ends a job as SIGTERM does: the files finished are written, the command says so and exits
# 128 + the signal. Besides ^C and `kill`: SIGHUP, a terminal closed under a job run without
# nohup; SIGUSR1 / SIGUSR2, what Slurm's `--signal` sends to warn of a time limit; SIGXCPU, a
# soft CPU-time limit set below the hard one (RLIMIT_CPU, as some schedulers set it). Their
# default action killed the process at once, dropping the files transcribed but not yet handed
# to the writer.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU)


class Interrupted(BaseException):
    """A signal of STOP_SIGNALS arrived; everything finished before it is written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The stop signals received, besides the exception its handler raises: a raise that lands in
# a __del__ or a weakref callback is printed as "Exception ignored" and swallowed (a ^C during
# the model's load was lost so once in ~80 tries, and that run went on to the end and exited
# 0). The job checks this on entry and between batches, so a lost ^C still stops it.
_received: list[int] = []


def remember_sigint() -> None:
    """From a command's start (main thread): ^C raises KeyboardInterrupt, as Python's default
    handler does, and is remembered for the job."""
    if threading.current_thread() is threading.main_thread():
        _received.clear()
        if not _ignored(signal.SIGINT):
            signal.signal(signal.SIGINT, _sigint_before_the_job)


def _ignored(signum: int) -> bool:
    """The signal was ignored when this process started (a job started with `&` from a script,
    `nohup`): it stays ignored, as programs keep an inherited SIG_IGN, and as Python does."""
    return signal.getsignal(signum) is signal.SIG_IGN


def _sigint_before_the_job(signum, frame) -> None:
    _received.append(signum)
    signal.default_int_handler(signum, frame)


def stop_if_signalled() -> None:
    """Raise Interrupted if a stop signal came (since `remember_sigint`), said or not."""
    if _received:
        raise Interrupted(_received[-1])


def exit_at_once_on_sigint() -> None:
    """The command is ending on a signal with its work written: a further ^C (an impatient
    second press) ends it at once, by SIGINT (a shell reads 130). Python's handler, back once the job was left, raised
    KeyboardInterrupt into whatever ran then: an atexit callback printed "Exception ignored"
    and a traceback, and the process died by the signal. For the command line's own process
    only, which is leaving."""
    if threading.current_thread() is threading.main_thread() and not _ignored(signal.SIGINT):
        signal.signal(signal.SIGINT, _exit_now)


def _exit_now(signum, frame) -> None:
    end_by_signal(signum)


def end_by_signal(signum: int) -> None:
    """End this process by `signum` itself, its default action, once what it printed is
    flushed: a shell loop (`for d in */; do transcribe "$d"; done`) stops at a ^C only when
    its child died by the signal, and an exit status of 130 let it go on to the next folder.
    A shell still reads 128 + the signal. `os._exit` with that status should the signal not
    end the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, a closed pipe or stream
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def forget_signals() -> None:
    """The signals received so far have been said (the command reported its interruption):
    a later job in this process, a library caller's, is not stopped by them."""
    _received.clear()


@contextmanager
def signals_raise() -> Iterator[None]:
    """The STOP_SIGNALS raise `Interrupted` in the main thread while the job runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS if not _ignored(s)}
    try:
        stop_if_signalled()  # one whose raise was lost before the job began
        yield
    finally:
        forget_signals()  # said: a later job in this process starts afresh
        for s, h in old.items():
            signal.signal(s, h)
