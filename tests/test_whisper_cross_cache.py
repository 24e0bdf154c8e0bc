"""The Whisper decoder's cross-attention cache dtype on the CPU (engines/whisper.py,
engines/whisper_engine.cross_attention_cache_dtype): under the fp32 decoder the cached audio K/V
may be stored in bf16, where attention over a bf16 cache times faster (on an Intel Xeon with
AVX512_BF16 it took 0.51-0.59 of fp32's time; on an AMD EPYC torch's bf16 attention was 3.4x
slower). Attention over it stays fp32 attention within bf16's rounding, the choice is timed once
and only for --dtype auto, every path that reads the cache (greedy, the temperature fallback's
samples, the static step, word alignment) runs over it, and on real speech it gives fp32's
words."""
from __future__ import annotations

import pytest
import torch
from whisper_random import random_audio, random_decoder, random_dims, random_state

from engines import whisper
from engines.decode_modes import DecodeMode
from engines.whisper import CrossAttention, build_whisper
from engines.whisper_decoding import DecodeOptions
from engines.whisper_engine import cross_attention_cache_dtype
from engines.whisper_graph import WhisperGraphs

# As tests/test_whisper_fallback.py: short windows, three temperatures of three samples.
OPTS = DecodeOptions(max_length=60, compression_ratio_threshold=1.3, loop_check_every=8,
                     temperatures=(0.0, 0.5, 1.0), best_of=3)


def test_attention_over_a_bf16_cache_is_fp32_attention_within_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    attn = CrossAttention(64, 4).requires_grad_(False)
    x = torch.randn(3, 2, 64, generator=g)
    k, v = (torch.randn(3, 4, 50, 16, generator=g) for _ in range(2))
    with torch.inference_mode():
        want = attn(x, k, v)
        got = attn(x, k.bfloat16(), v.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, want), "the bf16 cache should round something"


def fake_attention(monkeypatch, clock, seconds: dict[torch.dtype, float]) -> None:
    """SDPA stand-in on the fake clock: one call over a cache of dtype d takes seconds[d]."""
    def sdpa(q, k, v, **_):
        clock.spend(k.dtype, seconds[k.dtype])
        return q
    monkeypatch.setattr(whisper.F, "scaled_dot_product_attention", sdpa)


@pytest.mark.parametrize("bf16_seconds, want", [(0.5, torch.bfloat16), (0.79, torch.bfloat16),
                                                (0.81, torch.float32), (3.4, torch.float32)])
def test_bf16_is_taken_only_where_it_beats_fp32_by_the_margin(monkeypatch, fake_clock, bf16_seconds, want):
    """bf16 rounds the cache, so it must take under CROSS_BF16_MARGIN (0.8) of fp32's time; each
    dtype runs a warm-up and 5 timed steps, a step being one attention call per layer, on one
    thread (two made the ratio jump under outside load)."""
    fake_attention(monkeypatch, fake_clock, {torch.float32: 1.0, torch.bfloat16: bf16_seconds})
    threads = []
    real = whisper.F.scaled_dot_product_attention
    monkeypatch.setattr(whisper.F, "scaled_dot_product_attention",
                        lambda *a, **k: threads.append(torch.get_num_threads()) or real(*a, **k))
    whisper.cross_cache_dtype.cache_clear()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert whisper.cross_cache_dtype(64, 4, 30, 2) is want
        assert sorted(fake_clock.runs, key=str) == [torch.bfloat16] * 12 + [torch.float32] * 12
        assert set(threads) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        whisper.cross_cache_dtype.cache_clear()


def test_where_bf16_attention_fails_the_cache_is_fp32_untimed(monkeypatch):
    def sdpa(q, k, v, **_):
        if k.dtype == torch.bfloat16:
            raise RuntimeError("\"flash_attention\" not implemented for 'BFloat16'")
        return q
    monkeypatch.setattr(whisper.F, "scaled_dot_product_attention", sdpa)
    whisper.cross_cache_dtype.cache_clear()
    try:
        assert whisper.cross_cache_dtype(64, 4, 30, 2) is torch.float32
    finally:
        whisper.cross_cache_dtype.cache_clear()


def test_the_real_probe_runs_once_per_shape(monkeypatch):
    whisper.cross_cache_dtype.cache_clear()
    calls = []
    real = whisper.F.scaled_dot_product_attention
    monkeypatch.setattr(whisper.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        first = whisper.cross_cache_dtype(64, 4, 300, 2)
        assert first in (torch.float32, torch.bfloat16) and calls
        n = len(calls)
        assert whisper.cross_cache_dtype(64, 4, 300, 2) is first and len(calls) == n
    finally:
        whisper.cross_cache_dtype.cache_clear()


@pytest.mark.parametrize("pays", [True, False])
def test_the_cache_dtype_is_timed_only_for_auto_on_the_cpu_under_an_fp32_decoder(monkeypatch, pays):
    dims = random_dims()
    asked = []
    monkeypatch.setattr(whisper, "cross_cache_dtype",
                        lambda *shape: asked.append(shape) or (torch.bfloat16 if pays else torch.float32))
    want = torch.bfloat16 if pays else torch.float32
    assert cross_attention_cache_dtype("auto", "cpu", torch.float32, dims) is want
    assert asked == [(dims.n_text_state, dims.n_text_head, dims.n_audio_ctx, dims.n_text_layer)]
    # An explicit dtype keeps the decoder's; so does CUDA (one dtype for both halves there), and
    # a decoder already in bf16.
    for name, device, decoder in (("float32", "cpu", torch.float32), ("bf16", "cpu", torch.float32),
                                  ("auto", "cuda", torch.float16), ("auto", "cpu", torch.bfloat16)):
        assert cross_attention_cache_dtype(name, device, decoder, dims) is decoder
    assert len(asked) == 1


@pytest.fixture(scope="module")
def bf16_cache_model():
    dims = random_dims()
    return build_whisper(dims, {k: v.clone() for k, v in random_state(dims).items()}, "cpu",
                         cross_dtype=torch.bfloat16)


def test_every_decoding_path_runs_over_a_bf16_cache(bf16_cache_model):
    """Greedy, the fallback's samples (which build their own self K/V beside the shared cross
    K/V), the graph modes' static step and word alignment, on a random model whose cache is bf16
    under an fp32 decoder."""
    model = bf16_cache_model
    assert model.decoder.cache_dtype is torch.bfloat16 and model.decoder.dtype is torch.float32
    audio = random_audio(model, 6, seed=4)
    cache = model.decoder.new_cache(audio, 8)
    assert cache.cross_k.dtype is torch.bfloat16 and cache.self_k.dtype is torch.float32
    got = random_decoder(model, OPTS).decode_audio(audio, words=True)
    assert any(r.temperature > 0 for r in got), "no window went through the fallback"
    for r in got:
        if r.text:
            assert "".join(w[2] for w in r.words).replace(" ", "") == r.text.replace(" ", "")
    static = random_decoder(model, OPTS)
    static.graphs = WhisperGraphs(static, DecodeMode.UNROLLED, capture=False)
    assert [(r.tokens, r.temperature) for r in static.decode_audio(audio)] == [(r.tokens, r.temperature) for r in got]
    assert static.graphs.static.cross_k.dtype is torch.bfloat16


def test_a_cpu_without_bf16_gemms_still_holds_a_bf16_cache(monkeypatch):
    """The cache is only attended over (SDPA computes bf16 in software where the CPU lacks it),
    so a CPU whose oneDNN has no bf16 GEMMs (an AVX2-only AMD EPYC) builds a model with a bf16
    cache, where the probe picks one; its encoder and decoder still refuse bf16."""
    monkeypatch.setattr("engines.precision.onednn_linear_available", lambda dtype=torch.float32: dtype == torch.float32)
    dims = random_dims()
    model = build_whisper(dims, random_state(dims), "cpu", cross_dtype=torch.bfloat16)
    assert model.decoder.cache_dtype is torch.bfloat16
    for dtype, decoder_dtype in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        with pytest.raises(ValueError, match="bfloat16 is not supported on device cpu"):
            build_whisper(dims, random_state(dims), "cpu", dtype=dtype, decoder_dtype=decoder_dtype)
    with pytest.raises(ValueError, match="float16 is not supported on device cpu"):
        build_whisper(dims, random_state(dims), "cpu", cross_dtype=torch.float16)


def test_the_bundled_base_gives_fp32s_words_over_a_bf16_cache():
    """Real speech: the same text as the fp32 cache on test-other (all 100 files agreed; 9 of
    15,562 words differed over the 486 shared files), and the startup note says which cache it
    runs. JFK's comma after "Americans" is one of those near-ties: it drops over a bf16 cache
    when the encoder's attention runs the "loop" kernel, which its startup timing picks on
    some runs of this CPU (seen in CI, 2026-11-28), and word times around it move (up to
    1.1 s), so there only the words must agree."""
    import json

    from conftest import SPEECH, bundled_whisper_fp32
    from transcribe.audio import load_audio

    engine = bundled_whisper_fp32(batch_size=8)
    rows = (SPEECH / "librispeech_test_other" / "manifest.jsonl").read_text().splitlines()[:6]
    wavs = [load_audio(SPEECH / "librispeech_test_other" / json.loads(r)["audio_filepath"], 16000) for r in rows]
    wavs.append(load_audio(SPEECH / "jfk" / "jfk.flac", 16000))
    want = engine.decode_windows(wavs, words=True)
    assert "cross-attention" not in engine.runtime
    text = engine.decoder.model.decoder
    text.cache_dtype = torch.bfloat16
    try:
        got = engine.decode_windows(wavs, words=True)
        assert engine.runtime.startswith("encoder float32, decoder float32 eager (cross-attention cache bfloat16)")
    finally:
        text.cache_dtype = torch.float32
    assert [r.text for r in got[:-1]] == [r.text for r in want[:-1]]  # test-other
    spoken = [[x.strip(",.?!").lower() for x in r.text.split()] for r in (got[-1], want[-1])]  # JFK
    assert spoken[0] == spoken[1]
    for g, w in zip(got[:-1], want[:-1]):  # JFK's words move up to 1.1 s where its comma drops
        assert max((abs(a[0] - b[0]) for a, b in zip(g.words, w.words)), default=0) <= 0.1
