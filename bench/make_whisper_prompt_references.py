#!/usr/bin/env python3
"""Record OpenAI Whisper's own decoding with an initial prompt (`--prompt`) for the bundled
whisper-base on real speech, and its tokenizer's ids for a set of texts (golden references for
tests/test_whisper_prompt.py).

Two stages in two virtualenvs, as bench/make_whisper_word_references.py (whose export this
reuses: the bundled weights as an OpenAI checkpoint and the same recordings as .npy):

    .venv/bin/python bench/make_whisper_word_references.py export --work /tmp/oaw_ref
    /work/venvs/oaw/bin/python bench/make_whisper_prompt_references.py --work /tmp/oaw_ref \
        [--out tests/data/whisper_prompt/reference.json]

The second stage (a venv with `pip install torch openai-whisper`) runs `model.transcribe(audio,
language=L, initial_prompt=P, temperature=0.0, fp16=False, condition_on_previous_text=False)`:
greedy, no fallback, as the test decodes. Every file is <= 30 s, so it is one window and the
prompt is before it (OpenAI gives the initial prompt to the first window only); a run whose text
stopped early, so that OpenAI decoded the rest as a second window without the prompt, is left
out.

reference.json: {"openai_whisper": version, "texts": [{"text", "ids"}] (tiktoken's
`encode(text)` of the multilingual vocabulary), "prompts": [{"prompt", "ids"} (OpenAI's
`encode(" " + prompt.strip())`)], "runs": [{"audio", "prompt" (index), "language" (asked for:
"en", or null to detect), "detected", "detected_probability" (detect_language's on the
window decoded, which is what we detect from), "text", "segments": [{start, end, text, tokens,
avg_logprob, no_speech_prob}]}]}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from make_whisper_word_references import FILES, SPEECH  # noqa: E402

# What users write in a prompt: the spelling of names and terms, a style to follow, and one
# longer than OpenAI keeps (its last n_text_ctx // 2 - 1 = 223 tokens are kept).
PROMPTS = [
    "Mr. Quilter, Kennedy, Leopold, Nguyễn, turnips; Kubernetes and gRPC.",
    "um, uh, so like, you know, i mean, lowercase words without any punctuation at all",
    " ".join(["Glossary: the Supreme Court of the United States, the Massachusetts Bay Colony, "
              "Yoknapatawpha County, Tchaikovsky's 1812 Overture, the 3rd of September 1939."] * 12),
]
# Files decoded with each prompt (all with the first); the language auto-detected with the first.
STYLE_FILES = FILES[:6]
DETECT_FILES = FILES[::3]
TEXTS = [
    " Hello world", " Kubernetes, gRPC and PyTorch.", " Dr. Nguyễn Văn Thành met Ms. O'Brien at 3:45pm",
    " I'm sure they'll've done it; we'd've", " naïve café résumé — “quoted” text…", " 1234567 ½ ² Ⅷ 3.14159",
    "   leading spaces and trailing   ", " tabs\tand\nnewlines\n\n here", " 東京は日本の首都です。", " Привет, мир!",
    " emoji 😀👍🏽 and ♪ music ♪", " <|endoftext|> looks like a special token", " x x x x x",
    " Sgt. Pepper's Lonely-Hearts Club", " Mr. Quilter is the apostle of the middle classes",
    " CamelCaseWordsAndSNAKE_CASE_words", " ''' \"\" ` ~~~", " ١٢٣ عربي", " e-mail: someone@example.com, https://x.y/z?q=1",
    "", " ", "the", " the", "\n", " 'quoted' and \"double\" DON'T WON'T Y'ALL",
]


def runs(model, work: Path) -> list[dict]:
    import numpy as np

    plan = [(rel, 0, "en") for rel in FILES] + [(rel, p, "en") for p in (1, 2) for rel in STYLE_FILES]
    plan += [(rel, 0, None) for rel in DETECT_FILES]
    out = []
    for rel, p, lang in plan:
        audio = np.load(work / (rel.replace("/", "__") + ".npy"))
        res = model.transcribe(audio, language=lang, initial_prompt=PROMPTS[p], temperature=0.0, fp16=False,
                               condition_on_previous_text=False, verbose=None)
        seeks = {s["seek"] for s in res["segments"]}
        if seeks - {0}:  # it stopped early and went on in a second window, where the prompt is gone
            print(rel, p, lang, f"left out: decoded in more than one window (seeks {sorted(seeks)})")
            continue
        if lang is None:  # detect_language on the window decoded (transcribe detects on the padded mel)
            import whisper

            mel = whisper.log_mel_spectrogram(audio, padding=whisper.audio.N_SAMPLES)
            window = whisper.pad_or_trim(mel[:, :mel.shape[-1] - whisper.audio.N_FRAMES], whisper.audio.N_FRAMES)
            _, probs = model.detect_language(window)
            best = max(probs, key=probs.get)
            if best != res["language"]:
                sys.exit(f"{rel}: transcribe detected {res['language']}, its window {best}")
        out.append({"audio": str(SPEECH / rel), "prompt": p, "language": lang, "detected": res["language"],
                    "detected_probability": None if lang else probs[best],
                    "text": res["text"].strip(),
                    "segments": [{"start": s["start"], "end": s["end"], "text": s["text"].strip(),
                                  "tokens": s["tokens"], "avg_logprob": s["avg_logprob"],
                                  "no_speech_prob": s["no_speech_prob"]} for s in res["segments"]]})
        print(rel, p, lang, "->", out[-1]["text"][:70])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/oaw_ref"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/whisper_prompt/reference.json")
    args = ap.parse_args()
    import whisper
    from whisper.tokenizer import get_tokenizer

    tok = get_tokenizer(multilingual=True)
    model = whisper.load_model(str(args.work / "base.pt"), device="cpu")
    ref = {"openai_whisper": whisper.__version__,
           "texts": [{"text": t, "ids": tok.encoding.encode(t, disallowed_special=())} for t in TEXTS],
           "prompts": [{"prompt": p, "ids": tok.encode(" " + p.strip())} for p in PROMPTS],
           "runs": runs(model, args.work)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
