#!/usr/bin/env python3
"""NeMo's transcripts of inputs the shared fixtures lack, for tests/test_nemo_edges.py:
recordings at other rates than 16 kHz, and files shorter than one 25 ms window.

Runs INSIDE the NeMo virtualenv (bench/README.md, section 1):

    /work/venvs/nemo/bin/python bench/make_edge_references.py [--out tests/data/nemo_edge]

Two fixture recordings (LibriSpeech test-other, 16 kHz, 16-bit) are turned into files at 8,
22.05, 44.1 and 48 kHz by `derived_audio`, whose arithmetic is exact or IEEE-determined, so the
test rebuilds the same bytes without a resampler of its own; and the second one's first
SHORT samples are files of their own (16 kHz). NeMo 3.0.0 `transcribe()`
(lhotse's resampling) runs on them with each model of MODELS: `text`, `words` (timestamps=True,
batch of one) and `transcribe_text` (batch of 4, a freshly restored model), as in the shared
fixtures (../shared/fixtures/README.md). Also recorded: the samples lhotse hands the model
(`Recording.from_file(p).resample(16000).load_audio()`): their count and a few statistics.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures" / "nemo_reference"
SOURCES = ["1688-142285-0002.flac", "1688-142285-0005.flac"]  # 2.8 s and 4.3 s
RATES = (8000, 22050, 44100, 48000)
SHORT = (1, 100, 159, 160, 200, 399, 400)
MODELS = ("tdt_tiny", "rnnt_tiny", "tdt_128mel")


def derived_audio(pcm: np.ndarray, rate: int) -> np.ndarray:
    """16 kHz int16 samples -> int16 samples at `rate`, without a resampler: every other sample
    (8 kHz), each sample thrice (48 kHz), linear interpolation rounded half to even (others).
    Crude on purpose: only the bytes matter, and these are the same on any machine."""
    if rate == 8000:
        return pcm[::2].copy()
    if rate == 48000:
        return np.repeat(pcm, 3)
    n = (pcm.shape[0] * rate) // 16000
    at = np.arange(n, dtype=np.float64) * (16000 / rate)
    return np.rint(np.interp(at, np.arange(pcm.shape[0], dtype=np.float64), pcm.astype(np.float64))).astype(np.int16)


def write_inputs(folder: Path, speech: Path) -> list[Path]:
    """The derived files, `<stem>_<rate>.wav`, written into `folder`."""
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SOURCES:
        pcm, rate = sf.read(speech / name.split("-")[0] / name, dtype="int16")
        assert rate == 16000
        for target in RATES:
            path = folder / f"{Path(name).stem}_{target}.wav"
            sf.write(path, derived_audio(pcm, target), target, subtype="PCM_16")
            paths.append(path)
    for n in SHORT:
        path = folder / f"{Path(SOURCES[-1]).stem}_first{n}.wav"
        sf.write(path, pcm[:n], 16000, subtype="PCM_16")
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "nemo_edge")
    args = ap.parse_args()

    import logging

    import torch
    from lhotse import Recording
    from nemo.collections.asr.models import ASRModel
    from nemo.utils import logging as nemo_logging
    from omegaconf import open_dict
    nemo_logging.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    paths = write_inputs(args.out / "audio", ROOT.parent / "shared" / "data" / "speech" / "librispeech_test_other")

    def restore(variant):
        m = ASRModel.restore_from(str(FIXTURES / variant / "model.nemo"), map_location=torch.device("cpu"))
        m = m.to(torch.float32).eval()
        with open_dict(m.cfg):
            m.cfg.validation_ds = {"use_start_end_token": False}
        return m

    report = {"sources": SOURCES, "rates": list(RATES), "short": list(SHORT), "files": {}}
    for p in paths:
        x = Recording.from_file(str(p)).resample(16000).load_audio()[0]
        report["files"][p.name] = {"lhotse_samples": int(x.shape[0]), "lhotse_rms": float(np.sqrt(np.mean(x ** 2))),
                                   "lhotse_head": [float(v) for v in x[1000:1008]], "models": {}}
    for variant in MODELS:
        m = restore(variant)
        for p in paths:
            hyp = m.transcribe([str(p)], batch_size=1, verbose=False, timestamps=True, return_hypotheses=True)
            hyp = (hyp[0] if isinstance(hyp, tuple) else hyp)[0]
            words = [{"word": w["word"], "start": float(w["start"]), "end": float(w["end"])}
                     for w in hyp.timestamp.get("word", [])]
            report["files"][p.name]["models"][variant] = {"text": hyp.text, "words": words}
        m = restore(variant)
        texts = m.transcribe([str(p) for p in paths], batch_size=4, verbose=False)
        for p, t in zip(paths, texts[0] if isinstance(texts, tuple) else texts):
            report["files"][p.name]["models"][variant]["transcribe_text"] = t if isinstance(t, str) else t.text
        print(variant, "done", flush=True)
    for p in paths:  # the test rebuilds them: only the transcripts are kept
        p.unlink()
    (args.out / "audio").rmdir()
    (args.out / "reference.json").write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out / "reference.json")


if __name__ == "__main__":
    main()
