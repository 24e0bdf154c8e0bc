"""How sure Whisper's language detection is on our speech: the numbers behind file_language.SURE.

Every file of ../shared/data/speech (its manifests) is read at 16 kHz; a file of up to 30 s is one
window, a longer one is cut into 20 s windows (as the pipeline cuts Whisper's pieces, at most
20 s). Each window goes through the encoder and OpenAI's `detect_language` (the logits after
<|startoftranscript|> alone, softmax over the language tokens). Prints the windows detected as
another language than English (all our speech is English), the percentiles of the top
probability of those detected as English, and how many fall under 0.8 and 0.9.

Usage:
    .venv/bin/python bench/whisper_language_probability.py [--speech ../shared/data/speech] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engines.whisper_engine import WhisperEngine  # noqa: E402
from transcribe.audio import AudioError, load_audio  # noqa: E402
from transcribe.whisper_features import N_SAMPLES, FeatureConfig, log_mel_spectrogram  # noqa: E402

RATE = 16000
PIECE_S = 20


def windows(speech: Path) -> list[tuple[str, np.ndarray]]:
    out = []
    for manifest in sorted(speech.glob("*/manifest.jsonl")):
        for line in manifest.read_text().splitlines():
            if not line.strip():
                continue
            path = manifest.parent / json.loads(line)["audio_filepath"]
            try:
                wav = load_audio(path, RATE)
            except AudioError:
                continue
            if len(wav) <= N_SAMPLES:
                out.append((path.name, wav))
                continue
            for a in range(0, len(wav) - RATE, PIECE_S * RATE):
                out.append((f"{path.name}@{a // RATE}", wav[a:a + PIECE_S * RATE]))
    return out


@torch.inference_mode()
def detect(engine: WhisperEngine, batch: list[np.ndarray]) -> list[tuple[str, float]]:
    dec = engine.decoder
    x = torch.zeros(len(batch), N_SAMPLES)
    for j, w in enumerate(batch):
        x[j, :len(w)] = torch.from_numpy(w)
    mel = log_mel_spectrogram(x, FeatureConfig(dec.model.dims.n_mels))
    audio = dec.model.encoder(mel.to(next(dec.model.encoder.parameters()).dtype))
    cache = dec.model.decoder.new_cache(audio, dec.opts.max_length)
    first = dec.model.decoder(torch.tensor(dec.prompt[:1]).expand(len(batch), 1), cache)[:, 0]
    ids = torch.tensor(list(dec.languages))
    top, best = first[:, ids].float().softmax(-1).max(-1)
    return [(dec.languages[int(ids[b])], float(p)) for b, p in zip(best, top)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speech", type=Path, default=ROOT.parent / "shared" / "data" / "speech")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    engine = WhisperEngine.load("whisper-base", device="cpu", language="auto")
    wins = windows(args.speech)
    if not wins:
        raise SystemExit(f"no audio under {args.speech}")
    rows = []
    for s in range(0, len(wins), 16):
        chunk = wins[s:s + 16]
        rows += [(name, lang, prob) for (name, _), (lang, prob) in zip(chunk, detect(engine, [w for _, w in chunk]))]
    english = np.array([prob for _, lang, prob in rows if lang == "en"])
    print(f"{len(rows)} windows; detected as another language: "
          + (", ".join(f"{n} {lang} {prob:.3f}" for n, lang, prob in rows if lang != "en") or "none"))
    if english.size:
        print("English, top probability percentiles 0/1/2/5/10/50:", np.percentile(english, [0, 1, 2, 5, 10, 50]).round(3))
    print(f"English under 0.8: {int((english < 0.8).sum())}, under 0.9: {int((english < 0.9).sum())}")
    if args.json:
        args.json.write_text(json.dumps([{"window": n, "language": lang, "probability": prob} for n, lang, prob in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
