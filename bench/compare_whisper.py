"""Whisper head to head: faster-whisper (peer) vs our engine, same files, one invocation.

    python bench/compare_whisper.py [--manifest M] [--limit N] [--batch-size B]
    python bench/compare_whisper.py --run-ours M OUT.json   # our side alone (used internally)

Each side runs as a whole command in its own process (the peer in /work/venvs/fw), one after
the other, and writes {audio_seconds, load_seconds, transcribe_seconds, texts}. We print, per
side, RTFx = audio seconds / transcribe seconds (audio decode included, model load excluded),
end-to-end RTFx including load and interpreter start, the ratio ours / peer, and WER against the
manifest text (lower case, punctuation removed, numbers left as they are: `transcribe.bench`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = Path("/work/shared/data/speech/librispeech_test_other/manifest.jsonl")
PEER_PYTHON = Path("/work/venvs/fw/bin/python")
PEER_MODEL = Path("/work/models/whisper-base-ct2")
WINDOW = 30 * 16000  # samples; longer files are cut at fixed 30 s until the VAD pipeline lands


def read_manifest(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def run_ours(manifest: Path, out: Path, limit: int | None, batch_size: int) -> None:
    """In-process driver: load the bundled base model, decode every file, batch all windows."""
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    from engines.whisper_engine import WhisperEngine
    from transcribe.audio import load_audio

    engine = WhisperEngine.from_bundled(batch_size=batch_size)
    t1 = time.perf_counter()
    rows = read_manifest(manifest, limit)
    windows, owner, audio_seconds = [], [], 0.0
    for i, r in enumerate(rows):
        audio = load_audio(manifest.parent / r["audio_filepath"], 16000)
        audio_seconds += len(audio) / 16000
        for s in range(0, len(audio), WINDOW):
            windows.append(audio[s:s + WINDOW])
            owner.append(i)
    texts = [""] * len(rows)
    for i, (text, _segments) in zip(owner, engine.transcribe_windows(windows)):
        texts[i] = (texts[i] + " " + text).strip()
    t2 = time.perf_counter()
    out.write_text(json.dumps({"audio_seconds": audio_seconds, "load_seconds": t1 - t0,
                               "transcribe_seconds": t2 - t1, "texts": texts}, indent=1))


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - t


def _report(name: str, res: dict, wall: float, refs: list[str]) -> dict:
    sys.path.insert(0, str(ROOT))
    from transcribe.bench import wer

    row = {"rtfx": res["audio_seconds"] / res["transcribe_seconds"],
           "rtfx_e2e": res["audio_seconds"] / wall, "wer": wer(refs, res["texts"]),
           "load_s": res["load_seconds"], "transcribe_s": res["transcribe_seconds"], "wall_s": wall}
    print(f"{name:6s} RTFx {row['rtfx']:6.2f}  end-to-end RTFx {row['rtfx_e2e']:6.2f}  "
          f"WER {100 * row['wer']:5.2f} %  load {row['load_s']:5.1f} s  transcribe "
          f"{row['transcribe_s']:6.1f} s  wall {wall:6.1f} s")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--skip-peer", action="store_true", help="run only our engine")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--run-ours", nargs=2, type=Path, metavar=("MANIFEST", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_ours:
        run_ours(args.run_ours[0], args.run_ours[1], args.limit, args.batch_size)
        return
    refs = [r["text"] for r in read_manifest(args.manifest, args.limit)]
    lim = ["--limit", str(args.limit)] if args.limit else []
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_peer:
            peer_out = Path(tmp) / "peer.json"
            wall = _timed([str(PEER_PYTHON), "bench/whisper_peer.py", str(args.manifest), str(PEER_MODEL),
                           str(peer_out), *lim])
            summary["peer"] = _report("peer", json.loads(peer_out.read_text()), wall, refs)
        ours_out = Path(tmp) / "ours.json"
        wall = _timed([sys.executable, "bench/compare_whisper.py", "--run-ours", str(args.manifest),
                       str(ours_out), "--batch-size", str(args.batch_size), *lim])
        summary["ours"] = _report("ours", json.loads(ours_out.read_text()), wall, refs)
    if "peer" in summary:
        ratio = summary["ours"]["rtfx"] / summary["peer"]["rtfx"]
        e2e = summary["ours"]["rtfx_e2e"] / summary["peer"]["rtfx_e2e"]
        summary["ratio"], summary["ratio_e2e"] = ratio, e2e
        print(f"ratio ours/peer: RTFx x{ratio:.2f}, end-to-end x{e2e:.2f}  (cpu count {os.cpu_count()})")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
