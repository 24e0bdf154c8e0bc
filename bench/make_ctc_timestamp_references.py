#!/usr/bin/env python3
"""NeMo's CTC text, word and segment times on greedy paths over a tokenizer with punctuation,
for tests/test_timestamps.py (the shared fixtures' vocabulary has only "'" for punctuation).

Runs INSIDE the NeMo virtualenv (bench/README.md, section 1):

    /work/venvs/nemo/bin/python bench/make_ctc_timestamp_references.py [--out tests/data/ctc_timestamps]

Trains a small SentencePiece BPE model on punctuated English, German, French, Russian and
Greek sentences (identity normalisation: a small file; `tokenizer.model`), then draws random
greedy CTC label paths (blanks, repeats, runs of 1-3 frames) over token ids weighted towards
punctuation, pieces that begin with punctuation ("...", "»,"), bare and word-start pieces.
NeMo 3.0.0's `CTCBPEDecoding.ctc_decoder_predictions_tensor(compute_timestamps=True)` and
`process_timestamp_outputs` give each path's text, words and segments (seconds, 10 ms x 8).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOW_STRIDE, SUBSAMPLING = 0.01, 8
CASES = 400
SENTENCES = [
    "Hello, world! Is it you? Yes... it's me, Dr. Smith.",
    "\"Wait,\" she said. \"Don't go!\" He didn't listen; he left.",
    "The price is 5.50 euros (about $6), isn't it?",
    "What?! No way... really? Okay, okay.",
    "Guten Tag! Wie geht's? Die Straße ist groß, „sehr groß“.",
    "Bonjour, ça va ? Oui ! « Très bien », dit-il.",
    "«Привет», сказал он. «Как дела?» — «Хорошо!»",
    "Καλημέρα! Τι κάνεις; Καλά, ευχαριστώ.",
    "One, two, three... four! Five? Six; seven: eight.",
    "It's the end -- or is it? We'll see, won't we!",
]


def train_tokenizer(path: Path) -> None:
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text("\n".join(SENTENCES * 20) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=160,
                                       model_type="bpe", character_coverage=1.0, normalization_rule_name="identity",
                                       num_threads=1, minloglevel=2)
        path.write_bytes((Path(tmp) / "m.model").read_bytes())


def greedy_path(tokens: list[int], rng: random.Random, blank: int) -> list[int]:
    """A per-frame label path whose CTC collapse is `tokens`."""
    labels = [blank] * rng.randint(0, 2)
    prev = None
    for t in tokens:
        if t == prev or rng.random() < 0.4:
            labels += [blank] * rng.randint(1, 3)
        labels += [t] * rng.randint(1, 3)
        prev = t
    return labels + [blank] * rng.randint(0, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "ctc_timestamps")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from nemo.collections.asr.parts.submodules.ctc_decoding import CTCBPEDecoding
    from nemo.collections.asr.parts.utils.timestamp_utils import process_timestamp_outputs
    from nemo.collections.common.tokenizers import SentencePieceTokenizer
    from nemo.utils import logging as nemo_logging
    from omegaconf import OmegaConf

    nemo_logging.setLevel(logging.ERROR)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tokenizer.model"
    train_tokenizer(model)
    tok = SentencePieceTokenizer(model_path=str(model))
    vocab = tok.vocab_size
    tok.tokenizer.vocab_size = vocab  # what NeMo's ASRBPEMixin attaches (the decoding reads it)
    decoding = CTCBPEDecoding(OmegaConf.create({"strategy": "greedy_batch", "compute_timestamps": True}), tok)
    punct = set(decoding.supported_punctuation)
    pieces = [tok.tokenizer.id_to_piece(i) for i in range(vocab)]
    texts = [tok.ids_to_text([i]) for i in range(vocab)]
    pools = [
        [i for i, t in enumerate(texts) if t in punct],  # a mark alone
        [i for i, t in enumerate(texts) if t and t[0] in punct and t not in punct],  # "...", "»,"
        [i for i, p in enumerate(pieces) if p.startswith("\u2581") and len(p) > 1],  # word starts
        [i for i, p in enumerate(pieces) if p == "\u2581"],
        [i for i, p in enumerate(pieces) if not p.startswith(("\u2581", "<"))],  # word insides
    ]
    pools = [p for p in pools if p]
    rng = random.Random(1234)
    cases = []
    for _ in range(CASES):
        tokens = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 14))]
        labels = greedy_path(tokens, rng, blank=vocab)
        logits = torch.full((1, len(labels), vocab + 1), -10.0)
        logits[0, torch.arange(len(labels)), torch.tensor(labels)] = 0.0
        hyp = decoding.ctc_decoder_predictions_tensor(logits.log_softmax(-1), torch.tensor([len(labels)]),
                                                      return_hypotheses=True)[0]
        hyp = process_timestamp_outputs([hyp], SUBSAMPLING, WINDOW_STRIDE)[0]
        cases.append({"labels": labels, "text": hyp.text,
                      "words": [[w["word"], float(w["start"]), float(w["end"])] for w in hyp.timestamp["word"]],
                      "segments": [[s["segment"], float(s["start"]), float(s["end"])]
                                   for s in hyp.timestamp["segment"]]})
    (args.out / "reference.json").write_text(json.dumps(
        {"nemo": "3.0.0", "window_stride": WINDOW_STRIDE, "subsampling_factor": SUBSAMPLING, "blank": vocab,
         "punctuation": sorted(punct), "cases": cases}, ensure_ascii=False, indent=None) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases and the tokenizer ({model.stat().st_size} bytes) to {args.out}")


if __name__ == "__main__":
    main()
