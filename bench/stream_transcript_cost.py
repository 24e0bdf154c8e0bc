"""What one streaming step costs the server for a stream's transcript, as the stream ages:
building the result (text, words) and the bytes sent, per step per stream, for

  whole     the transcript so far, rebuilt and sent every step (before transcript.py)
  segments  the open tail every step, plus the segments committed in that step (now): the mean
            over the steps of the minute before each age

The token stream is real text: the shared references (LibriSpeech, LJSpeech, ...) in
parakeet-tdt-0.6b-v2's tokenizer, spoken at 2.5 words/s with a 0.8 s pause after each
utterance, stepped every 0.56 s (the cache-aware fixture's chunk). Timing needs a quiet machine.

    .venv/bin/python bench/stream_transcript_cost.py [--minutes 60]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.tokenizer import Tokenizer  # noqa: E402
from transcribe.streaming import protocol as P  # noqa: E402
from transcribe.streaming.transcript import StreamTranscript  # noqa: E402
from transcribe.timestamps import FrameTiming, build_result  # noqa: E402

SHARED = ROOT.parent / "shared"
TIMING = FrameTiming(0.01, 8)
WORDS_PER_S, PAUSE_S, STEP_S = 2.5, 0.8, 0.56


def token_stream(tokenizer: Tokenizer, minutes: float) -> tuple[list[int], list[int], list[int]]:
    texts = [json.loads(line)["text"].lower() for line in
             (SHARED / "data" / "speech" / "manifest_eval_short.jsonl").read_text().splitlines()]
    tokens, frames, t = [], [], 0.0
    while t < minutes * 60:
        for text in texts:
            for word in text.split():
                ids = tokenizer._sp.encode(word)
                for k, i in enumerate(ids):
                    tokens.append(i)
                    frames.append(int((t + k * 0.4 / len(ids)) / TIMING.frame_seconds))
                t += 1 / WORDS_PER_S
            t += PAUSE_S
            if t >= minutes * 60:
                break
    return tokens, frames, [2] * len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    args = ap.parse_args()
    tokenizer = Tokenizer.from_bytes((SHARED / "fixtures" / "parakeet_tdt_0.6b_v2_shape" / "tokenizer.model").read_bytes())
    tokens, frames, durations = token_stream(tokenizer, args.minutes)
    print(f"{len(tokens)} tokens in {args.minutes:g} min; per step (every {STEP_S} s), per stream:")
    transcript = StreamTranscript(tokenizer, "tdt", TIMING)
    marks = sorted({m for m in (1, 10, 30, 60, args.minutes) if m <= args.minutes})
    n, t = 0, 0.0
    for minute in marks:
        # Advance the segmented transcript step by step up to this age (it keeps state); the
        # figure is the mean over the steps of the last minute before it, those that commit a
        # segment (about one in ten) and those that do not: a repeated last step committed none.
        costs, sizes = [], []
        while t + STEP_S <= minute * 60:
            t += STEP_S
            while n < len(tokens) and frames[n] * TIMING.frame_seconds < t:
                n += 1
            t0 = time.perf_counter()
            update = transcript.update(tokens[:n], frames[:n], durations[:n], t, False)
            if t > minute * 60 - 60:
                costs.append(time.perf_counter() - t0)
                sizes.append(sum(len(P.encode(m)) for m in P.update_messages("s", update, t)))
        seg_s, seg_bytes = sum(costs) / len(costs), round(sum(sizes) / len(sizes))
        t0 = time.perf_counter()
        whole = build_result(tokenizer, tokens[:n], frames[:n], durations[:n], "tdt", TIMING)
        whole_s = time.perf_counter() - t0
        whole_bytes = len(P.encode(P.result_message("partial", "s", whole, t, 0)))
        print(f"  at {minute:5.1f} min ({n:6d} tokens): whole {whole_s * 1e3:7.2f} ms {whole_bytes:8d} B   "
              f"segments {seg_s * 1e3:5.2f} ms {seg_bytes:6d} B   ({whole_s / seg_s:.0f}x less work)")


if __name__ == "__main__":
    main()
