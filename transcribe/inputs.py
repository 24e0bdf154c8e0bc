"""Inputs: turn the CLI's files, directories and NeMo manifests into a list of audio files.

Each `InputFile` knows the root it was found under, so outputs mirror the input tree
(`talks/a.flac` -> `OUT/talks/a.json`), and carries the manifest's reference text when there
is one (for WER in `transcribe bench`).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

AUDIO_EXTENSIONS = frozenset(
    ".wav .flac .mp3 .ogg .oga .opus .m4a .mp4 .aac .webm .aiff .aif .aifc .au .snd .caf .w64 .sph .wma .mkv".split()
)
MANIFEST_EXTENSIONS = frozenset({".jsonl", ".json"})


class InputError(ValueError):
    """An input argument that names nothing we can transcribe (a usage problem, exit 1)."""


@dataclass(frozen=True)
class InputFile:
    """One audio file to transcribe.

    path: absolute path. rel: path relative to the input root (drives the output path).
    reference: the manifest's `text`, if any. duration: the manifest's `duration` (s), if any.
    """

    path: Path
    rel: Path
    reference: str | None = None
    duration: float | None = None


def discover(inputs: list[str]) -> list[InputFile]:
    """All audio files named by `inputs`, in a stable order, each once."""
    found: list[InputFile] = []
    for arg in inputs:
        p = Path(arg).expanduser()
        if p.is_dir():
            found.extend(_walk(p))
        elif p.suffix.lower() in MANIFEST_EXTENSIONS and p.is_file():
            found.extend(read_manifest(p))
        elif p.exists() or p.suffix.lower() in AUDIO_EXTENSIONS:
            # A missing audio file is still an input: it fails with a reason in results.jsonl.
            found.append(InputFile(p.resolve(), Path(p.name)))
        else:
            raise InputError(f"{arg}: no such file or directory")
    seen: set[Path] = set()
    unique = [f for f in found if not (f.path in seen or seen.add(f.path))]
    return unique


def _walk(root: Path) -> list[InputFile]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            if Path(name).suffix.lower() in AUDIO_EXTENSIONS and not name.startswith("."):
                full = Path(dirpath) / name
                out.append(InputFile(full.resolve(), full.relative_to(root)))
    return out


def read_manifest(path: Path) -> list[InputFile]:
    """A NeMo-style JSONL manifest: one object per line with `audio_filepath` (relative paths
    are relative to the manifest's folder), optional `text` and `duration`."""
    base = path.resolve().parent
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict) or "audio_filepath" not in row:
                raise InputError(f"{path}:{lineno}: no audio_filepath")
            audio = Path(row["audio_filepath"]).expanduser()
            full = (audio if audio.is_absolute() else base / audio).resolve()
            try:
                rel = full.relative_to(base)
            except ValueError:
                rel = Path(full.name)
            dur = row.get("duration")
            out.append(InputFile(full, rel, row.get("text"), float(dur) if dur is not None else None))
    return out


def output_stems(files: list[InputFile]) -> dict[Path, Path]:
    """Map each file to its output path without format extension, relative to `--out`.

    `talks/a.flac` -> `talks/a`; when two inputs in one folder share a stem, both keep their
    audio extension (`talks/a.flac`, `talks/a.wav`) so neither overwrites the other.
    """
    stems = Counter(f.rel.with_suffix("") for f in files)
    return {f.path: (f.rel if stems[f.rel.with_suffix("")] > 1 else f.rel.with_suffix("")) for f in files}


def parse_shard(spec: str) -> tuple[int, int]:
    """`--shard I/N` -> (I, N), 1 <= I <= N; ValueError (a usage error) otherwise."""
    try:
        i_s, n_s = spec.split("/")
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected I/N, e.g. 1/4") from None
    if not (n >= 1 and 1 <= i <= n):
        raise ValueError(f"--shard {spec!r}: need 1 <= I <= N")
    return i, n


def shard(files: list[InputFile], part: tuple[int, int] | None) -> list[InputFile]:
    """The files of shard (I, N) (`parse_shard`; 1-based I): a deterministic split by position
    in sorted order. None: all of them."""
    if part is None:
        return files
    i, n = part
    ordered = sorted(files, key=lambda f: str(f.path))
    return ordered[i - 1 :: n]
