"""Bench: RTFx, per-stage seconds, peak memory and WER for `transcribe bench`.

WER normalisation, applied to hypothesis and reference alike: OpenAI Whisper's
`EnglishTextNormalizer` (the Whisper paper's; the Open ASR Leaderboard normalises with a copy
of it), so that our WERs compare with published ones. It lower-cases; drops bracketed text,
the fillers uh/um/hmm/mm and punctuation; expands contractions and titles ("it's" -> "it is",
"Mr." -> "mister"); writes spelled numbers and currencies as digits ("ten dollars" -> "$10");
and maps British to American spelling ("colour" -> "color"). Before it, typographic apostrophes
are read as ASCII ones (`_APOSTROPHES`). The earlier home-made rules (lower
case and punctuation removal only) counted "Mr."/"mister" and "10"/"ten" as errors: WERs quoted
from before this change were measured with them.
"""
from __future__ import annotations

import functools
import json
import platform
import resource
import sys
from pathlib import Path

# whisper-normalizer 0.1.15 adds these four replacements to OpenAI's list ("the cause" would
# become "the because"); without them it equals openai-whisper's normaliser on every string.
_NOT_OPENAI = (r"\bkinda\b", r"\bsorta\b", r"\bdunno\b", r"\bcause\b")


@functools.lru_cache(maxsize=1)
def _english_normalizer():
    """Built once: it reads a JSON spelling map. Imported here, not at module level, because the
    NeMo and faster-whisper peer venvs import this module with the standard library only."""
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    for pattern in _NOT_OPENAI:
        norm.replacers.pop(pattern, None)
    return norm


# Apostrophes OpenAI's rules do not know, read as "'" first: they match contractions ("n't",
# "'s") by the ASCII one only, so a reference's typographic "Don’t" against a model's "don't"
# scored 2 errors (a perfect transcript of the sonnets 2.57 % WER, of manifest_eval_short 0.32 %).
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def normalize_text(text: str) -> str:
    """OpenAI's English normalisation (see the module docstring), after the typographic
    apostrophes are read as ASCII ones; edge spaces stripped."""
    return " ".join(_english_normalizer()(text.translate(_APOSTROPHES)).split())


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance between two sequences (words, token ids): insertions, deletions and
    substitutions each cost 1. Standard library only: the NeMo peer's venv imports it too."""
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[:], i
        for j in range(1, len(b) + 1):
            d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1]


def normalized_pairs(references: list[str], hypotheses: list[str]) -> list[tuple[str, str]]:
    """(reference, hypothesis) pairs after `normalize_text`, without the references that have no
    letter or digit left: OpenAI's normaliser keeps a lone "." of an ellipsis ("..." -> "."),
    which is no word to recognise. Shared with bench/nemo_peer.py so both peers skip alike."""
    pairs = [(normalize_text(r), normalize_text(h)) for r, h in zip(references, hypotheses)]
    return [(r, h) for r, h in pairs if any(c.isalnum() for c in r)]


def wer(references: list[str], hypotheses: list[str]) -> float | None:
    """Corpus WER (total edits / total reference words) over `normalized_pairs`; None if empty."""
    import jiwer

    pairs = normalized_pairs(references, hypotheses)
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
    return f"cpu ({cpu_model()}, {_threads()} threads)"


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9B45", "Intel(R) Xeon(R) Processor"): the figures of two
    reports compare only on alike CPUs. Linux says it in /proc/cpuinfo; `platform.processor()`
    there says only "x86_64"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def peak_gpu_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(torch.device(device)))


def build_report(stats, files, model: str, device: str, load_seconds: float, total_seconds: float,
                 runtime: str = "", settings: dict | None = None) -> dict:
    """The bench report of the contract, plus load-excluded (steady-state) figures and how the
    model ran: `runtime` (backend, dtypes, decoder mode: the startup line's) and `settings`
    (language, task, prompt: what results.jsonl records), so two reports say why they differ."""
    refs = [(f.reference, stats.texts.get(f.key, "")) for f in files if f.reference is not None]
    stages = {k: round(v, 4) for k, v in sorted(stats.stage_seconds.items())}
    stages["load_model"] = round(load_seconds, 4)
    main_peak = peak_rss_bytes()
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
        # The run's processes together: the main one's peak plus each worker's still running at
        # the end. Pages they share (libraries, the feature slab) count in each.
        "peak_memory_bytes": main_peak + stats.workers_peak_bytes,
        "peak_memory_main_bytes": main_peak,
        "peak_gpu_memory_bytes": peak_gpu_bytes(device),
        "transcribe_seconds": round(stats.wall_seconds, 3),
        "rtfx_steady": round(stats.rtfx, 3),
        # share of the batches the model computed that was padding (batches pad to their longest)
        "padding_fraction": round(stats.padding_fraction, 4),
        "runtime": runtime,
        "settings": dict(settings or {}),
    }


def write_report(report: dict, path: Path) -> None:
    from transcribe.writers import atomic_write_text

    atomic_write_text(path, json.dumps(report, indent=1) + "\n")


def summary_line(report: dict) -> str:
    w = report["wer"]
    wer_s = f", WER {100 * w:.2f}%" if w is not None else ""
    failed = report.get("files_failed") or 0  # a run whose files failed is no measurement of the model
    failed_s = f" ({failed} failed)" if failed else ""
    return (
        f"{report['model']}: {report['files']} files{failed_s}, {report['audio_seconds'] / 3600:.3f} h audio in "
        f"{report['wall_seconds']:.2f} s, RTFx {report['rtfx']:.1f} (steady {report['rtfx_steady']:.1f}){wer_s}"
    )
