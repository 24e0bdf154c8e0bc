"""Whisper's compute dtype on the CPU (`--dtype`, engines/whisper_engine.compute_dtypes): bf16
runs the encoder on oneDNN-packed bf16 linears with fp32 LayerNorms while the decoder stays
fp32, and transcribes real speech with the words fp32 gives; unsupported dtypes fail before the
weights are read. The loader and CLI side is in tests/test_encoder_precision.py, the static
decoder path in bf16 in tests/test_whisper_graph.py."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import SPEECH

from engines.fast_linear import PackedLinear, onednn_linear_available
from engines.whisper_weights import WhisperWeightsError, bundled_base_dir

# Measured on the first 8 test-other utterances (159 words) on an AVX512_BF16 EPYC: encoder
# states' relative L2 error of bf16 against fp32 0.020; the texts 2 words apart ("liked" ->
# "like", "Helstern" -> "Houston": word error 1.26 %), WER 8.13 % fp32, 8.75 % bf16. The bounds
# leave room for another CPU's bf16 kernels (one more changed word), not for a broken model.
ENCODER_BOUND = 0.03
WORD_ERROR_BOUND = 0.03
WER_MARGIN = 0.02
FILES = 8


@pytest.fixture(scope="module")
def engines():
    if not onednn_linear_available(torch.bfloat16):
        pytest.skip("no bf16 in this CPU's hardware (AVX512_BF16 / AMX / Arm BF16)")
    try:
        bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    from engines.whisper_engine import WhisperEngine

    return {d: WhisperEngine.from_bundled(dtype=d, batch_size=FILES) for d in ("float32", "bf16")}


def test_bf16_packs_the_audio_side_in_bf16_and_keeps_the_token_side_and_norms_fp32(engines):
    assert engines["float32"].runtime == "encoder float32, decoder float32 eager, language en"
    assert engines["bf16"].runtime == "encoder bfloat16, decoder float32 eager, language en"
    for name, want in (("float32", (torch.float32, torch.float32)), ("bf16", (torch.bfloat16, torch.float32))):
        model = engines[name].decoder.model
        for half, dtype in zip((model.encoder, model.decoder), want):
            assert half.dtype == dtype
            packed = [m for m in half.modules() if isinstance(m, PackedLinear)]
            # per layer qkv, out, fc1 (GELU fused), fc2; the decoder's cross q, kv, out and the logits head
            layers = len(half.layers)
            assert len(packed) == (4 * layers if half is model.encoder else 7 * layers + 1)
            # The cross K/V projection reads the encoder's states, once per window: it runs in
            # the encoder's dtype and writes the decoder's cache (fp32) by casting.
            kv = [layer.cross.kv for layer in model.decoder.layers]
            assert all(m.packed.dtype == m.dtype == (want[0] if m in kv else dtype) for m in packed)
            assert model.decoder.audio_dtype == want[0]
            assert [m.activation for m in packed].count("gelu") == layers
            assert not any(isinstance(m, torch.nn.Linear) for m in half.modules())
            norms = [m for m in half.modules() if isinstance(m, torch.nn.LayerNorm)]
            assert len(norms) == (2 if half is model.encoder else 3) * layers + 1
            assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
        assert model.encoder.conv1.weight.dtype == model.encoder.conv2.weight.dtype == want[0]
        assert model.decoder.head.out_features == model.dims.n_vocab


@pytest.mark.skipif(not SPEECH.is_dir(), reason=f"shared speech data not found at {SPEECH}")
def test_bf16_transcribes_real_speech_with_the_words_of_fp32(engines):
    from transcribe.audio import load_audio
    from transcribe.bench import wer
    from transcribe.whisper_features import N_SAMPLES, FeatureConfig, log_mel_spectrogram

    manifest = SPEECH / "librispeech_test_other" / "manifest.jsonl"
    rows = [json.loads(line) for line in manifest.read_text().splitlines()][:FILES]
    batch = torch.zeros(len(rows), N_SAMPLES)
    for i, r in enumerate(rows):
        wav = load_audio(manifest.parent / r["audio_filepath"], 16000)
        batch[i, :len(wav)] = torch.from_numpy(wav)
    mel = log_mel_spectrogram(batch, FeatureConfig(80))
    with torch.inference_mode():
        audio = {d: e.decoder.model.encoder(mel) for d, e in engines.items()}
        texts = {d: [r.text for r in e.decoder.decode_audio(audio[d])] for d, e in engines.items()}
    assert audio["bf16"].dtype == torch.bfloat16
    err = float((audio["bf16"].double() - audio["float32"].double()).norm() / audio["float32"].double().norm())
    assert 0 < err < ENCODER_BOUND  # bf16 really ran, and stayed close
    assert wer(texts["float32"], texts["bf16"]) <= WORD_ERROR_BOUND, texts
    refs = [r["text"] for r in rows]
    assert wer(refs, texts["bf16"]) <= wer(refs, texts["float32"]) + WER_MARGIN


def test_unsupported_dtypes_fail_before_the_weights_are_read(monkeypatch):
    from engines.whisper_engine import WhisperEngine

    def no_read(*args):
        raise AssertionError("weights read before the dtype was checked")

    monkeypatch.setattr("engines.whisper_weights.load_ct2", no_read)
    with pytest.raises(ValueError, match="encoder dtype float16 is not supported on device cpu"):
        WhisperEngine.from_bundled(dtype="fp16")
    with pytest.raises(ValueError, match="dtype 'half' is not supported"):
        WhisperEngine.from_bundled(dtype="half")
    monkeypatch.setattr("engines.precision.onednn_linear_available", lambda dtype: False)
    with pytest.raises(ValueError, match="bfloat16 is not supported on device cpu: this CPU has no bf16"):
        WhisperEngine.from_bundled(dtype="bfloat16")


def fake_probe(monkeypatch, clock, seconds: dict) -> None:
    """probe_gemm stand-in on the fake clock: each run of a dtype's GEMM takes
    `seconds[dtype]` and is recorded in clock.runs."""
    from engines import fast_linear

    monkeypatch.setattr(fast_linear, "probe_gemm", lambda dtype: lambda: clock.spend(dtype, seconds[dtype]))


@pytest.mark.parametrize("bf16_seconds, pays", [(0.5, True), (0.84, True), (0.86, False), (1.8, False)])
def test_bf16_is_taken_only_where_its_gemm_beats_fp32s_by_the_margin(monkeypatch, fake_clock, bf16_seconds, pays):
    """A CPU with hardware bf16 can still run bf16 GEMMs slower than fp32 (an Intel Xeon with
    AVX512_BF16 and no AMX: 0.55x), so bf16_gemm_pays times both: bf16 must take under
    PROBE_MARGIN (0.85) of fp32's time, fp32 and bf16 each run `rounds` times."""
    from engines import fast_linear

    fake_probe(monkeypatch, fake_clock, {torch.float32: 1.0, torch.bfloat16: bf16_seconds})
    monkeypatch.setattr(fast_linear, "onednn_linear_available", lambda dtype=torch.float32: True)
    fast_linear.bf16_gemm_pays.cache_clear()
    try:
        assert fast_linear.bf16_gemm_pays() is pays
        assert sorted(map(str, fake_clock.runs)) == ["torch.bfloat16"] * 3 + ["torch.float32"] * 3
    finally:
        fast_linear.bf16_gemm_pays.cache_clear()


def test_bf16_never_pays_where_onednn_cannot_compute_it(monkeypatch, fake_clock):
    from engines import fast_linear

    fake_probe(monkeypatch, fake_clock, {torch.float32: 1.0, torch.bfloat16: 0.1})
    monkeypatch.setattr(fast_linear, "onednn_linear_available", lambda dtype=torch.float32: dtype == torch.float32)
    fast_linear.bf16_gemm_pays.cache_clear()
    try:
        assert fast_linear.bf16_gemm_pays() is False and fake_clock.runs == []
    finally:
        fast_linear.bf16_gemm_pays.cache_clear()


def test_the_probe_times_real_packed_gemms_in_both_dtypes():
    """The real probe on this CPU: it runs (bf16 only where oneDNN computes it) and is timed in seconds."""
    from engines.cpu_threads import best_seconds
    from engines.fast_linear import onednn_linear_available, probe_gemm

    for dtype in (torch.float32, torch.bfloat16):
        if onednn_linear_available(dtype):
            assert 0 < best_seconds({dtype: probe_gemm(dtype)}, rounds=1)[dtype] < 10


@pytest.mark.parametrize("pays", [True, False])
def test_auto_is_bf16_on_the_cpu_only_where_bf16_gemms_pay(monkeypatch, pays):
    """--dtype auto on the CPU: the bf16 encoder where bf16 GEMMs measured faster (same WER as
    fp32 over 0.92 h of speech, engines/whisper_engine.compute_dtypes), else fp32; the CPU
    decoder fp32 either way. An explicit dtype runs no probe."""
    from engines import fast_linear
    from engines.whisper_engine import compute_dtypes

    monkeypatch.setattr(fast_linear, "bf16_gemm_pays", lambda: pays)
    assert compute_dtypes("auto", "cpu") == (torch.bfloat16 if pays else torch.float32, torch.float32)

    def no_probe():
        raise AssertionError("an explicit --dtype must not time the GEMMs")
    monkeypatch.setattr(fast_linear, "bf16_gemm_pays", no_probe)
    assert compute_dtypes("float32", "cpu") == (torch.float32, torch.float32)
    if onednn_linear_available(torch.bfloat16):
        assert compute_dtypes("bf16", "cpu") == (torch.bfloat16, torch.float32)
