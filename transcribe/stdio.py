"""Standard streams that cannot stop a job. A command's results are its files and results.jsonl;
what it writes to stderr (and, but for `stream`, to stdout) is said along the way. Under cron
or a batch scheduler that channel can break mid-run: `transcribe ... 2>&1 | head -1` closes the
pipe, a cron log's disk fills (ENOSPC), a terminal hangs up (EIO), or the command starts with a
stream closed (`2>&-`, where Python sets `sys.stderr` to None). Each of these made the first
`print` after it raise, and the job stopped with exit 1, files finished but not yet logged lost.

`steady_std_streams` makes such a failure silent: the broken descriptor is pointed at /dev/null
(so Python's last flush at exit, and the workers' lines the pool passes on, find it writable)
and the job goes on to its real exit status. Imports nothing heavy: it runs before the options
are checked.

A stream handed over non-blocking (a Node.js parent's pipe, a terminal another program left
O_NONBLOCK, some CI runners' log pipes) is made blocking, at the start and again before each
write: there a write the reader has not yet caught up with fails with EAGAIN, which is no
broken stream. Python's stderr dropped such lines without a word (a 250 KB log arrived as its
first 64 KB); stdout raised, which silenced the rest of the log (or ended `stream`, whose
stdout is not wrapped).
"""
from __future__ import annotations

import io
import os
import sys


class _Steady(io.TextIOBase):
    """`stream`, whose first failed write or flush points its descriptor at /dev/null: what
    was said until then stays said, and nothing later raises."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s: str) -> int:
        self._keep_blocking()
        try:
            self._stream.write(s)
        except (OSError, ValueError):  # ValueError: a stream closed under us
            self._silence()
        return len(s)

    def flush(self) -> None:
        self._keep_blocking()
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._silence()

    def _keep_blocking(self) -> None:
        """Another holder of the descriptor (a parent sharing our terminal) may make it
        non-blocking at any time, and Python's stderr then drops what the pipe cannot take at
        once, raising nothing. One fcntl a write is nothing beside a log line."""
        try:
            fd = self._stream.fileno()
            if not os.get_blocking(fd):
                os.set_blocking(fd, True)
        except (OSError, ValueError):  # no descriptor (a test's capture): nothing to keep
            pass

    def _silence(self) -> None:
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):
            self._stream = open(os.devnull, "w")
            return
        _to_devnull(fd)
        try:
            self._stream.flush()  # what it still held goes to /dev/null now
        except (OSError, ValueError):
            self._stream = open(os.devnull, "w")

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return self._stream.encoding

    @property
    def errors(self) -> str | None:
        return self._stream.errors


def _to_devnull(fd: int, flags: int = os.O_WRONLY) -> None:
    null = os.open(os.devnull, flags)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)
    # Inherited by the workers, as a standard stream is: `os.open` makes its descriptor private,
    # and where it took the closed number itself (`2>&-`) each worker started without a stderr
    # and died at its first flush, three deaths ending the run.
    os.set_inheritable(fd, True)


def steady_std_streams(stdout: bool = True) -> None:
    """Reopen closed descriptors 0-2 on /dev/null (else the run's lock file or a socket would
    take the number, and a later write to "stdout" would land in it), make 1 and 2 blocking,
    and make `sys.stderr`, and `sys.stdout` when `stdout`, streams whose failure is silent.
    `stream` keeps its stdout as it is: the transcript it prints there is its result, and a
    pipe that closes ends it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _to_devnull(fd, os.O_RDONLY if fd == 0 else os.O_WRONLY)
    for fd in (1, 2):
        if not os.get_blocking(fd):
            os.set_blocking(fd, True)
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)
    if not isinstance(sys.stderr, _Steady):
        sys.stderr = _Steady(sys.stderr)
    if stdout and not isinstance(sys.stdout, _Steady):
        sys.stdout = _Steady(sys.stdout)
