"""The command line's options: their help texts, the exit statuses, and the checks made on
options as typed, before any model loads (a bad value is a usage error, exit 2; a folder that
cannot be written is exit 1), so a typo never costs a minute of model loading, nor the
seconds of importing torch (nothing here imports it).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

# The exit statuses, a contract other tools rely on (`cli.py`'s docstring says when each is given).
EXIT_OK, EXIT_NOTHING_RAN, EXIT_USAGE, EXIT_SOME_FAILED = 0, 1, 2, 3

# Options that several commands take, defined once (typer reads these as the parameters' defaults).
WORKERS = typer.Option(None, "--workers", "-j", min=1, help="Preprocessing worker processes (decode, resample, VAD, "
                       "features). Default: 1 on 2 cores, else half the cores (max 8).")
ENCODER_BACKEND = typer.Option("auto", "--encoder-backend", help="Parakeet encoder: auto (cuda-graphs on CUDA, torch on "
                               "CPU), torch, compile, cuda-graphs, tensorrt.")
DECODER_MODE = typer.Option("auto", "--decoder-mode", help="Decoder loop (Parakeet and Whisper): auto (CUDA: full-graph, "
                            "or unrolled where conditional nodes are unsupported; CPU: eager), full-graph (one CUDA "
                            "graph with conditional while nodes), unrolled, eager.")
DTYPE = typer.Option("auto", "--dtype", help="Encoder compute dtype (Parakeet and Whisper): auto (= float32; Whisper: "
                     "float16 on CUDA; on the CPU bfloat16 where its GEMMs time faster than float32's at startup), float32, "
                     "bfloat16 (CPUs with AVX512_BF16/AMX, CUDA sm80+; encoders ~1.9x faster on AMD Zen 5, 3.5-4.5x "
                     "with Intel AMX, slower on AVX512_BF16 without AMX; Whisper's CPU decoder staying float32), "
                     "float16 (CUDA).")
LANGUAGE = typer.Option(None, "--language", "-l", help="Whisper: the spoken language, a code or a name (default en; de "
                        "or german, fr, ... as the model's vocabulary has them), or auto to detect it once per file, "
                        "from its first piece with speech. Parakeet models take none.")
PROMPT = typer.Option(None, "--prompt", help="Whisper: text the model reads as coming before every piece of every file "
                      "(OpenAI's initial_prompt): names, terms and spellings to use, or a style (punctuation, casing) "
                      "to follow. Parakeet models take none.")
TASK = typer.Option("transcribe", "--task", help="Whisper: transcribe (default), or translate the speech into English "
                    "(multilingual models).")
FEATURES_ON = typer.Option("auto", "--features-on", help="Parakeet log-mel features: auto (= workers for now), workers "
                           "(preprocessing processes), device (the model's GPU or CPU).")
DEVICE = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N (auto: cuda when available).")
BATCH_SECONDS = typer.Option(300.0, "--batch-seconds", min=1.0, help="Padded audio seconds per model batch (a batch out "
                             "of memory runs again in halves).")
MODEL = typer.Option(None, "--model", "-m", help="Registry name (see `transcribe models`) or a checkpoint's path: a .nemo file, or a "
                     "Whisper .pt, .safetensors, CTranslate2 or Hugging Face folder. "
                     "Default: $TRANSCRIBE_MODEL, else parakeet-tdt-0.6b-v2 if cached, else the bundled whisper-base.")

# `serve --log-level`: its names, and the least severe of our log lines each shows.
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def fail(message: str, code: int) -> typer.Exit:
    """Print `error: message` on stderr; the caller raises the returned Exit(code)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def writable_folder(folder: Path, option: str) -> None:
    """Create `folder` and write a probe file in it: an --out or --json that cannot be written
    (a file in the way, no permission, a read-only disk) fails here, before the model loads,
    not after the whole run with a traceback."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.EEXIST:  # mkdir's word for it: "File exists", of this folder or one above
            there = Path(e.filename) if e.filename else folder
            reason = "a symlink to nothing" if there.is_symlink() and not there.exists() else "not a folder"
            reason = reason if there == folder else f"{there} is {reason}"
        raise fail(f"{option} {folder}: cannot write there ({reason})", EXIT_NOTHING_RAN)


def out_folder(folder: Path) -> None:
    """An --out, checked before the model loads: writable (`writable_folder`), its
    results.jsonl a file this user can read and append to if there is one (another user's,
    in a shared folder, was a traceback once the model had loaded), its lock file one that
    opens, and no other run writing there."""
    from transcribe.resume import LOCK_NAME, OutputBusy, out_dir_lock

    writable_folder(folder, "--out")
    log = folder / "results.jsonl"  # every --out holds one, appended to as files finish
    if log.exists() and not log.is_file():
        raise fail(f"--out {folder}: {log} is not a file", EXIT_NOTHING_RAN)
    if log.is_symlink() and not log.exists():
        raise fail(f"--out {folder}: {log} is a symlink to nothing", EXIT_NOTHING_RAN)
    if log.exists():
        try:  # what the run does to it: read its tail (a repair) and append
            os.close(os.open(log, os.O_RDWR | os.O_APPEND))
        except OSError as e:
            raise fail(f"--out {folder}: {log} cannot be written ({e.strerror or e})", EXIT_NOTHING_RAN)
    try:  # another run writing there (an overlapping cron job) is found before a model loads for nothing
        with out_dir_lock(folder):
            pass
    except OutputBusy as e:
        raise fail(f"{e}; wait for it to finish, or write to another --out", EXIT_NOTHING_RAN)
    except OSError as e:
        raise fail(f"--out {folder}: its lock file {folder / LOCK_NAME} cannot be opened ({e.strerror or e})",
                   EXIT_NOTHING_RAN)


def refuse_empty(args: List[Optional[str]], what: str, names: str = "folder") -> None:
    """An empty argument (`"$DIR"` with DIR unset) would be Path(""), which is ".": a whole
    working folder (a cron job's $HOME) walked as INPUT or merged as a shard, transcripts,
    results.jsonl and the lock written into it, over any same-named .txt there. A usage error
    instead, before anything is read or written."""
    if "" in args:
        raise fail(f"{what} is empty (an unset variable?): it names no {names}", EXIT_USAGE)


def folder_option(out: Optional[str], option: str = "--out") -> Optional[Path]:
    """A folder option as typed (--out, export-engine's --cache-dir), refused when empty."""
    refuse_empty([out], option)
    return None if out is None else Path(out)


def file_path(path: Optional[Path], option: str) -> None:
    """A --json or --onnx that names a folder (or nothing) is a usage error, found before the
    run rather than when its report is written at the end."""
    if path is not None and (path.is_dir() or not path.name):
        raise fail(f"{option} {str(path) or repr('')}: names a folder, not a file", EXIT_USAGE)


def check_choice(option: str, value: str, choices, verb: str = "expected") -> None:
    """A usage error naming the option and its choices unless `value` is one of `choices`."""
    choices = list(choices)
    if value not in choices:
        raise fail(f"{option} {value!r}: {verb} one of {', '.join(choices)}", EXIT_USAGE)


def check_runtime(device: str, dtype: str) -> None:
    """--device and --dtype name something that exists (whether this machine has it is the
    model loader's to say)."""
    from engines.choices import DTYPE_CHOICES

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise fail(f"--device {device!r}: expected auto, cpu, cuda or cuda:N", EXIT_USAGE)
    check_choice("--dtype", dtype, DTYPE_CHOICES)


def check_streaming(chunk_ms: Optional[float], left_ms: Optional[float], right_ms: Optional[float]) -> None:
    """The chunking options of `stream` and `serve`: finite, chunks longer than nothing, a
    window (left + chunk + right, defaults for those not given) of at most MAX_WINDOW_MS."""
    from engines.choices import DEFAULT_CHUNK_MS, DEFAULT_LEFT_MS, DEFAULT_RIGHT_MS, MAX_WINDOW_MS

    for option, value, least in (("--chunk-ms", chunk_ms, 1e-9), ("--left-context-ms", left_ms, 0.0),
                                 ("--right-context-ms", right_ms, 0.0)):
        if value is not None and not (math.isfinite(value) and value >= least):
            need = "> 0" if least else ">= 0"
            raise fail(f"{option} {value}: expected a number of milliseconds {need}", EXIT_USAGE)
    window = sum(d if v is None else v for v, d in ((chunk_ms, DEFAULT_CHUNK_MS), (left_ms, DEFAULT_LEFT_MS),
                                                     (right_ms, DEFAULT_RIGHT_MS)))
    if window > MAX_WINDOW_MS:
        raise fail(f"--left-context-ms + --chunk-ms + --right-context-ms: {window:g} ms, expected at most "
                   f"{MAX_WINDOW_MS} (each step re-encodes that window)", EXIT_USAGE)
