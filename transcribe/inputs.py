"""Inputs: turn the CLI's files, directories and NeMo manifests into a list of audio files.

Each `InputFile` knows the root it was found under, so outputs mirror the input tree
(`talks/a.flac` -> `OUT/talks/a.json`), and carries the manifest's reference text when there
is one (for WER in `transcribe bench`).
"""
from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

# Every extension decode.py reads (libsndfile's, and decode.AV_EXTENSIONS through PyAV): a
# folder's .mov, .m4b (audiobooks) or .3gp / .amr (phone recorders) were skipped without a word.
AUDIO_EXTENSIONS = frozenset(
    ".wav .flac .mp3 .mp2 .ogg .oga .opus .aiff .aif .aifc .au .snd .caf .w64 .rf64 .sph "
    ".m4a .m4b .mp4 .aac .webm .weba .mkv .mka .mov .wma .3gp .3g2 .amr".split()
)
MANIFEST_EXTENSIONS = frozenset({".jsonl", ".json"})


class InputError(ValueError):
    """An input argument that names nothing we can transcribe (a usage problem, exit 1)."""


@dataclass(frozen=True)
class InputFile:
    """One audio file to transcribe.

    path: absolute path. rel: path relative to the input root (drives the output path).
    reference: the manifest's `text`, if any. duration: the manifest's `duration` (s), if any.
    problem: why this input fails without being opened (a manifest line that cannot be read).
    stem: its output path relative to --out without the format extension, once `discover`
    has named all the inputs (`output_stems`).
    offset: a segment of the file, from `offset` s for `duration` s (to its end when None):
    NeMo manifests cut long recordings so. None: the whole file.
    cap: a lone `offset: 0` line's `duration`: the whole file, named and resumed as one, read
    to that length at most, as NeMo (lhotse) reads a line with an offset.
    line: `MANIFEST:LINE` of an input a manifest names, to fail it under when its line is at odds
    with another input's.
    """

    path: Path
    rel: Path
    reference: str | None = None
    duration: float | None = None
    problem: str | None = None
    stem: Path | None = None
    offset: float | None = None
    line: Path | None = None
    cap: float | None = None

    @property
    def key(self) -> Path:
        """What tells this input apart: its path, with `@OFFSET` for a segment (results.jsonl's
        `audio_filepath` and `offset` name it the same way, `record_key`)."""
        return _key(self.path, self.offset)

    @property
    def span(self) -> tuple[float, float | None] | None:
        """(start s, length s or None) of a segment or a capped file, for the decoder; None:
        the whole file."""
        if self.offset is None:
            return None if self.cap is None else (0.0, self.cap)
        return self.offset, self.duration


def record_key(record: dict) -> Path:
    """The `InputFile.key` of a results.jsonl record."""
    return _key(record["audio_filepath"], record.get("offset"))


def _key(path: str | Path, offset: float | None) -> Path:
    if offset is None:
        return path if isinstance(path, Path) else Path(path)  # a Path as is: asked for ~8 times a file
    return Path(f"{path}@{float(offset)!r}")  # repr: exact


def absolute(path: Path) -> Path:
    """`path` made absolute without following links: results.jsonl names a file as the user
    does (a dataset of links, git-annex or the Hugging Face cache, would otherwise be logged
    under blob names its outputs do not have), and a manifest's `data/x.flac` through a linked
    `data/` keeps its folders in the output name."""
    return Path(os.path.abspath(path))


def discover(inputs: list[str]) -> list[InputFile]:
    """All audio files named by `inputs`, in a stable order, each once."""
    found: list[InputFile] = []
    roots: list[int | None] = []  # per input found: the folder argument it was found under
    missing: list[str] = []
    for n, arg in enumerate(inputs):
        p, before = Path(arg).expanduser(), len(found)
        try:
            kind = "dir" if p.is_dir() else "file" if p.is_file() else "other" if p.exists() else None
        except OSError as e:  # a path the system refuses to look at (no permission, too long)
            kind, refused = "refused", f"{arg}: cannot look at it ({e.strerror or e})"
        if kind == "refused":
            found.append(InputFile(absolute(p), Path(p.name[:200]), problem=refused))
        elif kind == "dir":
            found.extend(_walk(p))
        elif kind == "file" and p.suffix.lower() in MANIFEST_EXTENSIONS:
            try:
                found.extend(read_manifest(p))
            except OSError as e:  # no permission to read it, an I/O error: it fails alone, as a folder that cannot be listed
                found.append(InputFile(absolute(p), Path(p.name),
                                       problem=f"{arg}: cannot read this manifest ({e.strerror or e})"))
        else:
            # A missing input among others is still an input: it fails with a reason in
            # results.jsonl (a file list from yesterday, one since deleted; a folder a cron
            # job names that is not there today), and the job goes on with the rest.
            problem = None if kind or p.suffix.lower() in AUDIO_EXTENSIONS else f"{arg}: no such file or directory"
            found.append(InputFile(absolute(p), Path(p.name), problem=problem))
            if kind is None:
                missing.append(arg)
        roots.extend([n if kind == "dir" else None] * (len(found) - before))
    if missing and len(missing) == len(found):  # nothing at all to transcribe (a glob that matched nothing)
        raise InputError(f"{', '.join(missing)}: no such file or directory")
    found = _one_reference_each(found)
    seen: set[Path] = set()
    first = [i for i, f in enumerate(found) if not (f.key in seen or seen.add(f.key))]
    unique = _distinct_rels([found[i] for i in first], [roots[i] for i in first])
    # Output names pinned over all the inputs, before any --shard takes its part of them.
    stems = output_stems(unique)
    return [replace(f, stem=stems[f.key]) for f in unique]


def _one_reference_each(found: list[InputFile]) -> list[InputFile]:
    """Inputs named twice are transcribed once (the first), so the reference WER is scored
    against must not go with the one dropped: a file named by a folder (or a bare argument)
    before a manifest line gives it a `text` takes that text, and a manifest line giving an
    input a second, different text fails under its own line instead of being dropped unseen
    (the first text is scored; the failed line's is not, as no line that fails to be read is).
    A lone `offset: 0` line's `cap` goes with its text: named by a folder first, the file was
    read whole again and scored against the line's 15 s of text."""
    out, first = list(found), {}
    for i, f in enumerate(found):
        j = first.setdefault(f.key, i)
        if j != i and f.cap is not None and out[j].cap is None:
            out[j] = replace(out[j], cap=f.cap)  # a folder's mention says nothing of how much to read
        if j == i or f.reference is None or f.reference == out[j].reference:
            continue  # the first of its kind, or a plain repeat
        if out[j].reference is None:
            out[j] = replace(out[j], reference=f.reference)
        else:
            assert f.line is not None  # only a manifest line gives a reference
            out[i] = replace(f, path=f.line, rel=Path(f.line.name), offset=None, reference=None,
                             problem=f"{f.line}: names {_key(f.path, f.offset)} again, with a different "
                                     f"`text` (the reference of its first mention is used)")
    return out


def _distinct_rels(files: list[InputFile], roots: list[int | None]) -> list[InputFile]:
    """Give inputs that share a relative path (`a/x.flac` and `b/x.flac` passed as roots `a/`
    and `b/`, or a manifest's absolute paths `/d/spk1/001.wav`, `/d/spk2/001.wav`) as many of
    their own folders as tell them apart (`a/x.flac`, `b/x.flac`; `spk1/001.wav`, ...), so
    no output overwrites another. A file found under a folder argument (`roots`: its index,
    else None) takes every file of that folder with it, so the folder's tree stays one tree
    in the output (`b/x.wav` beside `b/x.flac`, keeping both their extensions), and a name
    given to one of its files never depends on another root's. Done over all inputs before
    sharding, so every shard writes a file to the same place."""
    members: dict[int, list[int]] = {}  # folder argument -> its files' indices
    for j, r in enumerate(roots):
        if r is not None:
            members.setdefault(r, []).append(j)
    while True:
        groups: dict[Path, list[int]] = {}
        for i, f in enumerate(files):
            if f.problem is None:  # a manifest line that fails writes nothing
                groups.setdefault(f.rel, []).append(i)
        # Segments of one file share its rel: only different files clash.
        clashes = [g for g in groups.values() if len({files[i].path for i in g}) > 1]
        if not clashes:
            return files
        files, grown = list(files), set()
        for group in clashes:
            if any(roots[i] in grown for i in group):
                continue  # a root grown for another clash: regrouped on the next pass
            parts = [files[i].path.parts[1:] for i in group]  # without the root: rel stays relative
            depth = len(files[group[0]].rel.parts) + 1
            while depth < max(map(len, parts)) and len({p[-depth:] for p in parts}) < len(set(parts)):
                depth += 1
            for i in group:
                grow = depth - len(files[i].rel.parts)
                for j in members.get(roots[i], [i]):
                    files[j] = replace(files[j], rel=Path(*files[j].path.parts[1:][-(len(files[j].rel.parts) + grow):]))
                if roots[i] is not None:
                    grown.add(roots[i])


def _walk(root: Path) -> list[InputFile]:
    """Audio files under `root`, following links to folders, each real folder once: a link
    back up the tree (`data/all -> ..`) would otherwise be walked again at every level. Names
    starting with "." are skipped, files and folders (`root` itself is searched whatever its name)."""
    out = []
    seen: set[tuple[int, int]] = set()
    unlisted: list[OSError] = []  # folders os.walk could not list (it skips them silently)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=unlisted.append):
        try:
            st = os.stat(dirpath)
        except OSError:  # gone since it was listed
            dirnames.clear()
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        # Hidden folders, like hidden files, are not the user's audio: `.AppleDouble` holds
        # resource files named as the audio, `.Trash-1000` deleted files, `.git` objects.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if Path(name).suffix.lower() in AUDIO_EXTENSIONS and not name.startswith("."):
                full = Path(dirpath) / name
                out.append(InputFile(absolute(full), full.relative_to(root)))
    for e in unlisted:  # each a failed input: its audio would otherwise be missed unnoticed
        folder = Path(e.filename) if e.filename else root
        reason = f"cannot list this folder ({e.strerror or e}): audio files in it are not transcribed"
        out.append(InputFile(absolute(folder), Path(folder.name), problem=f"{folder}: {reason}"))
    return out


def read_manifest(path: Path) -> list[InputFile]:
    """A NeMo-style JSONL manifest: one object per line with `audio_filepath` (relative paths
    are relative to the manifest's folder), optional `text` and `duration`.

    A line that cannot be read does not stop the job: it becomes an input that fails with the
    reason (`InputFile.problem`), under its audio path if it names one, else under
    `MANIFEST:LINE`, so it shows in results.jsonl and the run exits 3 with the rest done."""
    manifest = absolute(path)
    out, linenos = [], []
    for lineno, raw in _manifest_lines(path):
        if raw.strip():
            out.append(_manifest_entry(raw, manifest, lineno))
            linenos.append(lineno)
    # `offset: 0` alone (some tools write it for whole files) means the whole file, named as
    # one; a file with a segment further in, or several lines, is read segment by segment. Its
    # `duration` still caps what is read, as NeMo reads it: a 15 s line of a 72 s file was
    # transcribed whole, and bench scored 72 s of words against 15 s of text (WER 436 %).
    lines = Counter(f.path for f in out if f.offset is not None)
    out = [replace(f, offset=None, cap=f.duration) if f.offset == 0.0 and lines[f.path] == 1 else f for f in out]
    # A broken line naming the same input as another line would be dropped as its duplicate
    # (silently), or, coming first, drop the good one: it fails under its own line instead.
    keys = Counter(f.key for f in out)
    return [replace(f, path=where, rel=Path(where.name), offset=None) if f.problem and keys[f.key] > 1 else f
            for f, where in zip(out, (Path(f"{manifest}:{n}") for n in linenos))]


_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
              (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _manifest_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, UTF-8 bytes) of a manifest's lines. A UTF-16/32 file with a BOM (what
    PowerShell's `>` writes) is read as such, and a JSON array (a `.json` of objects, one
    pretty-printed over many lines) gives its objects, numbered from 1: either gave one "not
    valid JSON" row per line, the model loaded for nothing."""
    with open(path, "rb") as f:
        data = f.read()
    for bom, codec in _WIDE_BOMS:
        if data.startswith(bom):
            try:
                data = data.decode(codec).encode("utf-8")
            except UnicodeDecodeError:
                pass  # left as is: each line fails as not UTF-8
            break
    if data.lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"["):
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rows = None
        if isinstance(rows, list):
            yield from ((i, json.dumps(row).encode()) for i, row in enumerate(rows, 1))
            return
    yield from enumerate(data.splitlines(keepends=True), 1)


def manifest_of_line(key: Path) -> str | None:
    """`MANIFEST:LINE`, as `read_manifest` names a line (`InputFile.line`, or the key of a line
    that names no audio) -> MANIFEST; None for any other path."""
    head, _, line = str(key).rpartition(":")
    return head if line.isdigit() and Path(head).suffix.lower() in MANIFEST_EXTENSIONS else None


def _manifest_entry(raw: bytes, manifest: Path, lineno: int) -> InputFile:
    base = manifest.parent
    where = Path(f"{manifest}:{lineno}")  # stands for the line when it names no audio

    def broken(reason: str, at: Path = where) -> InputFile:
        return InputFile(at, Path(at.name), problem=f"{manifest}:{lineno}: {reason}")

    try:
        row = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))  # a BOM from Windows editors
    except UnicodeDecodeError:
        return broken("not UTF-8 text")
    except json.JSONDecodeError as e:
        return broken(f"not valid JSON: {e}")
    if not isinstance(row, dict):
        return broken("not a JSON object")
    audio = row.get("audio_filepath")
    if not isinstance(audio, str) or not audio.strip():
        return broken("no audio_filepath" if audio is None else f"audio_filepath {audio!r} is not a path")
    if "\0" in audio:  # a damaged line: every look at such a path raises ValueError, not OSError
        return broken(f"audio_filepath {audio!r} holds a NUL character, which no file name can")
    audio_path = Path(audio).expanduser()
    full = absolute(audio_path if audio_path.is_absolute() else base / audio_path)
    try:
        rel = full.relative_to(base)
    except ValueError:
        rel = Path(full.name)
    if not rel.name:  # "." or "../m" (the manifest's own folder), "/": no name to make outputs from
        return broken(f"audio_filepath {audio!r} is a folder, not an audio file")
    text, dur, offset = row.get("text"), row.get("duration"), row.get("offset")
    if text is not None and not isinstance(text, str):
        return broken(f"text {text!r} is not a string", full)
    if dur is not None and not (type(dur) in (int, float) and math.isfinite(dur) and dur >= 0):
        return broken(f"duration {dur!r} is not a number of seconds", full)
    if offset is not None and not (type(offset) in (int, float) and math.isfinite(offset) and offset >= 0):
        return broken(f"offset {offset!r} is not a number of seconds", full)
    return InputFile(full, rel, text, float(dur) if dur is not None else None,
                     offset=float(offset) if offset is not None else None, line=where)


def output_stems(files: list[InputFile]) -> dict[Path, Path]:
    """Map each input (`InputFile.key`) to its output path without format extension, relative
    to `--out`.

    `talks/a.flac` -> `talks/a`; when two inputs in one folder share a stem, both keep their
    audio extension (`talks/a.flac`, `talks/a.wav`) so neither overwrites the other; a segment
    adds its times (`talks/a_15.50-28.13`). A file that `discover` has named keeps that name
    (a shard's files are named as the whole run's).
    """
    if all(f.stem is not None for f in files):  # named by `discover` already: the common case
        return {f.key: f.stem for f in files}
    named = {f.path: f.rel for f in files if f.problem is None}  # each file once, however many segments
    stems = Counter(rel.with_suffix("") for rel in named.values())
    base = {p: rel if stems[rel.with_suffix("")] > 1 else rel.with_suffix("") for p, rel in named.items()}
    # `a.flac` keeping its extension can meet another file's own stem (`a.flac.mp3` -> `a.flac`):
    # those keep their full name too, until every name is distinct.
    while True:
        taken = Counter(base.values())
        clash = [p for p, b in base.items() if taken[b] > 1 and b != named[p]]
        if not clash:
            break
        for p in clash:
            base[p] = named[p]
    def named(f: InputFile, digits: int | None = 2) -> Path:
        return _segment_stem(base.get(f.path, f.rel.with_suffix("")), f, digits)

    out = {f.key: f.stem or named(f) for f in files}
    # Segments whose times print alike to 10 ms (offsets 1.001 and 1.004) would write one set of
    # files, the second over the first: those print their times to the ms, and finer, until not;
    # past 1 us (1.0 and 1.0000001, float noise), in full (repr: distinct for distinct offsets).
    for digits in (3, 4, 5, 6, None):
        taken = Counter(out.values())
        alike = [f for f in files if f.stem is None and f.offset is not None and taken[out[f.key]] > 1]
        if not alike:
            break
        for f in alike:
            out[f.key] = named(f, digits)
    return out


def _segment_stem(stem: Path, f: InputFile, digits: int | None = 2) -> Path:
    """A segment's outputs are named for its times in the file: `talk_15.50-28.13`."""
    if f.offset is None:
        return stem
    end = _seconds(f.offset + f.duration, digits) if f.duration is not None else "end"
    return stem.with_name(f"{stem.name}_{_seconds(f.offset, digits)}-{end}")


def _seconds(t: float, digits: int | None) -> str:
    # A manifest may ask for any finite time ("duration": 1e300, i.e. to the end): printed in
    # full, that is a name longer than any file system takes, so such times print as 1.00e+300.
    if digits is None:
        return repr(t)  # the shortest text that reads back as t: 1.0000001, 1e+300
    return f"{t:.{digits}f}" if t < 1e9 else f"{t:.{digits}e}"


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
    """The files of shard (I, N) (`parse_shard`; 1-based I), in sorted order; None: all of them.

    A file's shard is a hash of its output name (`talks/a`), not its place in the list: the
    tasks of an array job start minutes apart, and a file that arrives (or goes) in between
    moved every file after it to the next shard when shards took every N-th file, so some
    files ran twice and others in no shard, every task exiting 0. The name, not the absolute
    path, so that nodes mounting the data at other paths agree. Shards hold N-th parts of the
    files only on average (1000 files in 10 shards: about 100 +- 10 each)."""
    if part is None:
        return files
    i, n = part
    ordered = sorted(files, key=lambda f: str(f.key))
    return [f for f in ordered if _shard_of(f, n) == i - 1]


def _shard_of(f: InputFile, n: int) -> int:
    name = f.stem.as_posix() if f.stem is not None else str(f.key)
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % n
