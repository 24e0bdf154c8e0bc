"""Whisper decoder modes on a seeded random-weight model (tests/whisper_random.py), so they need
no downloaded files and run on a bare GPU machine (bench/gpu/on_device.sh tests). The CPU tests
drive the static path without capture (DirectRunner) against eager; the gpu tests capture and
replay both graph modes on CUDA. tests/test_whisper_graph.py has the same checks on the bundled
base model and real speech, where those are installed."""
from __future__ import annotations

import logging
from functools import lru_cache

import pytest
import torch

from engines import cuda_conditional, decode_modes
from engines.decode_modes import DecodeMode
from engines.whisper_decoding import DecodeOptions
from engines.whisper_graph import DirectRunner, FullGraphRunner, UnrolledRunner, WhisperGraphs
from whisper_random import (EPS, Decoded, assert_follows, assert_same_results, decode_recorded, random_audio,
                            random_decoder, random_vocab, random_whisper)

# Seed 4's 8 windows end by <|endoftext|> after 2 to 171 steps, by the loop check and at
# max_length (see test_static_path_equals_eager_on_random_model); buckets 1, 2, 4, 8.
N_WINDOWS, AUDIO_SEED = 8, 4
EOT = random_vocab().eot
# Each ends windows differently; in all of them some windows finish within the first chunks, so
# the static path moves the live rows to smaller buckets (eager compacts on its own schedule).
# These compare the greedy pass (the graph modes' part): no temperature fallback
# (test_whisper_fallback.py covers it, in every mode).
GREEDY = (0.0,)
CONFIGS = {
    "timestamps": DecodeOptions(max_length=120, temperatures=GREEDY),  # <|endoftext|>, max_length; timestamp rules
    "text-max-length": DecodeOptions(timestamps=False, max_length=40, temperatures=GREEDY),  # 36 steps: ends mid-chunk
    "loop-cut": DecodeOptions(compression_ratio_threshold=1.3, loop_check_every=8, max_length=120, temperatures=GREEDY),
    # full-graph: one chunk, the while node runs until every row has finished
    "no-loop-check": DecodeOptions(compression_ratio_threshold=None, loop_check_every=4, max_length=80,
                                   temperatures=GREEDY),
    # an initial prompt moves every position (and the no-speech read) by its length (this
    # vocabulary spells a space only before a lowercase letter)
    "prompt": DecodeOptions(max_length=120, temperatures=GREEDY, initial_prompt="names: kubernetes, grpc, nguyen."),
}
GPU_CONFIGS = {"default": DecodeOptions(temperatures=GREEDY), **CONFIGS}  # all 445 steps, on the GPU only (slow on a CPU)
# So that the comparison cannot go vacuous: the share of eager's steps compared (those before
# each window's first near tie) is at least this. Measured on the CPU, the GPU test's decodes
# without capture: 36 % in fp16, 9 % in bf16 (13 % over CONFIGS).
MIN_COMPARED = {torch.float16: 0.15, torch.bfloat16: 0.03}


@lru_cache(maxsize=None)
def model(device: str, dtype: torch.dtype):
    return random_whisper(device, dtype)


def windows(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return random_audio(model(device, dtype), N_WINDOWS, AUDIO_SEED)


def direct(dtype: torch.dtype, opts: DecodeOptions, mode: DecodeMode, device: str = "cpu"):
    """A decoder running the mode's steps without capture (what the CPU can run)."""
    dec = random_decoder(model(device, dtype), opts)
    dec.graphs = WhisperGraphs(dec, mode, capture=False)
    return dec


@lru_cache(maxsize=None)
def eager_cpu(dtype: torch.dtype, name: str) -> Decoded:
    with torch.inference_mode():
        return decode_recorded(random_decoder(model("cpu", dtype), CONFIGS[name]), windows(dtype), margins=True)


@pytest.fixture
def buckets_run(monkeypatch) -> list[int]:
    """The batch bucket of every chunk run, by any runner."""
    seen: list[int] = []
    for cls in (DirectRunner, UnrolledRunner, FullGraphRunner):
        def spy(self, b, run=cls.run):
            seen.append(b)
            run(self, b)

        monkeypatch.setattr(cls, "run", spy)
    return seen


def check_buckets(runs: list[int], n: int, mode: DecodeMode, opts: DecodeOptions) -> bool:
    """The chunks of one batch of n windows ran on shrinking buckets; True when they moved."""
    if mode is DecodeMode.FULL_GRAPH and opts.compression_ratio_threshold is None:  # one while loop
        assert len(runs) == 1
    assert runs[0] >= n and runs == sorted(runs, reverse=True)
    return runs[-1] < runs[0]


# ---- CPU: the static step without capture -----------------------------------------------------

@pytest.mark.parametrize("mode", [DecodeMode.UNROLLED, DecodeMode.FULL_GRAPH])
def test_static_path_equals_eager_on_random_model(mode, buckets_run):
    ends, moved = set(), False
    for name, opts in CONFIGS.items():
        want = eager_cpu(torch.float32, name)
        buckets_run.clear()
        with torch.inference_mode():
            got = decode_recorded(direct(torch.float32, opts, mode), windows(torch.float32))
        assert assert_follows(got, want, EPS[torch.float32]) == (sum(map(len, want.streams)),) * 2
        assert_same_results(got.results, want.results)
        moved |= check_buckets(buckets_run, N_WINDOWS, mode, opts)
        ends |= set(want.ends(EOT))
        assert len({len(s) for s in want.streams}) > 1, f"{name}: windows end at different steps"
    assert ends == {"eot", "loop", "max"} and moved


def test_recorded_margins_follow_windows_through_compaction():
    """Eager compacts finished rows away; the margins recorded for a window in the batch are the
    ones it gets decoded alone (fp32, other batch sizes: within 1e-3)."""
    m, opts = model("cpu", torch.float32), CONFIGS["timestamps"]
    batch, audio = eager_cpu(torch.float32, "timestamps"), windows(torch.float32)
    assert len(set(batch.ends(EOT))) > 1 and all(min(x) >= 0 for x in batch.margins)
    with torch.inference_mode():
        for w in range(N_WINDOWS):
            alone = decode_recorded(random_decoder(m, opts), audio[w:w + 1], margins=True)
            assert alone.streams[0] == batch.streams[w]
            assert alone.margins[0] == pytest.approx(batch.margins[w], abs=1e-3)


def _decoded(streams, looped, margins=None) -> Decoded:
    return Decoded([], streams, looped, margins)


def test_margin_comparison_fails_where_eager_was_sure():
    want = _decoded([[5, 6, 7, EOT], [1, 2, 3]], [False, True], [[3.0, 0.01, 3.0, 3.0], [3.0, 3.0, 3.0]])
    assert assert_follows(want, want, 0.1) == (1 + 3, 7)  # window 0: compared up to its near tie
    assert assert_follows(_decoded([[5, 9, 9], [1, 2, 3]], [True, True]), want, 0.1) == (4, 7)
    fails = [([[4, 6, 7, EOT], [1, 2, 3]], [False, True], "window 0 diverges from eager at step 0"),
             ([[5, 6, 7, EOT], [1, 2]], [False, True], "window 1 diverges from eager at step 2"),  # ended early
             ([[5, 6, 7, EOT], [1, 2, 3, 4]], [False, True], "window 1 diverges .*eager had ended"),
             ([[5, 6, 7, EOT], [1, 2, 3]], [False, False], "window 1: loop cut False, eager True")]
    for streams, looped, match in fails:
        with pytest.raises(AssertionError, match=match):
            assert_follows(_decoded(streams, looped), want, 0.1)
    with pytest.raises(AssertionError, match="step 1 .*margin there 0.01"):  # eps=0: identical
        assert_follows(_decoded([[5, 9, 9], [1, 2, 3]], [True, True]), want, 0.0)


def test_static_path_follows_eager_on_random_model_in_bf16(monkeypatch):
    """The margin-aware comparison on real decodes (the CPU's bf16; the GPU tests run it in
    fp16 and bf16), unrolled: full-graph chunks differ only in where they stop.

    The first-batch check (`agrees_with_eager`) compares whole rows exactly, and this random
    model's rows meet near ties early (203 of eager's 1413 steps come before their window's
    first one, seen on an AVX512_BF16 EPYC): oneDNN's bf16 GEMMs round otherwise for the static
    path's batch shapes than for eager's, so 3 of 8 rows differ past a tie, and the check fell
    back before this test compared anything (it failed on every bf16 CPU since the check came
    in; CI's CPUs had no bf16 and skipped it). Here any number of rows may differ; the margins
    judge them."""
    from engines.fast_linear import onednn_linear_available

    if not onednn_linear_available(torch.bfloat16):
        pytest.skip("no bf16 in this CPU's hardware (AVX512_BF16 / AMX / Arm BF16)")
    monkeypatch.setattr(decode_modes, "MAX_DIFFERING_ROWS", 1.0)
    compared = total = 0
    for name, opts in CONFIGS.items():
        with torch.inference_mode():
            got = decode_recorded(direct(torch.bfloat16, opts, DecodeMode.UNROLLED), windows(torch.bfloat16))
        c, t = assert_follows(got, eager_cpu(torch.bfloat16, name), EPS[torch.bfloat16])
        compared, total = compared + c, total + t
    assert compared >= MIN_COMPARED[torch.bfloat16] * total, f"compared {compared} of {total} steps"


# ---- GPU: real capture and replay -------------------------------------------------------------

def _gpu_setup(mode: str, dtype: torch.dtype) -> None:
    if mode == "full-graph" and (why := decode_modes.full_graph_unsupported()) is not None:
        pytest.skip(f"full-graph unavailable: {why}")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")


def check_gpu_modes(mode: str, dtype: torch.dtype, buckets_run: list[int]) -> tuple[int, int]:
    """Every config: a captured decoder (graphs built once, then a smaller batch and one row)
    and, in fp32, the direct path on CUDA against eager. Returns (steps compared, steps)."""
    m, compared, total, moved = model("cuda", dtype), 0, 0, False
    audio = windows(dtype, "cuda")
    for name, opts in GPU_CONFIGS.items():
        eager, graphed = random_decoder(m, opts), random_decoder(m, opts)
        assert graphed.set_mode(mode) == mode
        for rows in (audio, audio[2:4], audio[:1]):
            want = decode_recorded(eager, rows, margins=True)
            extra = (direct(dtype, opts, DecodeMode(mode), "cuda"),) if dtype == torch.float32 else ()
            for dec in (graphed, *extra):
                buckets_run.clear()
                got = decode_recorded(dec, rows)
                c, t = assert_follows(got, want, EPS[dtype])
                compared, total = compared + c, total + t
                if dtype == torch.float32:
                    assert_same_results(got.results, want.results)
                moved |= check_buckets(buckets_run, len(rows), DecodeMode(mode), opts)
        assert graphed.mode == mode, "no fallback expected"
        assert graphed.graphs.captures == 1
    assert moved
    return compared, total


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full-graph", "unrolled"])
def test_gpu_random_model_modes_equal_eager_in_fp32(mode, buckets_run):
    _gpu_setup(mode, torch.float32)
    with torch.inference_mode():
        compared, total = check_gpu_modes(mode, torch.float32, buckets_run)
    assert compared == total


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["full-graph", "unrolled"])
def test_gpu_random_model_modes_follow_eager_in_half(mode, dtype, buckets_run):
    _gpu_setup(mode, dtype)
    with torch.inference_mode():
        compared, total = check_gpu_modes(mode, dtype, buckets_run)
    assert compared >= MIN_COMPARED[dtype] * total, f"compared {compared} of {total} steps"


@pytest.mark.gpu
def test_gpu_random_model_full_graph_capture_failure_falls_back_to_unrolled(monkeypatch, caplog):
    _gpu_setup("full-graph", torch.float32)

    def broken_while_loop(self, flag):
        raise cuda_conditional.CudaPythonError("simulated conditional-node failure")

    monkeypatch.setattr(cuda_conditional.WhileLoops, "while_loop", broken_while_loop)
    m = model("cuda", torch.float32)
    opts = DecodeOptions(temperatures=GREEDY)
    dec = random_decoder(m, opts)
    assert dec.set_mode("full-graph") == "full-graph"
    audio = windows(torch.float32, "cuda")[:3]
    with torch.inference_mode():
        with caplog.at_level(logging.WARNING, logger="transcribe"):
            got = decode_recorded(dec, audio, falls_back=True)
        want = decode_recorded(random_decoder(m, opts), audio, margins=True)
    assert dec.mode == "unrolled"
    assert_follows(got, want, 0.0)
    assert_same_results(got.results, want.results)
    lines = [r.getMessage() for r in caplog.records if r.name == "transcribe"]
    assert len(lines) == 1 and "simulated conditional-node failure" in lines[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["full-graph", "unrolled"])
def test_graph_modes_keep_every_windows_audio_for_words(mode, device, buckets_run):
    """Word times read each window's cross K/V after the batch (engines/whisper_alignment.py):
    the static rows are permuted, not overwritten, as live rows move to smaller buckets, so the
    graph path's words equal eager's (fp32; captured on CUDA, step by step on the CPU)."""
    if device == "cuda":
        _gpu_setup(mode, torch.float32)
    opts, m = CONFIGS["timestamps"], model(device, torch.float32)
    audio = windows(torch.float32, device)
    with torch.inference_mode():
        want = random_decoder(m, opts).decode_audio(audio, words=True)
        if device == "cuda":
            dec = random_decoder(m, opts)
            assert dec.set_mode(mode) == mode
        else:
            dec = direct(torch.float32, opts, DecodeMode(mode))
        buckets_run.clear()
        got = dec.decode_audio(audio, words=True)
    assert check_buckets(buckets_run, N_WINDOWS, DecodeMode(mode), opts)
    assert sum(len(r.words) for r in want) > 20
    for g, w in zip(got, want, strict=True):
        assert [x[:3] for x in g.words] == [x[:3] for x in w.words]
        assert [x[3] for x in g.words] == pytest.approx([x[3] for x in w.words], abs=1e-4)
