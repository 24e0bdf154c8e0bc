#!/usr/bin/env python3
"""Whisper decoder-only speed per decoder mode: eager vs the CUDA-graph modes (engines/whisper_graph.py).

    python bench/whisper_decoder_modes.py --device cuda --files 16 --reps 5 --json bench/results/whisper_modes.json
    python bench/whisper_decoder_modes.py --device cpu --files 4 --reps 1    # smoke test

The first `--files` utterances of the manifest are padded to 30 s windows, batched `--batch` at a
time and encoded once. Per mode, a fresh `GreedyDecoder` on the same model decodes those encoder
states once as warm-up (graph capture included) and then `--reps` timed passes, with the device
synchronised before and after the timed span. Every mode's tokens are compared with eager's.
On the CPU the graph modes cannot capture: their fixed-shape step runs without capture
(capture=False), which checks that path and this script, not GPU speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engines.decode_modes import DecodeMode  # noqa: E402
from engines.parakeet import pick_device  # noqa: E402
from engines.whisper_decoding import DecodeOptions, GreedyDecoder  # noqa: E402
from engines.whisper_engine import WhisperEngine  # noqa: E402
from engines.whisper_graph import WhisperGraphs  # noqa: E402
from transcribe.audio import load_audio  # noqa: E402
from transcribe.whisper_features import N_SAMPLES, FeatureConfig, log_mel_spectrogram  # noqa: E402

DEFAULT_MANIFEST = ROOT.parent / "shared" / "data" / "speech" / "librispeech_test_other" / "manifest.jsonl"
MODES = ("eager", "unrolled", "full-graph")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def encoded_batches(engine: WhisperEngine, manifest: Path, files: int, batch: int) -> tuple[list[torch.Tensor], float]:
    """Encoder states of the manifest's first `files` utterances, `batch` windows each; audio seconds."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()][:files]
    wavs = [load_audio(manifest.parent / r["audio_filepath"], 16000)[:N_SAMPLES] for r in rows]
    model, cfg = engine.decoder.model, FeatureConfig(engine.decoder.model.dims.n_mels)
    device = model.decoder.embed.weight.device
    out = []
    for i in range(0, len(wavs), batch):
        chunk = wavs[i:i + batch]
        audio = torch.zeros(len(chunk), N_SAMPLES)
        for j, w in enumerate(chunk):
            audio[j, :len(w)] = torch.from_numpy(w)
        with torch.inference_mode():
            out.append(model.encoder(log_mel_spectrogram(audio, cfg).to(device)))
    return out, sum(len(w) for w in wavs) / 16000


def time_mode(engine: WhisperEngine, batches: list[torch.Tensor], mode: str, reps: int, device: str) -> dict:
    base = engine.decoder
    dec = GreedyDecoder(base.model, base.tok, DecodeOptions(), base.suppress)
    capture = device.startswith("cuda")
    if capture:
        dec.set_mode(mode)
    else:  # what the graphs would run, called directly
        dec.graphs = WhisperGraphs(dec, DecodeMode(mode), capture=False)
    t0 = time.perf_counter()
    tokens = [[r.tokens for r in dec.decode_audio(a)] for a in batches]  # warm-up (and capture)
    _sync(device)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(reps):
        for a in batches:
            dec.decode_audio(a)
    _sync(device)
    return {"mode_requested": mode, "mode": dec.mode, "capture": capture,
            "seconds_per_pass": (time.perf_counter() - t0) / reps, "warmup_seconds": warmup, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="auto (float16 on CUDA; on the CPU a bfloat16 encoder where the startup probe finds it faster, else float32), float32, bfloat16, float16")
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated; eager is always run first")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:  # the CLI's check: a CUDA device this machine lacks is an error line, not a traceback
        a.device = pick_device(a.device)
    except ValueError as e:
        raise SystemExit(str(e))
    engine = WhisperEngine.from_bundled(device=a.device, dtype=a.dtype, decoder_mode="eager")
    batches, audio_s = encoded_batches(engine, a.manifest, a.files, a.batch)
    modes = ["eager"] + [m for m in a.modes.split(",") if m and m != "eager"]
    rows = [time_mode(engine, batches, m, a.reps, a.device) for m in modes]
    eager = rows[0]
    for r in rows:
        r["speedup_vs_eager"] = eager["seconds_per_pass"] / r["seconds_per_pass"]
        r["identical_to_eager"] = r["tokens"] == eager["tokens"]
        how = "" if r["capture"] or r["mode"] == "eager" else " (no capture)"
        print(f"{r['mode_requested']:>10} -> {r['mode'] + how:<24} {r['seconds_per_pass'] * 1000:9.1f} ms/pass "
              f"{r['speedup_vs_eager']:6.2f}x vs eager  warm-up {r['warmup_seconds']:.2f} s  "
              f"tokens {'identical' if r['identical_to_eager'] else 'DIFFER'}")
    n_tokens = sum(len(t) for b in eager["tokens"] for t in b)
    print(f"{a.files} windows, {audio_s:.1f} s of audio, {n_tokens} tokens; {a.device} ({engine.runtime})")
    if a.json:
        report = {"device": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu",
                  "runtime": engine.runtime, "files": a.files, "batch": a.batch, "reps": a.reps, "audio_seconds": audio_s,
                  "tokens": n_tokens, "modes": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
