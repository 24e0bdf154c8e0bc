#!/usr/bin/env python3
"""GPU benchmark (issue 5): RTFx from files per encoder backend and decoder mode, and with the
log-mel features in the workers or on the GPU, decoder-only speed per mode, per-stage seconds
and peak GPU memory, and NeMo's `transcribe()` with its CUDA-graph decoder on the same GPU in
the same run.

    python bench/gpu_bench.py --model parakeet_tdt_0.6b_v2_random.nemo \
        --audio ../shared/data/speech/librispeech_test_other --min-hours 1 \
        --nemo-python python3 --json bench/results/gpu.json

The audio folder (or manifest) is repeated through symlinked copies (rep000/, rep001/, ...)
until it holds `--min-hours`, so every run sees the same >= 1 h of real speech as distinct
files. Each configuration is a full pipeline run (`transcribe.pipeline.run`: workers decode,
resample and compute features into shared memory, the engine batches by length bucket) on a
freshly loaded engine; RTFx = audio seconds / wall seconds of that run (model load and graph
capture excluded and reported apart). Transcripts of every configuration are compared with
the first one (torch encoder, eager decoder, features in the workers): `mismatched_files`
must be 0. The `--features-on` axis runs the default encoder (cuda-graphs; torch on the CPU)
with the auto decoder once per value; `features_on` compares them (RTFx and the stages each moves: the workers' `preprocess_features`, the
engine's `batch` and `features`), which is what decides the engines' `features_on="auto"`.

Decoder-only: encoder outputs of a few real batches are decoded `--decoder-reps` times per mode
after a warm-up, with the device synchronised around the timed span; speed-up vs eager.
The NeMo peer runs `bench/nemo_peer.py --device cuda` in `--nemo-python` (an interpreter
with nemo_toolkit) on the same repeated manifest.

Warm-up (`--warmup-files`, default 100: test-other's files once): before the timed runs, the
first configuration runs once, untimed, on that many files, and the NeMo peer transcribes as
many untimed before its timed call. A process's first pass over new shapes loads CUDA kernels
lazily and sets up cuBLAS/cuDNN; without the warm-up the first run made (our baseline, and
NeMo in its own process) paid that and later runs did not (the 2026-11-22 H100 figures).

`--json` is rewritten (atomically) after every run, so a run cut off by a time limit keeps what
finished ("complete": false until the end). Subsets fit one 10-minute device call each: empty
`--backends/--modes/--features-on/--dtypes` lists drop those axes, `--no-baseline` drops the
torch/eager run (mismatches are then counted against the first run made, named in "baseline"),
`--no-decoder-only` skips the decoder-only part. `--merge A.json B.json ... --json OUT` joins
the reports of such calls (runs, decoder-only, NeMo) and recomputes the comparisons with NeMo.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import traceback
import tempfile
import time
from pathlib import Path

import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.encoder_backend import resolve_backend  # noqa: E402
from engines.parakeet import ParakeetEngine  # noqa: E402
from transcribe.inputs import discover  # noqa: E402
from transcribe.pipeline import run  # noqa: E402
from transcribe.workers import Prespawned, default_workers  # noqa: E402
from transcribe.writers import atomic_write_text  # noqa: E402

BASELINE = ("torch", "eager", "workers", "float32")


def repeat_inputs(src: Path, min_hours: float, dest: Path) -> tuple[Path, float, int]:
    """Symlinked copies of the audio under `src` in dest/repNNN/ until >= min_hours; a manifest
    of them (with references) is written to dest/manifest.jsonl for the NeMo peer."""
    files = discover([str(src)])
    if not files:
        raise SystemExit(f"error: no audio under {src}")
    once = sum(sf.info(str(f.path)).duration for f in files)
    reps = max(1, int(-(-min_hours * 3600 // once)))
    rows = []
    for k in range(reps):
        for f in files:
            link = dest / f"rep{k:03d}" / f.rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f.path)
            rows.append({"audio_filepath": str(link), "text": f.reference})
    manifest = dest / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest, once * reps, reps


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pipeline_run(model: str, manifest: Path, backend: str, mode: str, features_on: str, dtype: str, a) -> dict:
    """One configuration end to end from files; its transcripts are returned for comparison."""
    _free()
    t0 = time.perf_counter()
    # Workers start while the model loads, as in the CLI: their spawn is not in the timed run.
    with Prespawned(a.workers or default_workers()) as spares, tempfile.TemporaryDirectory() as out:
        engine = ParakeetEngine.from_nemo(model, a.device, encoder_backend=backend, decoder_mode=mode,
                                          features_on=features_on, dtype=dtype)
        engine.reserve(64)  # the pipeline reserves again for its own batch size; graphs are kept
        _sync(a.device)
        load_s = time.perf_counter() - t0
        stats = run(engine, discover([str(manifest)]), Path(out), ["txt"], batch_seconds=a.batch_seconds,
                    force=True, workers=a.workers, progress=False, prespawned=spares)
    row = {
        "encoder_backend": backend, "decoder_mode_requested": mode, "features_on": features_on,
        "dtype": dtype, "runtime": engine.runtime,
        "load_and_capture_seconds": round(load_s, 2), "audio_seconds": round(stats.audio_seconds, 1),
        "wall_seconds": round(stats.wall_seconds, 3), "rtfx": round(stats.rtfx, 1),
        "files_failed": stats.files_failed, "padding_fraction": round(stats.padding_fraction, 4),
        "stages": {k: round(v, 3) for k, v in sorted(stats.stage_seconds.items())},
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None,
    }
    texts = {str(p): t for p, t in stats.texts.items()}
    del engine
    return {"row": row, "texts": texts}


@torch.inference_mode()
def decoder_only(model: str, manifest: Path, modes: list[str], reps: int, batch: int, device: str) -> list[dict]:
    """Decoder speed per mode on the same encoder outputs (real speech, `batch` pieces a batch)."""
    _free()
    engine = ParakeetEngine.from_nemo(model, device, encoder_backend="torch", decoder_mode="eager")
    files = [f.path for f in discover([str(manifest)])][: batch * 4]
    batches = []
    for i in range(0, len(files), batch):
        feats = [torch.from_numpy(engine.frontend(sf.read(str(p), dtype="float32")[0])) for p in files[i:i + batch]]
        x, n = engine._batch(feats)
        batches.append(engine.encoder_backend(x, n))
    dec, rows, ref = engine.decoder, [], None
    for mode in modes:
        chosen, captures = dec.set_mode(mode), dec.graphs.captures
        outs = [[h.tokens for h in dec.decode(e.clone(), n)] for e, n in batches]  # warm-up + capture
        _sync(device)
        used = dec.mode  # after the warm-up: a failed capture has fallen back by now
        t0 = time.perf_counter()
        for _ in range(reps):
            for e, n in batches:
                dec.decode(e, n)
        _sync(device)
        sec = (time.perf_counter() - t0) / reps
        ref = ref if ref is not None else outs
        rows.append({"mode_requested": mode, "mode_selected": chosen, "mode": used,
                     "mode_at_end": dec.mode, "captures": dec.graphs.captures - captures,
                     "seconds_per_pass": round(sec, 5), "identical_to_first": outs == ref})
    eager = next((r["seconds_per_pass"] for r in sorted(rows, key=lambda r: r["mode_requested"] != "eager")
                  if r["mode"] == "eager"), None)  # the eager request first, else a fallback to eager
    for r in rows:
        r["speedup_vs_eager"] = round(eager / r["seconds_per_pass"], 2) if eager else None
    return rows


def features_on_summary(runs: list[dict], backend: str) -> dict:
    """`backend`/auto with features in the workers vs on the device: RTFx and the stages that
    move (the workers' log-mel leaves them; the engine's batch copies audio, then computes it)."""
    rows = {r["features_on"]: r for r in runs
            if "rtfx" in r and (r["encoder_backend"], r["decoder_mode_requested"], r["dtype"]) == (backend, "auto", "float32")}
    moved = ("preprocess_features", "preprocess_to_slab", "batch", "features", "encoder")
    out = {f: {"rtfx": r["rtfx"], **{k: r["stages"].get(k, 0.0) for k in moved}} for f, r in rows.items()}
    if "workers" in out and "device" in out:
        out["device_rtfx_vs_workers"] = round(out["device"]["rtfx"] / out["workers"]["rtfx"], 3)
    return out


def nemo_peer(a, manifest: Path, out: Path, dtype: str) -> dict | None:
    cmd = [a.nemo_python, str(Path(__file__).with_name("nemo_peer.py")), "--model", a.model, "--manifest",
           str(manifest), "--device", a.device, "--batch-size", str(a.nemo_batch_size), "--dtype", dtype,
           "--warmup", str(a.warmup_files), "--json", str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # e.g. no such interpreter
        print(f"NeMo peer failed to start: {e}", file=sys.stderr)
        return None
    if p.returncode != 0:
        print(f"NeMo peer failed ({p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
        return None
    r = json.loads(out.read_text())
    r.pop("texts", None)
    return r


def write_report(path: str | None, report: dict) -> None:
    """Bring the report's comparisons up to date (`summarise`), then rewrite `path` with it,
    atomically (a run killed mid-write leaves the previous report whole)."""
    summarise(report)
    if path:
        atomic_write_text(Path(path), json.dumps(report, indent=1) + "\n")


def summarise(report: dict) -> None:
    """The comparisons drawn from `runs` and `nemo`: features placement and, per dtype, our best
    run against NeMo in that dtype (same precision on both sides)."""
    runs = report.get("runs", [])
    report["features_on"] = features_on_summary(runs, report.get("default_backend", "cuda-graphs"))
    report["vs_nemo"] = {}
    for d, nemo in (report.get("nemo") or {}).items():
        best_d = max((r for r in runs if "rtfx" in r and r["dtype"] == d), key=lambda r: r["rtfx"], default=None)
        nemo_d = (nemo or {}).get("rtfx_steady")
        if best_d and nemo_d:
            # with what the run's transcripts say against the call's baseline run: a fast run
            # whose tokens moved is reported with its mismatches, not as if it agreed
            report["vs_nemo"][d] = {"ours": best_d["rtfx"], "runtime": best_d["runtime"], "nemo": nemo_d,
                                    "ratio": round(best_d["rtfx"] / nemo_d, 2),
                                    "mismatched_files": best_d.get("mismatched_files"),
                                    "files_failed": best_d.get("files_failed")}


def merge(paths: list[str]) -> dict:
    """One report from several calls' reports (same GPU and model expected): runs and decoder-only
    rows concatenated, NeMo results joined; each run keeps the file it came from. Mismatch counts
    stay as each call counted them (against that call's baseline)."""
    report: dict = {"merged_from": paths, "runs": [], "decoder_only": [], "nemo": {}}
    for p in paths:
        part = json.loads(Path(p).read_text())
        for k in ("gpu", "torch", "model", "audio_seconds", "repeats", "default_backend"):
            if k in part and part[k] != report.setdefault(k, part[k]):
                report.setdefault("differences", []).append({"key": k, "file": p, "value": part[k]})
        report["runs"] += [{**r, "from": p} for r in part.get("runs", [])]
        rows = part.get("decoder_only") or []
        report["decoder_only"] += [{**r, "from": p} for r in ([rows] if isinstance(rows, dict) else rows)]
        report["nemo"].update({d: v for d, v in (part.get("nemo") or {}).items() if v})
        report["complete"] = report.get("complete", True) and bool(part.get("complete"))
    return report


def _list(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the .nemo to bench (required unless --merge)")
    ap.add_argument("--audio", help="folder or manifest of real speech, repeated to --min-hours (required unless --merge)")
    ap.add_argument("--min-hours", type=float, default=1.0)
    ap.add_argument("--backends", default="torch,cuda-graphs,tensorrt", help="encoder backends (auto decoder); '' for none")
    ap.add_argument("--modes", default="eager,unrolled,full-graph",
                    help="decoder modes (cuda-graphs encoder; also the decoder-only modes); '' for none")
    ap.add_argument("--features-on", default="workers,device",
                    help="where log-mel runs (default encoder, auto decoder); '' for none")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="encoder compute dtypes (default backend, auto decoder); NeMo runs each as autocast; '' for none")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the torch/eager run (mismatches then count against the first run made)")
    ap.add_argument("--no-decoder-only", action="store_true", help="skip the decoder-only timing")
    ap.add_argument("--warmup-files", type=int, default=100,
                    help="untimed files run first, by us and by the NeMo peer (0: none)")
    ap.add_argument("--batch-seconds", type=float, default=600.0)
    ap.add_argument("--config", action="append", default=[], metavar="BACKEND/MODE/FEATURES/DTYPE",
                    help="one more run, e.g. cuda-graphs/auto/device/bfloat16 (repeatable)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--decoder-reps", type=int, default=5)
    ap.add_argument("--decoder-batch", type=int, default=32)
    ap.add_argument("--nemo-python", default=None, help="interpreter with nemo_toolkit (omit: no peer)")
    ap.add_argument("--nemo-dtypes", default=None, help="dtypes for the NeMo peer (default: --dtypes)")
    ap.add_argument("--nemo-batch-size", type=int, default=32)
    ap.add_argument("--json", default=None, help="report, rewritten after every run")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="join earlier reports into --json (runs nothing)")
    ap.add_argument("--device", default="cuda", help="cuda (the bench); cpu only smoke-tests this script")
    a = ap.parse_args()
    if a.merge:
        report = merge(a.merge)
        write_report(a.json, report)
        print(json.dumps({"runs": len(report["runs"]), "vs_nemo": report["vs_nemo"],
                          "features_on": report["features_on"]}))
        return 0
    if not a.model or not a.audio:
        ap.error("--model and --audio are required (unless --merge)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (--device cpu only smoke-tests the script)", file=sys.stderr)
        return 1
    modes, backends, dtypes = _list(a.modes), _list(a.backends), _list(a.dtypes)
    if any(len(c.split("/")) != 4 for c in a.config):
        ap.error("--config takes BACKEND/MODE/FEATURES/DTYPE, e.g. cuda-graphs/auto/device/bfloat16")
    nemo_dtypes = dtypes if a.nemo_dtypes is None else _list(a.nemo_dtypes)
    default_backend = resolve_backend("auto", a.device)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    report: dict = {"gpu": gpu, "torch": torch.__version__, "model": a.model, "default_backend": default_backend,
                    "argv": sys.argv[1:], "complete": False, "runs": []}
    runs = report["runs"]
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        manifest, audio_s, reps = repeat_inputs(Path(a.audio), a.min_hours, Path(tmp))
        report.update(audio_seconds=round(audio_s, 1), repeats=reps)
        write_report(a.json, report)
        configs = ([] if a.no_baseline else [BASELINE]) + (
            [(b, "auto", "workers", "float32") for b in backends if b != "torch" or a.no_baseline]
            + [("cuda-graphs", m, "workers", "float32") for m in modes]
            + [(default_backend, "auto", f, "float32") for f in _list(a.features_on)]
            + [(default_backend, "auto", "workers", d) for d in dtypes]
            + [tuple(c.split("/")) for c in a.config])
        base = None
        if configs and a.warmup_files:
            warm = Path(tmp) / "warmup.jsonl"
            warm.write_text("".join(manifest.read_text().splitlines(keepends=True)[: a.warmup_files]))
            try:
                pipeline_run(a.model, warm, *configs[0], a)
            except (RuntimeError, ValueError, ImportError) as e:  # the timed run reports it
                print(f"warm-up: {e}", file=sys.stderr)
            report["warmup_files"] = a.warmup_files
        for backend, mode, features_on, dtype in dict.fromkeys(configs):
            try:
                res = pipeline_run(a.model, manifest, backend, mode, features_on, dtype, a)
            except (RuntimeError, ValueError, ImportError) as e:  # e.g. tensorrt missing: say so, go on
                runs.append({"encoder_backend": backend, "decoder_mode_requested": mode, "features_on": features_on,
                             "dtype": dtype, "error": f"{type(e).__name__}: {e}"})
                print(f"{backend}/{mode}/{features_on}/{dtype}: {e}", file=sys.stderr)
                write_report(a.json, report)
                continue
            if base is None:
                base = res["texts"]
                report["baseline"] = {k: res["row"][k] for k in
                                      ("encoder_backend", "decoder_mode_requested", "features_on", "dtype")}
            res["row"]["mismatched_files"] = sum(res["texts"].get(k) != v for k, v in base.items())
            runs.append(res["row"])
            print(json.dumps(res["row"]), flush=True)
            write_report(a.json, report)
        print(json.dumps(report["features_on"]), flush=True)
        if modes and not a.no_decoder_only:
            try:
                report["decoder_only"] = decoder_only(a.model, manifest, modes, a.decoder_reps, a.decoder_batch,
                                                      a.device)
            except Exception as e:  # noqa: BLE001 -- the runs above must still be reported
                report["decoder_only"] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
            print(json.dumps(report["decoder_only"]), flush=True)
            write_report(a.json, report)
        if a.nemo_python:
            report["nemo"] = {}
            for d in nemo_dtypes:
                report["nemo"][d] = nemo_peer(a, manifest, Path(tmp) / f"nemo_{d}.json", d)
                write_report(a.json, report)
    report["complete"] = True
    write_report(a.json, report)
    best = max((r for r in runs if "rtfx" in r), key=lambda r: r["rtfx"], default=None)
    print(f"{report['gpu']}: {report['audio_seconds'] / 3600:.2f} h; best RTFx "
          f"{best['rtfx'] if best else None} ({best['runtime'] if best else '-'}); vs NeMo in the same dtype: "
          f"{ {d: v['ratio'] for d, v in report['vs_nemo'].items()} }; features on the device vs workers: RTFx x"
          f"{report['features_on'].get('device_rtfx_vs_workers')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
