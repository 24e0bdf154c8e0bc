"""Preprocessing throughput: decode + resample + VAD cuts + log-mel features, per worker process.

Runs the real `WorkerPool` (spawned workers writing features into the shared-memory slab)
with no model behind it: each piece's slot is freed as soon as its descriptor arrives, so the
figure is what the workers can feed an engine. Workers are started and warmed on a few files
first; the timed pass covers every file of the set once. Reported per set and worker count:
wall-clock x real time for the pool, that divided by the workers, and x real time per second
of worker CPU (from the workers' own stage timers).

    .venv/bin/python bench/preprocess_throughput.py                      # 1 and 2 workers
    .venv/bin/python bench/preprocess_throughput.py --workers 1 2 4 --json out.json

Sets (from ../shared/data/speech): `flac16k` = every 16 kHz FLAC utterance (LibriSpeech
test-other, misc and train-clean-100, ~65 min; files under the engine's 40 s piece limit, so no
VAD runs); `longform` = the 16 kHz FLAC long-form joins (~28 min; cut at pauses with VAD).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transcribe.audio import audio_info  # noqa: E402
from transcribe.pipeline import slab_slots  # noqa: E402
from transcribe.shm import Slab  # noqa: E402
from transcribe.workers import WorkerPool  # noqa: E402

SPEECH = (ROOT / ".." / "shared" / "data" / "speech").resolve()
DEFAULT_MODEL = (ROOT / ".." / "shared" / "fixtures" / "nemo_reference" / "tdt_tiny" / "model.nemo").resolve()
SETS = {
    "flac16k": ["librispeech_test_other", "librispeech_misc", "librispeech_train-clean-100_notext"],
    "longform": ["longform"],
}


def files_of(set_name: str) -> list[Path]:
    out = []
    for d in SETS[set_name]:
        for p in sorted((SPEECH / d).rglob("*.flac")):
            if audio_info(p)[1] == 16000:
                out.append(p)
    return out


def _drain(pool: WorkerPool, n_files: int) -> dict[str, int]:
    """Consume events until `n_files` files are over, freeing each slot at once."""
    seen = {"done": 0, "error": 0, "pieces": 0}
    while seen["done"] + seen["error"] < n_files:
        ev = pool.events.get()
        if ev[0] == "piece":
            seen["pieces"] += 1
            pool.release([ev[1].slot])
        elif ev[0] == "fatal":
            raise ev[1]
        else:
            seen[ev[0]] += 1
    return seen


def measure(frontend, files: list[Path], seconds: float, n_workers: int) -> dict:
    with Slab.create(slab_slots(frontend, n_workers), frontend.n_mels * frontend.max_frames) as slab, \
            WorkerPool(frontend, slab, n_workers) as pool:
        warm = files[: 2 * n_workers]
        for i, p in enumerate(warm):
            pool.submit(-1 - i, str(p))
        _drain(pool, len(warm))
        stages_before = dict(pool.stage_seconds)
        t0 = time.perf_counter()
        for i, p in enumerate(files):
            pool.submit(i, str(p))
        seen = _drain(pool, len(files))
        wall = time.perf_counter() - t0
        stages = {k: round(v - stages_before.get(k, 0.0), 4) for k, v in pool.stage_seconds.items()}
    cpu = sum(stages.values())
    return {
        "workers": n_workers, "files": len(files), "audio_seconds": round(seconds, 2), "pieces": seen["pieces"],
        "errors": seen["error"], "wall_seconds": round(wall, 3),
        "x_realtime": round(seconds / wall, 1), "x_realtime_per_worker": round(seconds / wall / n_workers, 1),
        "x_realtime_per_worker_cpu_second": round(seconds / cpu, 1) if cpu > 0 else None,
        "worker_stage_seconds": stages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help=".nemo whose frontend to run")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "preprocess_throughput.json"))
    args = ap.parse_args()
    from engines.parakeet import ParakeetEngine

    frontend = ParakeetEngine.from_nemo(args.model, "cpu").frontend
    report = {"model": args.model, "n_mels": frontend.n_mels, "runs": []}
    for set_name in args.sets:
        files = files_of(set_name)
        seconds = sum(audio_info(p)[0] for p in files)
        for n in args.workers:
            r = measure(frontend, files, seconds, n)
            r["set"] = set_name
            report["runs"].append(r)
            print(f"  {set_name:9s} {n} worker(s): {r['x_realtime']:8.1f}x real time, "
                  f"{r['x_realtime_per_worker']:7.1f}x per worker, {r['x_realtime_per_worker_cpu_second']}x per "
                  f"worker CPU second ({r['files']} files, {seconds / 60:.1f} min)", file=sys.stderr)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    flac = {r["workers"]: r for r in report["runs"] if r["set"] == "flac16k"}
    if flac:
        parts = [f"{n} worker(s) {r['x_realtime_per_worker']:.0f}x/worker ({r['x_realtime']:.0f}x total)"
                 for n, r in sorted(flac.items())]
        print(f"preprocess throughput, 16 kHz FLAC ({frontend.n_mels} mels): " + ", ".join(parts) + f" -> {args.json}")


if __name__ == "__main__":
    main()
