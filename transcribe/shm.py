"""Shared-memory slab: fixed slots of float32 features that workers write and the engine reads.

One POSIX shared-memory segment holds `n_slots` slots of `slot_floats` float32 each. A worker
writes one piece's features [n_mels, F] at the start of a slot; the engine reads them through a
numpy view (no copy, no pickling) and frees the slot when the batch is done. Which slot is free
is decided by the main process alone (see `transcribe/workers.py`), so the slab itself holds no
locks that a killed worker could leave taken.

Cleanup, so /dev/shm never keeps a segment of ours: the creating process unlinks it on every
normal or exceptional exit; multiprocessing's resource tracker unlinks it if that process is
killed; and `sweep_stale()` at the next start removes segments whose creator is gone (the
tracker too, e.g. a batch scheduler killing the whole process group). Segments are named
`transcribe-<creator pid>-<random>` for that.

Size: /dev/shm is a tmpfs that may be small (Docker's default is 64 MB). A segment larger than
its free space is still created (sparse), and the first write past the limit kills the
writing worker with SIGBUS, file after file. So `create` shrinks the slab to what is free
(fewer slots: smaller batches), reserves its pages at once (posix_fallocate), and raises
SharedMemoryTooSmall naming the sizes when not even the minimum fits.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

PREFIX = "transcribe-"
SHM_DIR = Path("/dev/shm")  # where Linux lists POSIX shared memory; absent elsewhere
FLOAT32 = 4  # bytes


SHM_FREE_SHARE = 0.8  # of /dev/shm's free space, at most, for one slab (other jobs need some)


class SharedMemoryTooSmall(Exception):
    """/dev/shm cannot hold the smallest slab the job needs."""


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (None where there is no such folder to ask)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class SlabSpec:
    """What a worker needs to attach: the segment name and the slot geometry."""

    name: str
    n_slots: int
    slot_floats: int


class Slab:
    """A shared-memory segment cut into fixed float32 slots; `view(slot, shape)` reads/writes one."""

    def __init__(self, shm: shared_memory.SharedMemory, spec: SlabSpec, owner: bool):
        self._shm, self.spec, self.owner = shm, spec, owner

    @classmethod
    def create(cls, n_slots: int, slot_floats: int, min_slots: int | None = None) -> "Slab":
        """A slab of `n_slots`, or of fewer (down to `min_slots`, default all of them) when
        /dev/shm has less free space; its pages are reserved now. SharedMemoryTooSmall if
        `min_slots` do not fit."""
        min_slots = n_slots if min_slots is None else min_slots
        if min_slots < 1 or n_slots < min_slots or slot_floats < 1:
            raise ValueError(f"slab needs 1 <= min_slots <= n_slots and a slot of one float or more, "
                             f"got {min_slots}, {n_slots} x {slot_floats}")
        slot_bytes = slot_floats * FLOAT32
        free = shm_free_bytes()
        if free is not None:
            n_slots = min(n_slots, int(free * SHM_FREE_SHARE) // slot_bytes)
            if n_slots < min_slots:
                raise SharedMemoryTooSmall(
                    f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the job needs at least "
                    f"{min_slots * slot_bytes / SHM_FREE_SHARE / 2**20:.0f} MiB of shared memory "
                    f"(in Docker: --shm-size=1g)")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=n_slots * slot_bytes)
        slab = cls(shm, SlabSpec(name, n_slots, slot_floats), owner=True)
        try:
            _reserve(name, n_slots * slot_bytes)
        except BaseException:
            slab.close()
            raise
        return slab

    @classmethod
    def attach(cls, spec: SlabSpec) -> "Slab":
        # Spawned workers share the creator's resource tracker, so attaching registers nothing new
        # and a worker's exit never unlinks the segment under the engine.
        return cls(shared_memory.SharedMemory(name=spec.name), spec, owner=False)

    @property
    def nbytes(self) -> int:
        return self.spec.n_slots * self.spec.slot_floats * FLOAT32

    def view(self, slot: int, shape: tuple[int, int]) -> np.ndarray:
        """float32 [rows, cols] C-contiguous at the start of `slot`; shares the slab's memory."""
        if not 0 <= slot < self.spec.n_slots or shape[0] * shape[1] > self.spec.slot_floats:
            raise ValueError(f"slot {slot} shape {shape} does not fit {self.spec}")
        offset = slot * self.spec.slot_floats * FLOAT32
        return np.ndarray(shape, dtype=np.float32, buffer=self._shm.buf, offset=offset)

    def close(self) -> None:
        """Unmap (and, for the creator, unlink) the segment. Safe to call twice."""
        if self.owner:
            self.owner = False
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass  # already removed (a sweep, or a second close)
        try:
            self._shm.close()
        except BufferError:
            pass  # a view is still alive (e.g. in a traceback); the mapping goes with the process

    def __enter__(self) -> "Slab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reserve(name: str, size: int) -> None:
    """Allocate the segment's pages now, so that a /dev/shm that fills up later (another job)
    fails here, cleanly, not as a SIGBUS in a worker's write."""
    path = SHM_DIR / name
    if not path.exists():  # not Linux: nothing to reserve through
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise SharedMemoryTooSmall(f"{SHM_DIR}: cannot reserve {size / 2**20:.0f} MiB of shared memory "
                                   f"({e.strerror}; in Docker: --shm-size=1g)") from e
    finally:
        os.close(fd)


def our_segments() -> list[str]:
    """Names of every segment in /dev/shm made by this program (any process)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def orphaned_segments() -> list[str]:
    """Our segments whose creating process no longer exists: what a run left behind (a live
    run's segment, e.g. a job beside the tests, is not)."""
    out = []
    for name in our_segments():
        pid_s = name[len(PREFIX):].split("-", 1)[0]
        if pid_s.isdigit() and not _alive(int(pid_s)):
            out.append(name)
    return out


def sweep_stale() -> list[str]:
    """Remove segments whose creating process no longer exists; returns their names."""
    removed = []
    for name in orphaned_segments():
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass  # gone already, or another user's: not ours to remove
    return removed
