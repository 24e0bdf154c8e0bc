"""Bench: RTFx, per-stage seconds, peak memory and WER for `transcribe bench`.

WER normalisation (applied to hypothesis and reference alike): Unicode NFKC, lower case,
every character that is not a letter, digit, apostrophe or space becomes a space, apostrophes
at word edges are dropped, whitespace collapsed. Numbers are not spelled out. This is the
LibriSpeech convention (its references are upper case without punctuation).
"""
from __future__ import annotations

import json
import platform
import re
import resource
import sys
import unicodedata
from pathlib import Path

_NON_WORD = re.compile(r"[^\w' ]+")
_EDGE_APOS = re.compile(r"(^|\s)'+|'+(\s|$)")


def normalize_text(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).lower().replace("_", " ")
    t = _NON_WORD.sub(" ", t)
    t = _EDGE_APOS.sub(r"\1 \2", t)
    return " ".join(t.split())


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance between two sequences (words, token ids): insertions, deletions and
    substitutions each cost 1. Standard library only: the NeMo peer's venv imports it too."""
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[:], i
        for j in range(1, len(b) + 1):
            d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1]


def wer(references: list[str], hypotheses: list[str]) -> float | None:
    """Corpus WER (total edits / total reference words) after `normalize_text`; None if empty."""
    import jiwer

    pairs = [(normalize_text(r), normalize_text(h)) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        return None
    out = jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs])
    return out.wer


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()}, {_threads()} threads)"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def peak_gpu_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(torch.device(device)))


def build_report(stats, files, model: str, device: str, load_seconds: float, total_seconds: float) -> dict:
    """The bench report of the contract, plus load-excluded (steady-state) figures."""
    refs = [(f.reference, stats.texts.get(f.path, "")) for f in files if f.reference is not None]
    stages = {k: round(v, 4) for k, v in sorted(stats.stage_seconds.items())}
    stages["load_model"] = round(load_seconds, 4)
    return {
        "audio_seconds": round(stats.audio_seconds, 3),
        "wall_seconds": round(total_seconds, 3),
        "rtfx": round(stats.audio_seconds / total_seconds, 3) if total_seconds > 0 else 0.0,
        "wer": None if not refs else wer([r for r, _ in refs], [h for _, h in refs]),
        "files": stats.files_ok + stats.files_failed,
        "files_failed": stats.files_failed,
        "stages": stages,
        "device": device_name(device),
        "model": model,
        "peak_memory_bytes": peak_rss_bytes(),
        "peak_gpu_memory_bytes": peak_gpu_bytes(device),
        "transcribe_seconds": round(stats.wall_seconds, 3),
        "rtfx_steady": round(stats.rtfx, 3),
        # share of the batches the model computed that was padding (batches pad to their longest)
        "padding_fraction": round(stats.padding_fraction, 4),
    }


def write_report(report: dict, path: Path) -> None:
    from transcribe.writers import atomic_write_text

    atomic_write_text(path, json.dumps(report, indent=1) + "\n")


def summary_line(report: dict) -> str:
    w = report["wer"]
    wer_s = f", WER {100 * w:.2f}%" if w is not None else ""
    return (
        f"{report['model']}: {report['files']} files, {report['audio_seconds'] / 3600:.3f} h audio in "
        f"{report['wall_seconds']:.2f} s, RTFx {report['rtfx']:.1f} (steady {report['rtfx_steady']:.1f}){wer_s}"
    )
