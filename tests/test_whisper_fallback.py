"""The temperature fallback (engines/whisper_fallback.py): the sampler draws from
softmax(logits / T) and never a banned token, samples that share a window's audio attend exactly
as separate rows would, OpenAI's retry test and faster-whisper's last resort, and on a seeded
random model: failed windows are re-decoded, the same whether decoded alone, in a batch or
through the graph modes' static path; on the bundled base model: real loops are replaced."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engines import whisper_fallback
from engines.decode_modes import DecodeMode
from engines.whisper import KVCache
from engines.whisper_decoding import DecodeOptions, WindowResult
from engines.whisper_fallback import Sampler, last_resort, needs_fallback, sample_seed
from engines.whisper_graph import WhisperGraphs
from whisper_random import random_audio, random_decoder, random_whisper

NEG_INF = float("-inf")
# Short windows, loops cut early, three temperatures of three samples: quick on a CPU.
OPTS = DecodeOptions(max_length=60, compression_ratio_threshold=1.3, loop_check_every=8,
                     temperatures=(0.0, 0.5, 1.0), best_of=3)


def test_sampler_draws_follow_softmax_at_temperature():
    logits = torch.tensor([[NEG_INF, 2.0, 1.0, NEG_INF, 0.0, -1.0]])
    n, t = 40000, 0.7
    got = Sampler(t, list(range(n)), "cpu").draw(logits.expand(n, -1).clone())
    freq = torch.bincount(got, minlength=6).double() / n
    want = (logits[0].double() / t).softmax(-1)
    assert freq[0] == 0 and freq[3] == 0, "a banned token was drawn"
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-12).all(), (freq, want)


def test_sampler_edges_never_reach_banned_tokens(monkeypatch):
    logits = torch.tensor([[NEG_INF, 1.0, NEG_INF, 0.5, NEG_INF]])
    for u, want in ((0.0, 1), (1.0 - 1e-16, 3)):
        monkeypatch.setattr(whisper_fallback.torch, "rand", lambda *a, u=u, **k: torch.full((1,), u, dtype=torch.float64))
        assert Sampler(1.0, [0], "cpu").draw(logits.clone()).tolist() == [want]


def test_sampler_is_reproducible_per_seed():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    draws = [Sampler(1.0, [11, 12, 13, 14], "cpu").draw(logits.clone()).tolist() for _ in range(2)]
    assert draws[0] == draws[1]
    # A row's draw depends on its own seed only, not on the rows beside it.
    assert Sampler(1.0, [13], "cpu").draw(logits[2:3].clone()).tolist() == draws[0][2:3]
    many = [Sampler(1.0, [s], "cpu").draw(logits[:1].clone()).item() for s in range(40)]
    assert len(set(many)) > 5, "different seeds should draw different tokens"
    assert len({sample_seed((1, 2, 3), 1, 0), sample_seed((1, 2, 3), 1, 1), sample_seed((1, 2, 4), 1, 1),
                sample_seed((1, 2, 3), 2, 0)}) == 4
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampler(0.0, [1], "cpu")


def test_samples_sharing_audio_attend_as_separate_rows():
    model = random_whisper()
    audio = random_audio(model, 2, seed=3)
    dec = model.decoder
    rows = [0, 0, 0, 1, 1, 1]
    tokens = torch.randint(0, 100, (6, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        separate = dec(tokens, dec.new_cache(audio[rows], 16))
        shared = dec.new_cache(audio, 16)
        layers, _, length, d = shared.self_k.shape
        grouped = KVCache(shared.self_k.new_empty(layers, 6, length, d), shared.self_v.new_empty(layers, 6, length, d),
                          shared.cross_k, shared.cross_v, group=3)
        together = dec(tokens, grouped)
    torch.testing.assert_close(together, separate, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot be compacted"):
        grouped.keep([0, 1, 2, 3, 4, 5], 6)


def _openai_needs_fallback(ratio: float, avg_lp: float, no_speech: float, o: DecodeOptions) -> bool:
    """openai-whisper transcribe.decode_with_fallback, verbatim in its logic."""
    needs = False
    if o.compression_ratio_threshold is not None and ratio > o.compression_ratio_threshold:
        needs = True  # too repetitive
    if o.logprob_threshold is not None and avg_lp < o.logprob_threshold:
        needs = True  # average log probability is too low
    if (o.no_speech_threshold is not None and no_speech > o.no_speech_threshold
            and o.logprob_threshold is not None and avg_lp < o.logprob_threshold):
        needs = False  # silence
    return needs


def _window(avg_lp: float, ratio: float, no_speech: float = 0.0, looped: bool | None = None,
            threshold: float | None = 2.4) -> WindowResult:
    looped = (threshold is not None and ratio > threshold) if looped is None else looped
    return WindowResult("x", (), (1,), avg_lp, no_speech, ratio, looped)


def test_retry_test_is_openais():
    cases = 0
    for opts in (DecodeOptions(), DecodeOptions(logprob_threshold=None), DecodeOptions(no_speech_threshold=None),
                 DecodeOptions(compression_ratio_threshold=None)):
        for avg_lp in (-2.0, -1.0, -0.999, -0.2):
            for ratio in (1.0, 2.4, 2.41, 5.0):
                for no_speech in (0.1, 0.6, 0.61, 0.99):
                    res = _window(avg_lp, ratio, no_speech, threshold=opts.compression_ratio_threshold)
                    assert needs_fallback(res, opts) == _openai_needs_fallback(ratio, avg_lp, no_speech, opts)
                    cases += 1
    assert cases == 256
    # A window the loop check cut (ratio measured on the cut text) is retried like a loop.
    assert needs_fallback(_window(-0.1, 2.0, looped=True), DecodeOptions())


def test_last_resort_prefers_the_likeliest_attempt_that_did_not_loop():
    looped, plain, better = _window(-0.1, 3.0), _window(-1.5, 1.2), _window(-1.2, 1.3)
    assert last_resort([looped, plain, better]) is better
    assert last_resort([_window(-0.5, 3.0), _window(-0.3, 2.9)]).avg_logprob == -0.3  # all looped


def test_options_check_temperatures_and_best_of():
    for bad in ((), (0.2, 0.4), (0.0, -0.2), (0.0, 3.0)):
        with pytest.raises(ValueError, match="temperatures"):
            DecodeOptions(temperatures=bad)
    with pytest.raises(ValueError, match="best_of"):
        DecodeOptions(best_of=0)


@pytest.fixture(scope="module")
def random_model():
    return random_whisper()


def test_failed_windows_are_redecoded_reproducibly(random_model):
    audio = random_audio(random_model, 6, seed=4)
    greedy = random_decoder(random_model, replace(OPTS, temperatures=(0.0,))).decode_audio(audio)
    got = random_decoder(random_model, OPTS).decode_audio(audio)
    failed = [needs_fallback(g, OPTS) for g in greedy]
    assert 0 < sum(failed) < len(greedy), "the seed should give windows that pass and windows that fail"
    assert any(r.temperature > 0 for r in got), "no sample won anywhere"
    for g, r, fail in zip(greedy, got, failed):
        if not fail:
            assert r == g, "a window that passed greedy decoding must be left alone"
        elif r.temperature == 0:  # every temperature failed and greedy stayed the likeliest
            assert r.tokens == g.tokens
        else:
            assert r.temperature in OPTS.temperatures[1:] and (not needs_fallback(r, OPTS) or not r.looped)
    # The same text for a window alone, in a batch in another order, and on the static path.
    alone = [random_decoder(random_model, OPTS).decode_audio(audio[i:i + 1])[0] for i in range(len(audio))]
    flipped = random_decoder(random_model, OPTS).decode_audio(audio.flip(0))[::-1]
    static = random_decoder(random_model, OPTS)
    static.graphs = WhisperGraphs(static, DecodeMode.UNROLLED, capture=False)
    for other in (alone, flipped, static.decode_audio(audio)):
        assert [(r.tokens, r.temperature) for r in other] == [(r.tokens, r.temperature) for r in got]
        assert all(math.isclose(a.avg_logprob, b.avg_logprob, abs_tol=1e-4) for a, b in zip(other, got))


def test_words_are_aligned_on_the_fallback_text(random_model):
    audio = random_audio(random_model, 4, seed=4)
    got = random_decoder(random_model, OPTS).decode_audio(audio, words=True)
    sampled = [r for r in got if r.temperature > 0 and r.text]
    assert sampled, "no sample won with text"
    for r in sampled:
        assert "".join(w[2] for w in r.words).replace(" ", "") == r.text.replace(" ", "")


def test_real_loops_are_replaced_on_the_bundled_model():
    from conftest import SPEECH, bundled_whisper_fp32
    from transcribe.audio import load_audio

    engine = bundled_whisper_fp32(batch_size=4)
    names = ["mfa_uhuh.flac", "mfa_um.flac", "mfa_putty.flac"]  # two loops and a one-word guess
    wavs = [load_audio(SPEECH / "mfa_tests" / n, 16000) for n in names]
    wavs.append(load_audio(SPEECH / "jfk" / "jfk.flac", 16000))  # passes greedily
    engine.decoder.opts = replace(engine.decoder.opts, temperatures=(0.0,))
    greedy = engine.decode_windows(wavs, words=False)
    engine.decoder.opts = DecodeOptions()
    got = engine.decode_windows(wavs, words=False)
    assert [g.looped for g in greedy] == [True, True, False, False]
    assert needs_fallback(greedy[2], engine.decoder.opts) and not needs_fallback(greedy[3], engine.decoder.opts)
    assert got[3] == greedy[3]
    for g, r in zip(greedy[:3], got[:3]):
        assert not r.looped and r.temperature > 0, (g.text, r.text)
        assert g.looped or r.avg_logprob >= g.avg_logprob  # the likeliest attempt, at worst


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full-graph", "unrolled"])
def test_gpu_fallback_after_captured_graphs_equals_eager(mode):
    """The fallback reads each window's audio from the graph modes' static buffers (rows moved
    between buckets) and samples with CUDA generators: the same as after eager decoding."""
    from engines import decode_modes

    if mode == "full-graph" and (why := decode_modes.full_graph_unsupported()) is not None:
        pytest.skip(f"full-graph unavailable: {why}")
    model = random_whisper("cuda")
    audio = random_audio(model, 6, seed=4)
    want = random_decoder(model, OPTS).decode_audio(audio)
    graphed = random_decoder(model, OPTS)
    assert graphed.set_mode(mode) == mode
    got = graphed.decode_audio(audio)
    assert any(r.temperature > 0 for r in want)
    assert [(r.tokens, r.temperature) for r in got] == [(r.tokens, r.temperature) for r in want]
