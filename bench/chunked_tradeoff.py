"""Latency / compute / accuracy trade-off of chunked streaming for an offline-trained model.

For each (chunk, left, right) setting, every file is streamed alone through the real session
and pool (all audio pushed, then the windows stepped), and we report:

- theoretical latency: chunk + right context (what a word waits for before its chunk can run,
  model time excluded), the figure NeMo's streaming script logs;
- compute: mean and p95 milliseconds per step (one window: features + encoder + decoding),
  steps per audio second, and RTFx = audio seconds / summed step time (one stream, one step at
  a time: how much faster than real time one stream is decoded; no batching);
- accuracy: token error rate of the streamed tokens against the SAME model's offline tokens
  (agreement, not correctness: with random or briefly trained weights this is the only
  meaningful accuracy), plus WER against the manifest's reference text and the offline WER,
  which mean something only for a model with real weights.

Usage:
    .venv/bin/python bench/chunked_tradeoff.py --model M.nemo --manifest DIR/manifest.jsonl \
        --files 20 --grid 2000:10000:2000,1000:10000:1000,480:10000:480 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transcribe.bench import wer  # noqa: E402
from transcribe.streaming.scheduler import Scheduler, SchedulerConfig, StreamingModel  # noqa: E402
from transcribe.bench import edit_distance  # noqa: E402
from transcribe.streaming.session import SessionState  # noqa: E402


def load_files(manifest: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["utt_id"] if "utt_id" in r else r["audio_filepath"])  # seeded: fixed order
    out = []
    for r in rows[:n]:
        audio, sr = sf.read(str(manifest.parent / r["audio_filepath"]), dtype="float32")
        if sr != 16000 or audio.ndim != 1:
            raise ValueError(f"{r['audio_filepath']}: expected 16 kHz mono")
        out.append({"audio": audio, "text": r.get("text", "")})
    return out


def stream_one(sm: StreamingModel, audio: np.ndarray) -> tuple[list[int], list[float]]:
    sched = Scheduler(sm, SchedulerConfig(max_streams=1))
    s = sched.open("a")
    s.push_audio(audio)
    s.end()
    step_s = []
    while s.state == SessionState.ACTIVE:
        t = time.perf_counter()
        sched.run_once()
        step_s.append(time.perf_counter() - t)
    return s.tokens, step_s


def run_setting(engine, files, offline, chunk_ms, left_ms, right_ms) -> dict:
    sm = StreamingModel(engine, chunk_ms=chunk_ms, left_ms=left_ms, right_ms=right_ms)
    fs = sm.frame_samples / sm.sample_rate
    stream_one(sm, files[0]["audio"][:48000])  # warmup
    errors = total = 0
    steps: list[float] = []
    hyps = []
    for f, off in zip(files, offline):
        tokens, step_s = stream_one(sm, f["audio"])
        steps += step_s
        errors += edit_distance(tokens, off)
        total += len(off)
        hyps.append(engine.tokenizer.text(tokens))
    audio_s = sum(f["audio"].shape[0] for f in files) / sm.sample_rate
    c = sm.context
    return {
        "chunk_s": c.chunk * fs, "left_s": c.left * fs, "right_s": c.right * fs,
        "latency_s": (c.chunk + c.right) * fs,
        "step_ms_mean": 1000 * float(np.mean(steps)), "step_ms_p95": 1000 * float(np.percentile(steps, 95)),
        "steps_per_audio_s": len(steps) / audio_s, "rtfx": audio_s / sum(steps),
        "ter_vs_offline": errors / max(total, 1),
        "wer_vs_reference": wer([f["text"] for f in files], hyps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--grid", default="2000:10000:2000,1000:10000:1000,480:10000:480,2000:2000:0,160:10000:1000",
                    help="chunk_ms:left_ms:right_ms,...")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engines.parakeet import ParakeetEngine

    engine = ParakeetEngine.from_nemo(args.model, device="cpu")
    files = load_files(args.manifest, args.files)
    t = time.perf_counter()
    offline = [engine.transcribe([f["audio"]])[0].tokens for f in files]
    offline_s = time.perf_counter() - t
    audio_s = sum(f["audio"].shape[0] for f in files) / engine.sample_rate
    offline_wer = wer([f["text"] for f in files], [engine.tokenizer.text(o) for o in offline])
    rows = []
    for spec in args.grid.split(","):
        chunk_ms, left_ms, right_ms = (float(x) for x in spec.split(":"))
        rows.append(run_setting(engine, files, offline, chunk_ms, left_ms, right_ms))
    print(f"model {Path(args.model).name}, {len(files)} files, {audio_s:.1f} s audio; offline (one pass per file): "
          f"RTFx {audio_s / offline_s:.1f}, WER vs reference {offline_wer if offline_wer is None else round(100 * offline_wer, 2)} %")
    print("| chunk s | left s | right s | latency s | ms/step (mean / p95) | steps per audio s | RTFx | TER vs offline % | WER vs ref % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = "n/a" if r["wer_vs_reference"] is None else f"{100 * r['wer_vs_reference']:.1f}"
        print(f"| {r['chunk_s']:.2f} | {r['left_s']:.2f} | {r['right_s']:.2f} | {r['latency_s']:.2f} | "
              f"{r['step_ms_mean']:.1f} / {r['step_ms_p95']:.1f} | {r['steps_per_audio_s']:.2f} | {r['rtfx']:.1f} | "
              f"{100 * r['ter_vs_offline']:.1f} | {w} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "files": len(files), "audio_seconds": audio_s,
                                         "offline_rtfx": audio_s / offline_s, "offline_wer": offline_wer,
                                         "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
