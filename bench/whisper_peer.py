"""Peer baseline: faster-whisper on a manifest (run with the faster-whisper venv's python).

    /work/venvs/fw/bin/python bench/whisper_peer.py MANIFEST MODEL_DIR OUT.json [--limit N] [--compute-type T]

Settings: compute_type float32 (--compute-type: int8 is faster-whisper's usual CPU choice),
cpu_threads 2, beam_size 1, language "en", no VAD, other options at faster-whisper's defaults.
Writes JSON {audio_seconds, load_seconds, transcribe_seconds, texts}; audio decoding is part of
transcribe_seconds, as it is for us.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", type=Path)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--limit", type=int, default=None, help="first N files only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compute-type", default="float32", help="CTranslate2 compute type (float32, int8, ...)")
    args = ap.parse_args()

    rows = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    paths = [str(args.manifest.parent / r["audio_filepath"]) for r in rows]

    t0 = time.perf_counter()
    from faster_whisper import WhisperModel
    from faster_whisper.audio import decode_audio

    model = WhisperModel(str(args.model_dir), device="cpu", compute_type=args.compute_type,
                         cpu_threads=args.threads)
    t1 = time.perf_counter()
    texts, audio_seconds = [], 0.0
    for p in paths:
        audio = decode_audio(p, sampling_rate=16000)
        audio_seconds += len(audio) / 16000
        segments, _info = model.transcribe(audio, beam_size=1, language="en", vad_filter=False)
        texts.append("".join(s.text for s in segments).strip())
    t2 = time.perf_counter()
    args.out.write_text(json.dumps({"audio_seconds": audio_seconds, "load_seconds": t1 - t0,
                                    "transcribe_seconds": t2 - t1, "texts": texts}, indent=1))


if __name__ == "__main__":
    main()
