#!/usr/bin/env python3
"""Side-by-side bench: our `transcribe bench` against NVIDIA NeMo's `transcribe()`, same files.

Run with the project's venv python (it computes both WERs with `transcribe.bench.wer`):

    .venv/bin/python bench/compare_nemo.py --model /work/models/parakeet_tdt_0.6b_v2_random.nemo \
        --manifest /work/shared/data/speech/librispeech_test_other/manifest.jsonl \
        --batch-size 8 --batch-seconds 300 --threads 2 --out bench/results/tdt_0.6b.json

Each peer runs as a whole command in its own process, one after the other (never at the
same time), and the wall time of that command from start to exit is measured with
time.perf_counter() around subprocess.run:

  nemo  <nemo-python> bench/nemo_peer.py --model M --manifest F --batch-size B --threads T --json X
  ours  transcribe bench F --model M --batch-seconds S --device cpu --json Y
        (the `transcribe` console script beside this python, else `python -m transcribe.cli`;
        --ours-cmd overrides)

Both get OMP_NUM_THREADS=MKL_NUM_THREADS=T in their environment (and the NeMo peer also
calls torch.set_num_threads(T); our CLI reads OMP_NUM_THREADS through torch's default).

Reported per peer:
  whole_seconds  the whole command, interpreter start-up, imports and model load included
  rtfx_whole     audio_seconds / whole_seconds
  rtfx_steady    NeMo: audio_seconds / transcribe_seconds (the transcribe() call alone);
                 ours: the report's `rtfx_steady` if present, else audio_seconds /
                 (wall_seconds - stages.load_model), else audio_seconds / sum(stages except
                 load_model)
  load_seconds   NeMo's restore_from; ours stages.load_model
  wer            each peer's corpus WER, both by `transcribe.bench.wer` in the project venv
                 (OpenAI Whisper's English normaliser): ours from `transcribe bench`, NeMo's
                 recomputed here from its report's `texts` and `references`, so the two never
                 depend on what the NeMo venv has installed
  cpu_seconds    user+sys CPU of the whole command; loadavg_1m_before/after: the machine's
                 load around it (a load well above --threads means others competed for CPU)
and ratios ours/NeMo of rtfx_whole and rtfx_steady (> 1: we are faster). A peer that is
skipped or fails has null figures and the ratios are null.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_MANIFEST = "/work/shared/data/speech/librispeech_test_other/manifest.jsonl"
DEFAULT_NEMO_PYTHON = "/work/venvs/nemo/bin/python"


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_timed(cmd: list[str], env: dict, log_path: Path) -> tuple[float, int, dict]:
    """Run a whole command, output to log_path; (wall seconds start->exit, exit code, extras).

    extras: the command's user+sys CPU seconds and the 1-minute load average before and
    after, to tell a measurement taken on a busy machine (load above the thread count)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    extras = {"cpu_seconds": round(cpu, 2), "loadavg_1m_before": round(load0, 2),
              "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    return wall, proc.returncode, extras


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return ""


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _rnd(x, n=3):
    return None if x is None else round(x, n)


def nemo_side(args, out_dir: Path, stem: str) -> dict:
    js = out_dir / f"{stem}.nemo.json"
    cmd = [args.nemo_python, str(HERE / "nemo_peer.py"), "--model", args.model, "--manifest", args.manifest,
           "--batch-size", str(args.batch_size), "--threads", str(args.threads), "--json", str(js)]
    if js.exists():
        js.unlink()
    whole, rc, extras = run_timed(cmd, _env(args.threads), out_dir / f"{stem}.nemo.log")
    res = {"command": cmd, "exit_code": rc, "whole_seconds": round(whole, 3), **extras, "report": str(js)}
    if rc != 0 or not js.exists():
        res["error"] = _tail(out_dir / f"{stem}.nemo.log")
        return res
    r = json.load(open(js))
    audio = r["audio_seconds"]
    res.update(
        nemo_version=r.get("nemo_version"),
        files=r.get("files"),
        audio_seconds=audio,
        load_seconds=r.get("load_seconds"),
        steady_seconds=r.get("transcribe_seconds"),
        rtfx_whole=_rnd(audio / whole),
        rtfx_steady=r.get("rtfx_steady"),
        wer=_project_wer(r),
    )
    return res


def _project_wer(peer_report: dict):
    """The NeMo peer's WER by our `transcribe.bench.wer`, in this (the project's) venv."""
    refs = peer_report.get("references")
    if not refs or not any(r is not None for r in refs):
        return None
    sys.path.insert(0, str(REPO))
    from transcribe.bench import wer

    kept = [(r, h) for r, h in zip(refs, peer_report["texts"]) if r is not None]
    return wer([r for r, _ in kept], [h for _, h in kept])


def ours_side(args, out_dir: Path, stem: str) -> dict:
    js = out_dir / f"{stem}.ours.json"
    if args.ours_cmd:
        base = args.ours_cmd.split()
    else:  # the venv's console script beside this python, else the module
        script = Path(sys.executable).parent / "transcribe"
        base = [str(script)] if script.exists() else [sys.executable, "-m", "transcribe.cli"]
    cmd = base + ["bench", args.manifest, "--model", args.model, "--batch-seconds", str(args.batch_seconds),
                  "--device", args.device, "--json", str(js)]
    if js.exists():
        js.unlink()
    whole, rc, extras = run_timed(cmd, _env(args.threads), out_dir / f"{stem}.ours.log")
    res = {"command": cmd, "exit_code": rc, "whole_seconds": round(whole, 3), **extras, "report": str(js)}
    if rc not in (0, 3) or not js.exists():
        res["error"] = _tail(out_dir / f"{stem}.ours.log")
        return res
    r = json.load(open(js))
    audio = r["audio_seconds"]
    stages = r.get("stages") or {}
    load = stages.get("load_model")
    steady_s = None
    if r.get("rtfx_steady"):
        rtfx_steady = r["rtfx_steady"]
        steady_s = r.get("transcribe_seconds") or (audio / rtfx_steady)
    else:
        if load is not None and r.get("wall_seconds"):
            steady_s = r["wall_seconds"] - load
        elif stages:
            steady_s = sum(v for k, v in stages.items() if k != "load_model" and isinstance(v, (int, float)))
        rtfx_steady = _rnd(audio / steady_s) if steady_s else None
    res.update(
        files=r.get("files"),
        files_failed=r.get("files_failed", 0),
        audio_seconds=audio,
        load_seconds=load,
        steady_seconds=_rnd(steady_s),
        rtfx_whole=_rnd(audio / whole),
        rtfx_steady=rtfx_steady,
        rtfx_reported=r.get("rtfx"),
        wer=r.get("wer"),
        device=r.get("device"),
        peak_memory_bytes=r.get("peak_memory_bytes"),
        stages=stages,
    )
    return res


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(report: dict) -> None:
    rows = [("peer", "whole s", "load s", "steady s", "RTFx whole", "RTFx steady", "WER %", "CPU s", "loadavg")]
    for name in ("nemo", "ours"):
        p = report.get(name)
        if p is None:
            rows.append((name, "skipped", "", "", "", "", "", "", ""))
            continue
        wer = p.get("wer")
        rows.append((name, _fmt(p.get("whole_seconds"), ".2f"), _fmt(p.get("load_seconds"), ".2f"),
                     _fmt(p.get("steady_seconds"), ".2f"), _fmt(p.get("rtfx_whole"), ".2f"),
                     _fmt(p.get("rtfx_steady"), ".2f"), _fmt(None if wer is None else 100 * wer, ".2f"),
                     _fmt(p.get("cpu_seconds"), ".1f"),
                     f"{_fmt(p.get('loadavg_1m_before'), '.1f')}->{_fmt(p.get('loadavg_1m_after'), '.1f')}"))
    r = report["ratio_ours_over_nemo"]
    rows.append(("ours/nemo", "", "", "", _fmt(r["rtfx_whole"], ".2f"), _fmt(r["rtfx_steady"], ".2f"), "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for name in ("nemo", "ours"):
        p = report.get(name)
        if p and p.get("error") is not None:
            print(f"\n{name} FAILED (exit {p['exit_code']}):\n{p['error']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=".nemo archive both peers load")
    ap.add_argument("--manifest", default=DEFAULT_MANIFEST)
    ap.add_argument("--nemo-python", default=DEFAULT_NEMO_PYTHON)
    ap.add_argument("--ours-cmd", default=None,
                    help="how to start our CLI (default: the venv's `transcribe` script, else python -m transcribe.cli)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8, help="NeMo transcribe() batch size")
    ap.add_argument("--batch-seconds", type=float, default=300.0, help="our --batch-seconds")
    ap.add_argument("--device", default="cpu", help="our --device")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--skip-nemo", action="store_true")
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/<model>__<manifest>.json)")
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    a.manifest = os.path.abspath(a.manifest)

    if a.out is None:
        model_name = Path(a.model).stem if Path(a.model).stem != "model" else Path(a.model).parent.name
        a.out = str(HERE / "results" / f"{model_name}__{Path(a.manifest).parent.name}.json")
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem

    report = {
        "model": a.model,
        "manifest": a.manifest,
        "threads": a.threads,
        "nemo_batch_size": a.batch_size,
        "ours_batch_seconds": a.batch_seconds,
        "host_cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "nemo": None if a.skip_nemo else nemo_side(a, out.parent, stem),
        "ours": None if a.skip_ours else ours_side(a, out.parent, stem),
    }
    n, o = report["nemo"] or {}, report["ours"] or {}
    report["ratio_ours_over_nemo"] = {
        "rtfx_whole": _ratio(o.get("rtfx_whole"), n.get("rtfx_whole")),
        "rtfx_steady": _ratio(o.get("rtfx_steady"), n.get("rtfx_steady")),
    }
    if n.get("audio_seconds") and o.get("audio_seconds") and abs(n["audio_seconds"] - o["audio_seconds"]) > 0.5:
        report["warning"] = "the peers report different audio_seconds: not the same files?"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    print_table(report)
    if report.get("warning"):
        print("warning: " + report["warning"])
    if o.get("files_failed"):  # its audio stays in audio_seconds: a ratio that no run earned
        print(f"our side FAILED {o['files_failed']} files: see {out.parent / (stem + '.ours.log')}")
    print(f"report: {out}")
    failed = any(p and p.get("error") is not None for p in (report["nemo"], report["ours"])) or o.get("files_failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
