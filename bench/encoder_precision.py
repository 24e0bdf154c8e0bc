"""Encoder-only time per compute precision, and each precision's error against fp32.

One fixed seeded batch (default 8 x 10 s of N(0, 1) "features", lengths between 80 % and 100 %
of the width, so the padding masks run) through `ConformerEncoder` built with each dtype
(`from_state(..., dtype=)`): on the CPU fp32 and bf16, linears packed for oneDNN where the startup probe finds it pays (what the
engine runs); on CUDA fp32 (IEEE: TF32 off for matmuls and convs), tf32 (the fp32 encoder with
TF32 on), fp16 and bf16, timed with a device sync. Every setting gets one warm-up call, then the
settings run interleaved for --rounds rounds (a burst of outside load hits them alike) and the
best round counts. Error: relative L2 over the valid frames, ||x - x_fp32|| / ||x_fp32||.

Usage:
    .venv/bin/python bench/encoder_precision.py [--model M.nemo] [--device cpu|cuda] \
        [--batch 8] [--seconds 10] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.checkpoint import NemoArchive, pop_sub_state_dict  # noqa: E402
from engines.conformer import ConformerEncoder, EncoderConfig  # noqa: E402
from engines.encoder_backend import feature_width  # noqa: E402
from engines.parakeet import pick_device  # noqa: E402
from engines.precision import DTYPES, check_dtype  # noqa: E402
from transcribe.features import FeatureConfig  # noqa: E402

DEFAULT_MODEL = "/work/models/parakeet_tdt_0.6b_v2_random.nemo"
# (setting, dtype, TF32 on): the reference comes first.
SETTINGS = {"cpu": [("fp32", "float32", False), ("bf16", "bfloat16", False)],
            "cuda": [("fp32", "float32", False), ("tf32", "float32", True), ("fp16", "float16", False),
                     ("bf16", "bfloat16", False)]}


@contextlib.contextmanager
def tf32(on: bool):
    """TF32 for CUDA matmuls and cuDNN convs (cuDNN's default is on: fp32 here means off)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def seeded_batch(fcfg: FeatureConfig, batch: int, seconds: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    frames = int(fcfg.frame_count(torch.tensor([int(seconds * fcfg.sample_rate)]))[0])
    width = feature_width(frames, fcfg.pad_to)
    lengths = torch.randint(int(0.8 * frames), frames + 1, (batch,), generator=gen)
    lengths[0] = frames
    feats = torch.randn(batch, fcfg.features, width, generator=gen)
    return feats.to(device), lengths.to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor, lengths: torch.Tensor) -> float:
    num = den = 0.0
    for i, n in enumerate(lengths.tolist()):
        num += float((got[i, :, :n].double() - want[i, :, :n].double()).square().sum())
        den += float(want[i, :, :n].double().square().sum())
    return (num / den) ** 0.5


def load(path: str, device: str, dtypes: list[str]) -> tuple[FeatureConfig, dict[str, ConformerEncoder]]:
    """One encoder per dtype, from one read of the checkpoint (building one leaves `state` as it
    was). fp32 is built last and consumes the state, each weight freed as its packed copy is
    made: the peak holds the fp32 weights once, plus the reduced-precision encoders."""
    with NemoArchive(path) as archive:
        fcfg = FeatureConfig.from_nemo(archive.config["preprocessor"])
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        state = pop_sub_state_dict(archive.state_dict(), "encoder")
    encoders = {}
    for i, name in enumerate(reversed(dtypes)):
        last = i == len(dtypes) - 1
        encoders[name] = ConformerEncoder.from_state(cfg, state if last else dict(state), dtype=DTYPES[name],
                                                     device=device, pack_linears=device == "cpu", consume=last)
    return fcfg, encoders


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f".nemo checkpoint (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0, help="audio seconds per row")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (best counts)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    try:  # the CLI's check: a CUDA device this machine lacks is an error line, not a traceback
        args.device = pick_device(args.device)
    except ValueError as e:
        raise SystemExit(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    settings, skipped = [], {}
    for setting, dtype, on in SETTINGS[args.device]:
        try:
            check_dtype(DTYPES[dtype], args.device)
            settings.append((setting, dtype, on))
        except ValueError as e:
            skipped[setting] = str(e)
    fcfg, encoders = load(args.model, args.device, list(dict.fromkeys(d for _, d, _ in settings)))
    feats, lengths = seeded_batch(fcfg, args.batch, args.seconds, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def run(setting: tuple[str, str, bool]) -> tuple[float, torch.Tensor, torch.Tensor]:
        _, dtype, on = setting
        with torch.inference_mode(), tf32(on):
            sync()
            t = time.perf_counter()
            out, out_len = encoders[dtype](feats, lengths)
            sync()
            return time.perf_counter() - t, out, out_len

    outputs = {s[0]: run(s)[1:] for s in settings}  # warm-up, and the outputs compared below
    times: dict[str, list[float]] = {s[0]: [] for s in settings}
    for _ in range(args.rounds):
        for s in settings:
            times[s[0]].append(run(s)[0])
    ref_out, ref_len = outputs["fp32"]
    audio_s = float(lengths.sum()) * fcfg.window_stride
    rows = []
    print(f"{Path(args.model).name} on {args.device}, batch {args.batch} x {args.seconds:g} s, "
          f"{torch.get_num_threads()} threads, best of {args.rounds}")
    for setting, dtype, on in settings:
        best = min(times[setting])
        out, out_len = outputs[setting]
        row = {"setting": setting, "dtype": dtype, "tf32": on, "best_s": best, "times_s": times[setting],
               "x_real_time": audio_s / best, "speedup_vs_fp32": min(times["fp32"]) / best,
               "rel_err_vs_fp32": rel_err(out, ref_out, ref_len), "output_dtype": str(out.dtype)}
        assert torch.equal(out_len, ref_len)
        rows.append(row)
        print(f"{setting:5s} {best * 1e3:9.1f} ms/batch  {row['x_real_time']:7.1f}x real time  "
              f"speed-up {row['speedup_vs_fp32']:5.2f}x  rel err vs fp32 {row['rel_err_vs_fp32']:.2e}")
    for setting, why in skipped.items():
        print(f"{setting:5s} skipped: {why}")
    if args.json:
        device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(args.model), "device": args.device, "device_name": device,
                                         "torch": torch.__version__, "threads": torch.get_num_threads(),
                                         "batch": args.batch, "seconds": args.seconds, "rounds": args.rounds,
                                         "results": rows, "skipped": skipped}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
