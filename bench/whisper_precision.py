"""Whisper encoder-only and decoder-only time per compute precision on the CPU, with WER.

The first --files utterances of the manifest, each padded to a 30 s window, form one batch.
Settings (encoder dtype / decoder dtype), each a model built from one read of the bundled base:
fp32 (fp32 / fp32), bf16 (bf16 / fp32: what `--dtype bfloat16` runs on the CPU) and
bf16-decoder (bf16 / bf16, to measure the choice `whisper_engine.compute_dtypes` makes). Per
round, every setting runs its encoder on the batch, then its eager greedy decoder on its own
encoder states (decoder threads as the engine sets them; cross K/V projection included); the
settings interleave, so a burst of outside load hits them alike, and the best round counts.
One warm-up round first. Texts: WER against the manifest and word error against fp32's.

Usage:
    .venv/bin/python bench/whisper_precision.py [--manifest M] [--files 16] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engines.precision import check_dtype  # noqa: E402
from engines.whisper import build_whisper  # noqa: E402
from engines.whisper_decoding import DecodeOptions, GreedyDecoder  # noqa: E402
from engines.whisper_engine import WhisperEngine  # noqa: E402
from engines.whisper_weights import bundled_base_dir, load_ct2  # noqa: E402
from transcribe.audio import load_audio  # noqa: E402
from transcribe.bench import wer  # noqa: E402
from transcribe.whisper_features import N_SAMPLES, FeatureConfig, log_mel_spectrogram  # noqa: E402

DEFAULT_MANIFEST = ROOT.parent / "shared" / "data" / "speech" / "librispeech_test_other" / "manifest.jsonl"
SETTINGS = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.float32),
            "bf16-decoder": (torch.bfloat16, torch.bfloat16)}


def window_batch(manifest: Path, files: int) -> tuple[torch.Tensor, list[str], float]:
    """Log-mel [files, 80, 3000] of the manifest's first utterances, their texts, audio seconds."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()][:files]
    audio = torch.zeros(len(rows), N_SAMPLES)
    seconds = 0.0
    for i, r in enumerate(rows):
        wav = load_audio(manifest.parent / r["audio_filepath"], 16000)[:N_SAMPLES]
        audio[i, :len(wav)] = torch.from_numpy(wav)
        seconds += len(wav) / 16000
    return log_mel_spectrogram(audio, FeatureConfig(80)), [r["text"] for r in rows], seconds


def decoders(names: list[str]) -> dict[str, GreedyDecoder]:
    """One eager decoder per setting, sharing the bundled tokenizer and suppress list."""
    base = WhisperEngine.from_bundled(dtype="float32", decoder_mode="eager").decoder
    dims, state = load_ct2(bundled_base_dir()[0])
    out = {}
    for name in names:
        enc, dec = SETTINGS[name]
        model = base.model if name == "fp32" else build_whisper(dims, state, "cpu", enc, dec)
        out[name] = GreedyDecoder(model, base.tok, DecodeOptions(), base.suppress)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    p.add_argument("--files", type=int, default=16, help="windows in the batch")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (best counts)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list; fp32 (the reference) always runs")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    names = ["fp32"] + [s for s in args.settings.split(",") if s and s != "fp32"]
    for name in names:
        for dt in SETTINGS[name]:
            check_dtype(dt, "cpu")  # no bf16 in this CPU's hardware: say so before loading
    mel, refs, audio_s = window_batch(args.manifest, args.files)
    decs = decoders(names)
    times = {n: {"encoder": [], "decoder": []} for n in names}
    texts = {}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for name, dec in decs.items():
                t0 = time.perf_counter()
                audio = dec.model.encoder(mel)
                t1 = time.perf_counter()
                results = dec.decode_audio(audio)
                t2 = time.perf_counter()
                if r:  # round 0 warms up
                    times[name]["encoder"].append(t1 - t0)
                    times[name]["decoder"].append(t2 - t1)
                texts[name] = [res.text for res in results]
    rows = []
    print(f"{len(refs)} windows ({audio_s:.1f} s of audio) of {args.manifest.parent.name}, "
          f"{torch.get_num_threads()} threads, best of {args.rounds}")
    for name in names:
        enc, dec = (min(times[name][k]) for k in ("encoder", "decoder"))
        row = {"setting": name, "encoder_dtype": str(SETTINGS[name][0]), "decoder_dtype": str(SETTINGS[name][1]),
               "encoder_s": enc, "decoder_s": dec, "times": times[name],
               "encoder_speedup": min(times["fp32"]["encoder"]) / enc,
               "decoder_speedup": min(times["fp32"]["decoder"]) / dec,
               "wer": wer(refs, texts[name]), "word_error_vs_fp32": wer(texts["fp32"], texts[name]),
               "texts_equal_fp32": sum(a == b for a, b in zip(texts[name], texts["fp32"]))}
        rows.append(row)
        print(f"{name:13s} encoder {enc:6.2f} s ({row['encoder_speedup']:4.2f}x)  decoder {dec:6.2f} s "
              f"({row['decoder_speedup']:4.2f}x)  WER {100 * row['wer']:5.2f} %  vs fp32: word error "
              f"{100 * row['word_error_vs_fp32']:5.2f} %, {row['texts_equal_fp32']}/{len(refs)} texts equal")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"manifest": str(args.manifest), "files": len(refs), "audio_seconds": audio_s,
                                         "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                         "threads": torch.get_num_threads(), "rounds": args.rounds,
                                         "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
