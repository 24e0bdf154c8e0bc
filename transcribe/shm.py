"""Shared-memory slab: fixed slots of float32 features that workers write and the engine reads.

One anonymous memory file holds `n_slots` slots of `slot_floats` float32 each. A worker writes
one piece's features [n_mels, F] at the start of a slot; the engine reads them through a numpy
view (no copy, no pickling) and frees the slot when the batch is done. Which slot is free is
decided by the main process alone (see `transcribe/workers.py`), so the slab itself holds no
locks that a killed worker could leave taken.

Why an anonymous file (Linux: memfd_create) handed to each worker by descriptor over its pipe,
and not a named POSIX segment in /dev/shm:
- nothing to clean up: the memory has no name, and the kernel frees it when the last process
  holding it exits, however it exits. A named segment outlived a SIGKILL of the whole process
  group (an OOM kill, a batch scheduler), 128 MiB at a time, until a later run swept it;
- no size limit but memory: /dev/shm is a tmpfs that Docker makes 64 MB by default, which
  forced smaller batches (or `--shm-size`) on every container.
Its pages are reserved at creation (posix_fallocate), so running out of memory is a clear
error at start (SharedMemoryTooSmall), never a SIGBUS in a worker's write. Where the OS has no
memfd_create, the file is a temporary one unlinked at once: same descriptor passing.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

FLOAT32 = 4  # bytes
MEMFD_NAME = "transcribe-slab"  # what /proc/<pid>/maps and fd/ show: /memfd:transcribe-slab (deleted)


class SharedMemoryTooSmall(Exception):
    """The memory for the smallest slab the job needs cannot be reserved."""


@dataclass(frozen=True)
class SlabSpec:
    """The slot geometry a worker needs besides the slab's descriptor."""

    n_slots: int
    slot_floats: int


class Slab:
    """An anonymous shared memory file cut into fixed float32 slots; `view(slot, shape)` reads/writes
    one. The creator keeps the descriptor open to `share` it with workers started later (a
    replaced worker); a worker's copy is closed once mapped."""

    def __init__(self, fd: int, spec: SlabSpec, owner: bool):
        self.spec, self.owner = spec, owner
        try:
            self._map = mmap.mmap(fd, self.nbytes)  # MAP_SHARED, read and write
        finally:
            if not owner:
                os.close(fd)  # the mapping keeps the memory; the descriptor is not needed again
        self._fd = fd if owner else -1

    @classmethod
    def create(cls, n_slots: int, slot_floats: int) -> "Slab":
        """A slab of `n_slots` slots with its pages reserved now; SharedMemoryTooSmall when the
        memory cannot be had."""
        if n_slots < 1 or slot_floats < 1:
            raise ValueError(f"slab needs at least one slot of one float, got {n_slots} x {slot_floats}")
        size = n_slots * slot_floats * FLOAT32
        fd = _anonymous_file()
        try:
            try:
                os.ftruncate(fd, size)
            except OSError as e:  # EFBIG under a `ulimit -f` below the slab's size (some HPC sites)
                raise SharedMemoryTooSmall(f"cannot size {size / 2**20:.0f} MiB of shared memory for the "
                                           f"workers' features ({e.strerror}; `ulimit -f`?)") from e
            _reserve(fd, size)
            return cls(fd, SlabSpec(n_slots, slot_floats), owner=True)
        except BaseException:
            os.close(fd)
            raise

    def share(self, conn) -> None:
        """Send the descriptor over `conn`, a multiprocessing Connection (a Unix socket pair),
        for `attach` at the other end. OSError if that end is gone."""
        send_handle(conn, self._fd, 0)  # the destination pid only matters on Windows

    @classmethod
    def attach(cls, spec: SlabSpec, conn) -> "Slab":
        """The slab whose descriptor `share` sent over `conn`."""
        return cls(recv_handle(conn), spec, owner=False)

    @property
    def nbytes(self) -> int:
        return self.spec.n_slots * self.spec.slot_floats * FLOAT32

    def view(self, slot: int, shape: tuple[int, int]) -> np.ndarray:
        """float32 [rows, cols] C-contiguous at the start of `slot`; shares the slab's memory."""
        if not 0 <= slot < self.spec.n_slots or shape[0] * shape[1] > self.spec.slot_floats:
            raise ValueError(f"slot {slot} shape {shape} does not fit {self.spec}")
        offset = slot * self.spec.slot_floats * FLOAT32
        return np.ndarray(shape, dtype=np.float32, buffer=self._map, offset=offset)

    def close(self) -> None:
        """Close the descriptor and unmap. Safe to call twice."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive (e.g. in a traceback); the mapping goes with the process

    def __enter__(self) -> "Slab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    with tempfile.TemporaryFile(prefix="transcribe-slab-") as f:  # unlinked at once (POSIX)
        return os.dup(f.fileno())


def _reserve(fd: int, size: int) -> None:
    """Allocate the pages now, so that memory running out fails here, cleanly, not as a SIGBUS
    in a worker's write."""
    if not hasattr(os, "posix_fallocate"):
        return  # (macOS) nothing to reserve through: pages come on first write
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise SharedMemoryTooSmall(f"cannot reserve {size / 2**20:.0f} MiB of shared memory for the "
                                   f"workers' features ({e.strerror})") from e
