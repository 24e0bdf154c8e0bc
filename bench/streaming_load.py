"""Streaming load test: N concurrent clients stream real files at real-time pace to one
`transcribe serve` process over TCP; reports final-result latency p50/p90/p95/p99 (from "end"
to "final"), partial latency (from sending the audio a partial covers to its arrival), RTFx
(audio seconds / wall seconds), how many streams finished without error, and the server's own
figures (`{"type": "stats"}`: steps, chunks per step, step wall-time percentiles, seconds per
stage: log-mel, encoder, decoder), which say where a slow final's time went.

    python bench/streaming_load.py --model M.nemo --streams 100 [--json out.json]
    python bench/streaming_load.py --connect 127.0.0.1:8765 --streams 100   (server already up)

Without --connect the server runs in a subprocess (its own interpreter: client encoding does
not share the server's GIL). Starts are spread over --ramp-s (seeded) as real callers arrive.
--min-stream-s S makes each stream its file repeated to at least S seconds: the shared files
last 2-35 s, so a stream of one runs only a few steps, and a short load measures mostly the
server's first steps; long streams measure it in its steady state.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transcribe.audio import load_audio  # noqa: E402
from transcribe.streaming.client import server_stats, stream_audio  # noqa: E402

DEFAULT_MODEL = ROOT.parent / "shared/fixtures/nemo_reference/rnnt_streaming_tiny/model.nemo"
DEFAULT_AUDIO = ROOT.parent / "shared/data/speech"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, port: int, max_streams: int, device: str, dtype: str = "auto",
                  chunking: tuple[float | None, float | None, float | None] = (None, None, None),
                  encoder_backend: str = "auto") -> subprocess.Popen:
    chunk_ms, left_ms, right_ms = chunking
    code = ("from transcribe.streaming.cli_commands import serve; "
            f"serve({model!r}, port={port}, max_streams={max_streams}, max_waiting={max_streams}, device={device!r}, "
            f"dtype={dtype!r}, chunk_ms={chunk_ms!r}, left_ms={left_ms!r}, right_ms={right_ms!r}, "
            f"encoder_backend={encoder_backend!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    # A 0.6B model loads in tens of seconds, and on CUDA the window encoder's graphs are
    # captured before the server listens.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # it failed to load: its error is above, no use waiting
            raise RuntimeError(f"server exited with status {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start within 180 s")


def _at_least(audio: np.ndarray, samples: int) -> np.ndarray:
    """`audio` repeated end to end until it holds at least `samples` samples."""
    return np.tile(audio, -(-samples // audio.shape[0])) if audio.shape[0] < samples else audio


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None


async def _load(host: str, port: int, audios: list[np.ndarray], streams: int, ramp_s: float, piece_s: float,
                seed: int):
    rng = random.Random(seed)

    async def one(i: int):
        await asyncio.sleep(rng.uniform(0, ramp_s))
        return await stream_audio(host, port, f"load{i}", audios[i % len(audios)], piece_s=piece_s,
                                  realtime=True, timeout_s=120)

    t0 = time.monotonic()
    runs = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.monotonic() - t0
    try:
        stats = await server_stats(host, port)
    except (OSError, ValueError, asyncio.TimeoutError) as e:  # an older server: no stats
        stats = {"error": repr(e)}
    return runs, wall, stats


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--audio", default=str(DEFAULT_AUDIO), help="directory of audio files (searched recursively)")
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--max-streams", type=int, default=0, help="server pool slots (default: --streams)")
    ap.add_argument("--files", type=int, default=20, help="distinct files to stream")
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--piece-ms", type=int, default=100)
    ap.add_argument("--connect", default=None, help="host:port of a running server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", help="the server's device (cpu, cuda)")
    ap.add_argument("--dtype", default="auto", help="the server's encoder dtype (serve --dtype)")
    ap.add_argument("--chunk-ms", type=float, default=None, help="offline-trained models: serve --chunk-ms")
    ap.add_argument("--left-context-ms", type=float, default=None, help="serve --left-context-ms")
    ap.add_argument("--right-context-ms", type=float, default=None, help="serve --right-context-ms")
    ap.add_argument("--encoder-backend", default="auto", help="serve --encoder-backend (auto, torch, cuda-graphs)")
    ap.add_argument("--min-stream-s", type=float, default=0.0,
                    help="repeat each file to at least this many seconds a stream (see above)")
    args = ap.parse_args(argv)

    paths = sorted(p for p in Path(args.audio).rglob("*") if p.suffix in (".flac", ".wav"))[: args.files]
    if not paths:
        raise SystemExit(f"no .flac/.wav files under {args.audio}")
    audios = [_at_least(load_audio(p, 16000), int(args.min_stream_s * 16000)) for p in paths]
    proc = None
    if args.connect:
        host, port = args.connect.rsplit(":", 1)
    else:
        host, port = "127.0.0.1", _free_port()
        proc = _start_server(args.model, int(port), args.max_streams or args.streams, args.device, args.dtype,
                             (args.chunk_ms, args.left_context_ms, args.right_context_ms), args.encoder_backend)
    try:
        runs, wall, stats = asyncio.run(_load(host, int(port), audios, args.streams, args.ramp_s,
                                       args.piece_ms / 1000, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    finals = [r.final_latency() for r in runs if r.final is not None]
    partials = [x for r in runs for x in r.partial_latencies()]
    # The audio of the streams that finished: a refused ("busy") or failed stream decoded none.
    audio_s = sum(audios[i % len(audios)].shape[0] / 16000 for i, r in enumerate(runs) if r.final is not None)
    report = {
        "streams": args.streams, "completed": len(finals),
        "errors": sorted({(r.error or {}).get("code", "") for r in runs if r.final is None}),
        "final_latency_ms": {f"p{q}": _pct(finals, q) for q in (50, 90, 95, 99)},
        "partial_latency_ms": {f"p{q}": _pct(partials, q) for q in (50, 90, 95, 99)},
        "audio_seconds": round(audio_s, 1), "wall_seconds": round(wall, 2), "rtfx": round(audio_s / wall, 2),
        "model": args.model, "device": args.device, "dtype": args.dtype, "encoder_backend": args.encoder_backend,
        "min_stream_seconds": args.min_stream_s,
        "chunking_ms": [args.chunk_ms, args.left_context_ms, args.right_context_ms],
        "server": stats,  # its steps: count, chunks per step, wall ms percentiles, seconds per stage
    }
    fl = report["final_latency_ms"]
    print(f"streams {len(finals)}/{args.streams} ok  final p50 {fl['p50']} p95 {fl['p95']} p99 {fl['p99']} ms  "
          f"partial p95 {report['partial_latency_ms']['p95']} ms  RTFx {report['rtfx']}")
    if stats.get("steps"):
        print(f"server: {stats['steps']} steps, {stats['chunks_per_step']} chunks a step (max "
              f"{stats['max_chunks_per_step']}), step ms {stats['step_ms']}, stage s {stats['stage_seconds']}, "
              f"apply s {stats['apply_seconds']}, collect s {stats.get('collect_seconds')}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    done = main()
    sys.exit(0 if done["completed"] == done["streams"] else 1)  # some streams refused or failed
