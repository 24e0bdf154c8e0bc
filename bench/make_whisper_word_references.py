#!/usr/bin/env python3
"""Record OpenAI Whisper's own word timestamps for the bundled whisper-base on real speech
(golden references for tests/test_whisper_words.py).

Two stages, in two virtualenvs (openai-whisper is a peer, never a dependency):

    .venv/bin/python bench/make_whisper_word_references.py export --work /tmp/oaw_ref
    /work/venvs/oaw/bin/python bench/make_whisper_word_references.py reference --work /tmp/oaw_ref \
        [--out tests/data/whisper_words/reference.json]

`export` (our venv) writes the bundled CT2 weights as an OpenAI checkpoint (`base.pt`, fp32:
{"dims", "model_state_dict"}, the inverse of engines.whisper_weights.openai_to_state) and each
chosen recording as 16 kHz float32 `.npy` (decoded and resampled by transcribe.audio, so both
sides hear the same samples). `reference` (a venv with `pip install torch openai-whisper`)
loads that checkpoint with `whisper.load_model`, sets base's alignment heads
(`whisper._ALIGNMENT_HEADS["base"]`: a checkpoint loaded by path otherwise gets the default
heads), and runs `model.transcribe(audio, language="en", temperature=0.0, fp16=False,
condition_on_previous_text=False, word_timestamps=True)`: greedy, no fallback, as we decode.
Every chosen file is <= 30 s, so OpenAI decodes it as one window, as our engine does.

reference.json: {"openai_whisper": version, "files": [{"audio" (relative to the repo root,
through ../shared), "samples", "text", "segments": [{start, end, text, tokens}],
"words": [{word, start, end, probability}]}]}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEECH = Path("../shared/data/speech")
FILES = [  # short (<= 30 s), varied speakers, punctuation and numbers
    "jfk/jfk.flac",
    "librispeech_misc/1089-134686-0000.flac",
    "librispeech_misc/1089-134691-0001.flac",
    "librispeech_misc/2412-153948-0000.flac",
    "librispeech_misc/61-70968-0000.flac",
    "librispeech_test_other/1688/1688-142285-0000.flac",
    "librispeech_test_other/2033/2033-164914-0000.flac",
    "librispeech_test_other/3080/3080-5032-0000.flac",
    "ljspeech/LJ001-0001.flac",
    "ljspeech/LJ001-0020.flac",
    "mfa_tests/common_voice_en_22058264.mp3",
]


def to_openai(dims, state) -> dict:
    """Internal names (engines/whisper.py) -> OpenAI's `Whisper` state dict, fp32."""
    sd = {"encoder.conv1.weight": state["encoder.conv1.weight"], "encoder.conv1.bias": state["encoder.conv1.bias"],
          "encoder.conv2.weight": state["encoder.conv2.weight"], "encoder.conv2.bias": state["encoder.conv2.bias"],
          "encoder.ln_post.weight": state["encoder.ln.weight"], "encoder.ln_post.bias": state["encoder.ln.bias"],
          "decoder.token_embedding.weight": state["decoder.embed.weight"],
          "decoder.positional_embedding": state["decoder.pos"],
          "decoder.ln.weight": state["decoder.ln.weight"], "decoder.ln.bias": state["decoder.ln.bias"]}
    if "encoder.pos" in state:
        sd["encoder.positional_embedding"] = state["encoder.pos"]
    names = {"attn_ln": "attn_ln", "attn.out": "attn.out", "mlp_ln": "mlp_ln", "mlp.fc1": "mlp.0",
             "mlp.fc2": "mlp.2", "cross_ln": "cross_attn_ln", "cross.q": "cross_attn.query",
             "cross.out": "cross_attn.out"}
    for part, n in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
        for i in range(n):
            src, dst = f"{part}.layers.{i}.", f"{part}.blocks.{i}."
            for ours, theirs in names.items():
                for leaf in ("weight", "bias"):
                    if f"{src}{ours}.{leaf}" in state:
                        sd[f"{dst}{theirs}.{leaf}"] = state[f"{src}{ours}.{leaf}"]
            q, k, v = state[f"{src}attn.qkv.weight"].chunk(3)
            qb, _, vb = state[f"{src}attn.qkv.bias"].chunk(3)  # the key projection has no bias
            sd |= {f"{dst}attn.query.weight": q, f"{dst}attn.query.bias": qb, f"{dst}attn.key.weight": k,
                   f"{dst}attn.value.weight": v, f"{dst}attn.value.bias": vb}
            if part == "decoder":
                k, v = state[f"{src}cross.kv.weight"].chunk(2)
                _, vb = state[f"{src}cross.kv.bias"].chunk(2)
                sd |= {f"{dst}cross_attn.key.weight": k, f"{dst}cross_attn.value.weight": v,
                       f"{dst}cross_attn.value.bias": vb}
    return {k: t.float().contiguous() for k, t in sd.items()}


def export(work: Path) -> None:
    import dataclasses

    import numpy as np
    import torch

    from engines.whisper_weights import bundled_base_dir, load_ct2
    from transcribe.audio import load_audio

    work.mkdir(parents=True, exist_ok=True)
    dims, state = load_ct2(bundled_base_dir()[0])
    torch.save({"dims": dataclasses.asdict(dims), "model_state_dict": to_openai(dims, state)}, work / "base.pt")
    for rel in FILES:
        audio = load_audio(ROOT / SPEECH / rel, 16000)
        np.save(work / (rel.replace("/", "__") + ".npy"), audio.astype(np.float32))
    print(f"wrote {work / 'base.pt'} and {len(FILES)} recordings")


def reference(work: Path, out: Path) -> None:
    import numpy as np
    import whisper

    model = whisper.load_model(str(work / "base.pt"), device="cpu")
    model.set_alignment_heads(whisper._ALIGNMENT_HEADS["base"])
    files = []
    for rel in FILES:
        audio = np.load(work / (rel.replace("/", "__") + ".npy"))
        res = model.transcribe(audio, language="en", temperature=0.0, fp16=False, condition_on_previous_text=False,
                               word_timestamps=True, verbose=None)
        seeks = {s["seek"] for s in res["segments"]}
        if seeks != {0}:
            sys.exit(f"{rel}: decoded in more than one window (seeks {sorted(seeks)}); choose a shorter file")
        files.append({
            "audio": str(SPEECH / rel), "samples": int(audio.size), "text": res["text"].strip(),
            "segments": [{"start": s["start"], "end": s["end"], "text": s["text"].strip(), "tokens": s["tokens"]}
                         for s in res["segments"]],
            "words": [{"word": w["word"], "start": w["start"], "end": w["end"],
                       "probability": round(float(w["probability"]), 4)}
                      for s in res["segments"] for w in s["words"]],
        })
        print(rel, len(files[-1]["words"]), "words")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"openai_whisper": whisper.__version__, "files": files}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["export", "reference"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/oaw_ref"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/whisper_words/reference.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    export(args.work) if args.stage == "export" else reference(args.work, args.out)


if __name__ == "__main__":
    main()
