#!/usr/bin/env python3
"""Micro-bench: log-mel features per piece in a worker vs batched on the engine's device, on
the same pieces in the same batches.

    .venv/bin/python bench/features_device.py                                 # CPU, tdt_tiny
    .venv/bin/python bench/features_device.py --model M.nemo --device cuda --json out.json

Pieces: the audio under `--audio` (files or folders), cut at pauses as the workers cut them,
batched by the pipeline's own `Batcher` on the engine's length buckets. Per pass, after
`--warmup` passes:

  workers: `LogMelFrontend` on each piece with one torch thread (what a worker does; the
           pipeline runs it in N processes beside the model), then the engine's input of each
           batch from those features (its "batch" stage: pad + host-to-device copy, on the
           model's path);
  device:  the engine's input of each batch from the audio pieces (its "batch" and
           "features" stages: pad + copy, then `LogMel` on the device; both on the model's path).

The engine's stages are read from its own timers (`stage_seconds`, synchronised on CUDA).

Figures: median over `--reps` passes, seconds and x real time. Which wins end to end also
depends on what the model leaves idle: `bench/gpu_bench.py --features-on workers,device`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engines.parakeet import ParakeetEngine, pick_device  # noqa: E402
from transcribe.audio import load_audio  # noqa: E402
from transcribe.batching import Batcher  # noqa: E402
from transcribe.inputs import discover  # noqa: E402
from transcribe.segmenting import split_long  # noqa: E402

SPEECH = (ROOT / ".." / "shared" / "data" / "speech").resolve()
DEFAULT_MODEL = (ROOT / ".." / "shared" / "fixtures" / "nemo_reference" / "tdt_tiny" / "model.nemo").resolve()


def load_pieces(inputs: list[str], sample_rate: int, max_piece_s: float) -> list:
    out = []
    for f in discover(inputs):
        out += [p for _, p in split_long(load_audio(f.path, sample_rate), sample_rate, max_piece_s)]
    return out


def batches(engine: ParakeetEngine, pieces: list, batch_seconds: float, max_items: int) -> list[list[int]]:
    """Piece indices per batch, as the pipeline's batcher forms them when every piece is waiting."""
    b: Batcher[int] = Batcher(engine.bucket_edges_s, batch_seconds, max_items)
    out = [full for i, p in enumerate(pieces) if (full := b.add(i, p.shape[0] / engine.sample_rate))]
    while len(b):
        out.append(b.take())
    return out


@torch.inference_mode()
def engine_pass(engine: ParakeetEngine, pieces: list, groups: list[list[int]]) -> dict[str, float]:
    """The engine's input of every batch: seconds per stage, from its own timers."""
    engine.stage_seconds.clear()
    for g in groups:
        engine._encoder_input([pieces[i] for i in g])
    return dict(engine.stage_seconds)


@torch.inference_mode()
def worker_pass(workers: ParakeetEngine, pieces: list, groups: list[list[int]]) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's setting (transcribe/preprocess.py)
    try:
        t0 = time.perf_counter()
        feats = [torch.from_numpy(workers.frontend(p)) for p in pieces]
        per_piece = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {"worker_features": per_piece, **engine_pass(workers, feats, groups)}


def median_pass(run, reps: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        run()
    passes = [run() for _ in range(reps)]
    return {k: statistics.median(p[k] for p in passes) for k in passes[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--audio", nargs="+", default=[str(SPEECH / "librispeech_test_other"), str(SPEECH / "longform")])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--batch-seconds", type=float, default=300.0, help="the pipeline's --batch-seconds")
    ap.add_argument("--max-items", type=int, default=64, help="most pieces per batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the engine (default: torch's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:  # the CLI's check: a CUDA device this machine lacks is an error line, not a traceback
        a.device = pick_device(a.device)
    except ValueError as e:
        raise SystemExit(str(e))
    if a.threads:
        torch.set_num_threads(a.threads)
    workers = ParakeetEngine.from_nemo(a.model, a.device, features_on="workers")
    device = ParakeetEngine.from_nemo(a.model, a.device, features_on="device")
    for engine in (workers, device):
        engine.reserve(a.max_items)  # the pinned host batch on CUDA, as in the pipeline
    pieces = load_pieces(a.audio, workers.sample_rate, workers.max_piece_seconds)
    groups = batches(workers, pieces, a.batch_seconds, a.max_items)
    audio_s = sum(p.shape[0] for p in pieces) / workers.sample_rate
    w = median_pass(lambda: worker_pass(workers, pieces, groups), a.reps, a.warmup)
    audio = [torch.from_numpy(device.frontend(p)) for p in pieces]
    d = median_pass(lambda: engine_pass(device, audio, groups), a.reps, a.warmup)
    slab = {"workers": sum(workers.frontend(p).nbytes for p in pieces), "device": 4 * sum(p.shape[0] for p in pieces)}
    report = {
        "model": a.model, "device": a.device, "n_mels": workers.feature_cfg.features, "torch_threads": torch.get_num_threads(),
        "pieces": len(pieces), "batches": len(groups), "audio_seconds": round(audio_s, 1), "reps": a.reps,
        "workers": {k: round(v, 4) for k, v in w.items()}, "device_path": {k: round(v, 4) for k, v in d.items()},
        # x real time of the features themselves: per worker process, and on the device
        "x_realtime_per_worker": round(audio_s / w["worker_features"], 1),
        "x_realtime_device_features": round(audio_s / d["features"], 1),
        # what lands on the model's path (the workers' log-mel runs beside it)
        "model_path_seconds": {"workers": round(w["batch"], 4), "device": round(d["batch"] + d["features"], 4)},
        "slab_bytes_per_audio_second": {k: round(v / audio_s) for k, v in slab.items()},
    }
    print(json.dumps(report, indent=1))
    print(f"{a.device}, {report['n_mels']} mels, {len(pieces)} pieces in {len(groups)} batches, {audio_s:.0f} s audio: "
          f"per-piece log-mel {report['x_realtime_per_worker']}x real time per worker (1 thread); batched on "
          f"the device {report['x_realtime_device_features']}x; on the model's path "
          f"{report['model_path_seconds']['workers']} s (workers) vs {report['model_path_seconds']['device']} s (device)",
          file=sys.stderr)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
