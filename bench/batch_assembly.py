#!/usr/bin/env python3
"""Batch assembly in the engine's process while other processes keep the cores busy (as the
preprocessing workers do): `ParakeetEngine._batch` (pieces copied row by row through numpy, on
the calling thread) against the torch copies it replaced (`fill_` and a slice assignment per
piece, which torch spreads over its OpenMP threads).

    python bench/batch_assembly.py [--pieces 32] [--busy 0,1,2] [--reps 40]

Prints per setting the median, p90 and max milliseconds of one batch (log-mel pieces of
[128, 1000-3000] frames, a fixed seed) written into one reused host buffer, as on CUDA (on
the CPU each batch is a fresh tensor, whose page faults then cost more than either copy).

On the 2-core dev VM (two runs, 30 and 40 batches a setting): idle, torch 3.6-5.3 ms against
6.0-6.2 for the row copies; both cores busy, p90 56-264 ms against 13.8-13.9 (a parallel copy
waits at a barrier for a thread the scheduler has parked); one core busy, p90 13-19 against
6.4-6.9.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.parakeet import ParakeetEngine  # noqa: E402
from transcribe.features import FeatureConfig  # noqa: E402


def _burn(stop) -> None:
    while not stop.is_set():
        sum(range(100_000))


class _Assembler:
    """Just what `ParakeetEngine._batch` reads: the features' padding and width rule."""

    _batch = ParakeetEngine._batch
    _batch_width = ParakeetEngine._batch_width
    _width = ParakeetEngine._width

    def __init__(self, host_numel: int):
        self.logmel, self.device = None, "cpu"
        self.feature_cfg = FeatureConfig(features=128)
        # As on CUDA (`reserve`): one host buffer for every batch, its pages touched once.
        # (Pinned there; plain here, where there is no CUDA to pin it for.)
        self._host = torch.zeros(host_numel)


def _torch_copies(engine: _Assembler, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The replaced way, into the same buffer: one fill, one slice assignment per piece."""
    shape = (len(pieces), pieces[0].shape[0], engine._batch_width(max(f.shape[1] for f in pieces)))
    batch = engine._host[: shape[0] * shape[1] * shape[2]].view(shape)
    batch.fill_(engine.feature_cfg.pad_value)
    for i, f in enumerate(pieces):
        batch[i, :, : f.shape[1]] = f
    return batch


def _time(fn, reps: int) -> str:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ms = np.array(ts) * 1000
    return f"median {np.median(ms):6.1f}  p90 {np.percentile(ms, 90):6.1f}  max {ms.max():6.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", type=int, default=32)
    ap.add_argument("--busy", default="0,1,2", help="busy processes per run, comma-separated")
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    pieces = [torch.from_numpy(rng.standard_normal((128, int(rng.integers(1000, 3000))), dtype=np.float32))
              for _ in range(a.pieces)]
    engine = _Assembler(a.pieces * 128 * 3100)
    got = engine._batch(pieces)[0].clone()
    assert torch.equal(got, _torch_copies(engine, pieces)), "the two ways disagree"
    print(f"{a.pieces} pieces, torch threads {torch.get_num_threads()}, {mp.cpu_count()} CPUs")
    for busy in (int(b) for b in a.busy.split(",")):
        stop = mp.Event()
        procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(busy)]
        for p in procs:
            p.start()
        time.sleep(0.5)
        try:
            print(f"busy {busy}: row copies (_batch)  {_time(lambda: engine._batch(pieces), a.reps)}")
            print(f"busy {busy}: torch copies        {_time(lambda: _torch_copies(engine, pieces), a.reps)}")
        finally:
            stop.set()
            for p in procs:
                p.join()


if __name__ == "__main__":
    main()
