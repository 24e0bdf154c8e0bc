"""The shared-memory slab: views shared across processes, bounds, reserved pages, no name."""
import errno
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

import transcribe.shm as shm
from transcribe.shm import MEMFD_NAME, Slab


def _maps_slab(pid: int | str = "self") -> bool:
    return f"/memfd:{MEMFD_NAME}" in Path(f"/proc/{pid}/maps").read_text()


def _fill(spec, conn, slot, value):
    slab = Slab.attach(spec, conn)
    slab.view(slot, (3, 4))[...] = value
    conn.send(_maps_slab() if hasattr(os, "memfd_create") else None)
    slab.close()


def test_a_spawned_process_writes_what_the_creator_reads_through_the_shared_descriptor():
    ctx = mp.get_context("spawn")
    with Slab.create(4, 16) as slab:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_fill, args=(slab.spec, child, 2, 7.0))
        p.start()
        slab.share(parent)
        mapped_there = parent.recv()
        p.join(60)
        assert p.exitcode == 0
        v = slab.view(2, (3, 4))
        assert v.dtype == np.float32 and (v == 7.0).all() and (slab.view(1, (4, 4)) == 0).all()
        assert np.shares_memory(v, slab.view(2, (2, 6)))  # a view, not a copy
        if hasattr(os, "memfd_create"):  # anonymous memory in both processes: nothing in /dev/shm
            assert _maps_slab() and mapped_there
        del v
    assert slab._fd == -1  # the creator's descriptor is closed
    if hasattr(os, "memfd_create"):
        assert not _maps_slab()  # unmapped: the kernel frees it once the last holder is gone
    slab.close()  # twice is fine


def test_views_outside_a_slot_are_refused():
    with Slab.create(2, 8) as slab:
        with pytest.raises(ValueError):
            slab.view(2, (1, 1))
        with pytest.raises(ValueError):
            slab.view(0, (3, 3))
    with pytest.raises(ValueError):
        Slab.create(0, 8)




def test_the_pages_are_reserved_at_once_and_a_failure_to_reserve_is_a_clear_error(monkeypatch):
    """A sparse slab would fail later, as a SIGBUS in a worker's write, when memory runs out:
    its pages are allocated at creation, and an allocation that fails is an error naming the
    size, with no descriptor left open."""
    slot_floats = 1 << 18  # 1 MiB slots
    with Slab.create(8, slot_floats) as slab:
        assert os.fstat(slab._fd).st_blocks * 512 >= 8 << 20  # reserved, not sparse

    def full(fd, offset, size):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    before = os.listdir("/proc/self/fd")
    with pytest.raises(shm.SharedMemoryTooSmall, match="cannot reserve 3 MiB .*Cannot allocate memory"):
        Slab.create(3, slot_floats)
    assert os.listdir("/proc/self/fd") == before


def test_a_file_size_limit_below_the_slab_is_a_clean_error():
    """`ulimit -f` under the slab's size (some HPC sites) failed the slab's ftruncate with a
    traceback; it is SharedMemoryTooSmall, which the job reports in one line."""
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
            "from transcribe.shm import Slab, SharedMemoryTooSmall\n"
            "try:\n    Slab.create(4, 1 << 20)\nexcept SharedMemoryTooSmall as e:\n    print('clean:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("clean: cannot size 16 MiB"), out.stdout + out.stderr
