"""The shared-memory slab: views shared across processes, bounds, and nothing left in /dev/shm."""
import multiprocessing as mp
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

from transcribe.shm import PREFIX, SHM_DIR, Slab, orphaned_segments, our_segments, sweep_stale


def _fill(spec, slot, value):
    slab = Slab.attach(spec)
    slab.view(slot, (3, 4))[...] = value
    slab.close()


def test_a_spawned_process_writes_what_the_creator_reads_and_close_unlinks():
    with Slab.create(4, 16) as slab:
        assert slab.spec.name.startswith(PREFIX) and slab.spec.name in our_segments()
        p = mp.get_context("spawn").Process(target=_fill, args=(slab.spec, 2, 7.0))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        v = slab.view(2, (3, 4))
        assert v.dtype == np.float32 and (v == 7.0).all() and (slab.view(1, (4, 4)) == 0).all()
        assert np.shares_memory(v, slab.view(2, (2, 6)))  # a view, not a copy
        del v
        name = slab.spec.name
    assert name not in our_segments()  # the worker's exit did not unlink it early, the creator did
    slab.close()  # twice is fine


def test_views_outside_a_slot_are_refused():
    with Slab.create(2, 8) as slab:
        with pytest.raises(ValueError):
            slab.view(2, (1, 1))
        with pytest.raises(ValueError):
            slab.view(0, (3, 3))
    with pytest.raises(ValueError):
        Slab.create(0, 8)


def test_sweep_removes_segments_of_dead_processes_only():
    p = mp.get_context("spawn").Process(target=int)
    p.start()
    p.join()
    dead = f"{PREFIX}{p.pid}-deadbeef"
    shm = shared_memory.SharedMemory(name=dead, create=True, size=8)
    resource_tracker.unregister(shm._name, "shared_memory")  # we play a killed run: nobody tracks it
    shm.close()
    with Slab.create(1, 1) as alive:
        assert dead in sweep_stale()
        assert alive.spec.name in our_segments() and dead not in our_segments()


def test_orphaned_segments_are_those_of_dead_creators():
    with Slab.create(1, 16) as live:
        dead = f"{PREFIX}999999999-deadbeef"  # no such pid
        (SHM_DIR / dead).write_bytes(b"x")
        try:
            assert dead in orphaned_segments() and live.spec.name not in orphaned_segments()
        finally:
            (SHM_DIR / dead).unlink(missing_ok=True)


def test_a_small_dev_shm_gets_a_smaller_slab_or_a_clear_error(monkeypatch):
    """Docker gives /dev/shm 64 MB: a slab past its free space was created sparse, and workers
    died of SIGBUS file after file. Now the slab shrinks to what is free (down to min_slots),
    its pages are reserved at once, and a /dev/shm too small for min_slots, or one that cannot
    reserve them, is an error naming the sizes, with no segment left behind."""
    import errno

    import transcribe.shm as shm

    slot_floats = 1 << 18  # 1 MiB slots
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 10 << 20)
    with Slab.create(64, slot_floats, min_slots=4) as slab:
        assert slab.spec.n_slots == int(10 * shm.SHM_FREE_SHARE)  # 8 of the 64 asked
        if SHM_DIR.is_dir():
            assert (SHM_DIR / slab.spec.name).stat().st_blocks * 512 >= 8 << 20  # reserved, not sparse
    with pytest.raises(shm.SharedMemoryTooSmall, match="10 MiB free"):
        Slab.create(64, slot_floats, min_slots=12)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: None)  # nothing to ask: as asked
    with Slab.create(3, slot_floats) as slab:
        assert slab.spec.n_slots == 3
    if SHM_DIR.is_dir():
        def full(fd, offset, size):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(shm.os, "posix_fallocate", full)
        before = set(our_segments())
        with pytest.raises(shm.SharedMemoryTooSmall, match="cannot reserve"):
            Slab.create(3, slot_floats)
        assert set(our_segments()) == before
