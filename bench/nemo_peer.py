#!/usr/bin/env python3
"""NeMo peer for the speed/accuracy comparison: NVIDIA NeMo's own `transcribe()` (CPU or CUDA).

Runs INSIDE the NeMo virtualenv (see bench/README.md), never with the project's venv; from
this repository it imports only `transcribe.bench` (standard library at import time), so both
peers' WER use the very same normalisation.

    /work/venvs/nemo/bin/python bench/nemo_peer.py --model M.nemo --manifest test.jsonl \
        --batch-size 8 --threads 2 --json out.json

On CUDA (`--device cuda`) the greedy_batch decoding is switched to NeMo's label-looping
decoder with CUDA graphs (`use_cuda_graph_decoder=True`, its fastest greedy mode: full graph
with conditional nodes where the driver allows, else its own fallbacks), `--dtype` may be
bf16/fp16 (autocast, as NeMo's transcribe scripts do), and the peak GPU memory is reported.

The model is loaded with `ASRModel.restore_from(..., map_location=device)`, kept in fp32,
put in eval mode, and every file of the manifest is transcribed by ONE call of
`model.transcribe(paths, batch_size=N)` with the decoding configured in the checkpoint
(greedy / greedy_batch for the Parakeet checkpoints). Timings:

  load_seconds        restore_from (archive extraction, model construction, weights)
  transcribe_seconds  the transcribe() call (NeMo's own audio loading, features,
                      encoder, decoding, detokenisation)
  rtfx_steady         audio_seconds / transcribe_seconds
  *_cpu_seconds       process CPU time (all threads) of the same spans: with other jobs on
                      the machine the wall times stretch, the CPU times hardly do

The JSON report: {peer, nemo_version, torch_version, model, manifest, files, audio_seconds,
load_seconds, transcribe_seconds, load_cpu_seconds, transcribe_cpu_seconds, rtfx_steady,
batch_size, threads, wer, wer_words, wer_normalisation, texts, references, ...}.

WER normalisation, applied to reference and hypothesis alike: `transcribe.bench.normalized_pairs`,
the same code as `transcribe bench`, i.e. OpenAI Whisper's English normaliser from the
`whisper-normalizer` package (`nemo_toolkit[asr]==3.0.0` pulls in 0.1.15, the version the
project venv has). Corpus WER = total word edits / total reference words, over files whose
normalised reference has a letter or digit. jiwer is used when installed in the NeMo venv, else
a plain Levenshtein on words (same result). Without whisper-normalizer here `wer` is null;
compare_nemo.py computes the WER of both peers itself, in the project venv, from `texts` and
`references`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

WER_NORMALISATION = "OpenAI Whisper EnglishTextNormalizer (transcribe.bench.normalize_text)"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transcribe.bench import edit_distance, normalized_pairs  # noqa: E402  (repo root on the path first)


def corpus_wer(refs: list, hyps: list):
    """(WER, reference words) after normalisation; (None, 0) without references, or without
    whisper-normalizer in this venv (compare_nemo.py computes it in the project venv then)."""
    kept = [(r, h) for r, h in zip(refs, hyps) if r is not None]
    try:
        pairs = normalized_pairs([r for r, _ in kept], [h for _, h in kept])
    except ImportError:
        return None, 0
    if not pairs:
        return None, 0
    n_words = sum(len(r.split()) for r, _ in pairs)
    try:
        import jiwer

        return float(jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs]).wer), n_words
    except ImportError:
        edits = sum(edit_distance(r.split(), h.split()) for r, h in pairs)
        return edits / n_words, n_words


def read_manifest(path: str):
    """[(absolute audio path, duration or None, reference text or None)] in manifest order."""
    base = os.path.dirname(os.path.abspath(path))
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            p = os.path.expanduser(d["audio_filepath"])
            if not os.path.isabs(p):
                p = os.path.join(base, p)
            rows.append((os.path.normpath(p), d.get("duration"), d.get("text")))
    return rows


def audio_seconds_of(paths: list) -> float:
    import soundfile as sf

    total = 0.0
    for p in paths:
        info = sf.info(p)
        total += info.frames / info.samplerate
    return total


def hyp_text(h) -> str:
    """transcribe() returns Hypothesis objects (NeMo >= 2) or plain strings (older)."""
    if isinstance(h, str):
        return h
    t = getattr(h, "text", h)
    return t if isinstance(t, str) else str(t)


def _use_cuda_graph_decoder(model, open_dict) -> None:
    """NeMo's fastest greedy decoding: greedy_batch label looping with CUDA graphs."""
    cfg = model.cfg.decoding
    with open_dict(cfg):
        cfg.strategy = "greedy_batch"
        cfg.greedy.use_cuda_graph_decoder = True
        cfg.greedy.loop_labels = True
    model.change_decoding_strategy(cfg, verbose=False)


def _cuda_graphs_mode(model) -> str | None:
    """The graph mode NeMo's label-looping decoder ended up in after transcribing (full_graph,
    no_while_loops, no_graphs): it drops from full_graph to no_while_loops with a warning when
    the conditional-node capture fails, which says whether full graphs work on this stack."""
    computer = getattr(getattr(getattr(model, "decoding", None), "decoding", None), "decoding_computer", None)
    mode = getattr(computer, "cuda_graphs_mode", None)
    return None if mode is None else str(getattr(mode, "value", mode))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="path to a .nemo archive")
    ap.add_argument("--manifest", required=True, help="NeMo JSONL manifest (audio_filepath relative to its folder or absolute)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (also OMP/MKL env)")
    ap.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")
    ap.add_argument("--limit", type=int, default=0, help="only the first N files (0: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="CUDA only: autocast dtype for transcribe() (weights stay fp32)")
    ap.add_argument("--repeat", type=int, default=1, help="transcribe the manifest's files this many times")
    ap.add_argument("--warmup", type=int, default=0,
                    help="transcribe the first N files untimed first (kernel loading, cuBLAS/cuDNN set-up)")
    a = ap.parse_args()

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    t_start = time.perf_counter()

    import logging

    import torch

    torch.set_num_threads(a.threads)
    import nemo
    from nemo.collections.asr.models import ASRModel
    from nemo.utils import logging as nemo_logging
    from omegaconf import open_dict

    nemo_logging.setLevel(logging.ERROR)
    t_import = time.perf_counter() - t_start

    rows = read_manifest(a.manifest)
    if a.limit:
        rows = rows[: a.limit]
    rows = rows * max(a.repeat, 1)
    paths = [p for p, _, _ in rows]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"error: {len(missing)} audio files missing, first: {missing[0]}", file=sys.stderr)
        return 1
    audio_s = audio_seconds_of(paths)

    t0, c0 = time.perf_counter(), time.process_time()
    device = torch.device(a.device)
    model = ASRModel.restore_from(os.path.abspath(a.model), map_location=device)
    model = model.to(torch.float32).eval()
    if device.type == "cuda":
        _use_cuda_graph_decoder(model, open_dict)
    # archives written without a dataset config: transcribe() reads this key
    with open_dict(model.cfg):
        if model.cfg.get("validation_ds") is None:
            model.cfg.validation_ds = {"use_start_end_token": False}
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dtype = getattr(torch, a.dtype)
    autocast = torch.autocast("cuda", dtype=dtype, enabled=cuda and dtype != torch.float32)
    if a.warmup:
        with torch.inference_mode(), autocast:
            model.transcribe(paths[: a.warmup], batch_size=a.batch_size, verbose=False)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode(), autocast:
        out = model.transcribe(paths, batch_size=a.batch_size, verbose=False)
    if cuda:
        torch.cuda.synchronize()
    transcribe_s, transcribe_cpu = time.perf_counter() - t0, time.process_time() - c0
    if isinstance(out, tuple):  # hybrid / older APIs return (best, all)
        out = out[0]
    texts = [hyp_text(h) for h in out]

    refs = [r for _, _, r in rows]
    wer, n_words = corpus_wer(refs, texts) if any(r is not None for r in refs) else (None, 0)
    report = {
        "peer": "nemo",
        "nemo_version": nemo.__version__,
        "torch_version": torch.__version__,
        "model": os.path.abspath(a.model),
        "manifest": os.path.abspath(a.manifest),
        "files": len(paths),
        "audio_seconds": round(audio_s, 3),
        "import_seconds": round(t_import, 3),
        "load_seconds": round(load_s, 3),
        "transcribe_seconds": round(transcribe_s, 3),
        "load_cpu_seconds": round(load_cpu, 2),
        "transcribe_cpu_seconds": round(transcribe_cpu, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "rtfx_steady": round(audio_s / transcribe_s, 3) if transcribe_s > 0 else None,
        "batch_size": a.batch_size,
        "threads": torch.get_num_threads(),
        "warmup_files": min(a.warmup, len(paths)),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "dtype": a.dtype if cuda else "float32",
        "decoding": str(model.cfg.get("decoding", {}).get("strategy", "")),
        "cuda_graph_decoder": bool(model.cfg.decoding.get("greedy", {}).get("use_cuda_graph_decoder", False))
        if model.cfg.get("decoding") else False,
        "cuda_graphs_mode": _cuda_graphs_mode(model),
        "wer": wer,
        "wer_words": n_words,
        "wer_normalisation": WER_NORMALISATION,
        "texts": texts,
        "references": refs,
    }
    if a.json_out:
        d = os.path.dirname(os.path.abspath(a.json_out))
        os.makedirs(d, exist_ok=True)
        tmp = a.json_out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(tmp, a.json_out)
    wer_s = f", WER {100 * wer:.2f}%" if wer is not None else ""
    print(
        f"nemo {nemo.__version__}: {len(paths)} files, {audio_s:.1f} s audio; load {load_s:.2f} s, "
        f"transcribe {transcribe_s:.2f} s, RTFx steady {report['rtfx_steady']}{wer_s}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
