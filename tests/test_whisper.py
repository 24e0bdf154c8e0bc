"""Whisper front end, tokenizer, decoding rules, and real transcriptions with the bundled base."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engines.whisper_decoding import DecodeOptions, GreedyDecoder
from engines.whisper_progress import Progress, compression_ratio, trim_repetition
from engines.whisper_rules import RuleState, Rules
from engines.whisper_tokenizer import WhisperTokenizer, load_tokenizer
from engines.whisper_weights import WhisperWeightsError, bundled_base_dir
from conftest import SPEECH
from transcribe.features import _hz_to_mel, _mel_to_hz
from transcribe.whisper_features import N_FRAMES, FeatureConfig, log_mel_spectrogram, mel_filterbank


def reference_log_mel(audio: np.ndarray, n_mels: int) -> np.ndarray:
    """Whisper's definition written out in float64 numpy: explicit reflect padding, framing,
    periodic Hann window and a DFT matrix (no FFT, no torch)."""
    x = np.zeros(480000)
    x[:len(audio)] = audio
    x = np.concatenate([x[200:0:-1], x, x[-2:-202:-1]])  # reflect-pad n_fft // 2 each side
    n = np.arange(400)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / 400)
    frames = np.stack([x[i * 160:i * 160 + 400] for i in range(3000)]) * window  # last frame dropped
    k = np.arange(201)[:, None]
    dft = np.exp(-2j * np.pi * k * n[None, :] / 400)
    power = np.abs(frames @ dft.T) ** 2  # [3000, 201]
    log = np.log10(np.maximum(mel_filterbank(n_mels).astype(np.float64) @ power.T, 1e-10))
    return (np.maximum(log, log.max() - 8.0) + 4.0) / 4.0


@pytest.mark.parametrize("n_mels,seconds", [(80, 1.5), (128, 1.5), (80, 30.0), (80, 29.99)])
def test_log_mel_matches_direct_dft_reference(n_mels, seconds):
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * 16000)) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    ours = log_mel_spectrogram(torch.from_numpy(audio), FeatureConfig(n_mels)).numpy()
    assert ours.shape == (n_mels, N_FRAMES)
    np.testing.assert_allclose(ours, reference_log_mel(audio, n_mels), atol=2e-4)
    batch = log_mel_spectrogram(torch.from_numpy(np.stack([audio, audio[::-1].copy()])), FeatureConfig(n_mels))
    np.testing.assert_allclose(batch[0].numpy(), ours, atol=1e-6)


def test_slaney_mel_scale_and_filterbank():
    assert _hz_to_mel(1000.0) == pytest.approx(15.0)
    assert _hz_to_mel(8000.0) == pytest.approx(45.245640471924965)  # librosa.hz_to_mel(8000)
    hz = np.array([0.0, 123.0, 999.0, 1000.0, 4321.0, 8000.0])
    np.testing.assert_allclose(_mel_to_hz(_hz_to_mel(hz)), hz, atol=1e-9)
    fb = mel_filterbank(80)
    assert fb.shape == (80, 201) and (fb >= 0).all()
    # Slaney norm: each triangle has unit area in Hz (bins are 40 Hz apart); the narrow low
    # filters are undersampled by the 40 Hz grid, so check those filters wider than 4 bins.
    widths = np.diff(_mel_to_hz(np.linspace(0, _hz_to_mel(8000.0), 82)), 2)
    area = fb.sum(1) * 40.0
    np.testing.assert_allclose(area[widths / 2 > 160], 1.0, rtol=0.03)
    peaks = fb.argmax(1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > 190
    with pytest.raises(ValueError, match="n_mels"):
        FeatureConfig(n_mels=64)


def _fake_vocab(multilingual: bool) -> WhisperTokenizer:
    """A tiny vocab laid out like Whisper's: text tokens, then specials, then timestamps."""
    text = ["a", "b", "Ġ", "Ġhi", "!"]
    langs = ["<|en|>", "<|de|>"] if multilingual else []
    special = ["<|endoftext|>", "<|startoftranscript|>", *langs, "<|translate|>", "<|transcribe|>",
               "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    return WhisperTokenizer(tuple(text + special + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]))


def test_tokenizer_layouts_and_decode():
    multi, en = _fake_vocab(True), _fake_vocab(False)
    assert multi.is_multilingual and not en.is_multilingual
    assert multi.sot_sequence("de") == [multi.sot, multi.sot + 2, multi.transcribe]
    assert en.sot_sequence(timestamps=False) == [en.sot, en.no_timestamps]
    assert en.timestamp_begin == en.no_timestamps + 1 and en.no_speech == en.ids["<|nocaptions|>"]
    assert multi.decode([3, multi.timestamp_begin, 0, multi.eot, 4]) == " hia!"
    with pytest.raises(ValueError, match="language='xx'"):
        multi.sot_sequence("xx")


@pytest.fixture(scope="module")
def bundled():
    try:
        parts, data = bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    return data


def test_bundled_tokenizer_matches_ct2_suppress_list(bundled):
    tok = load_tokenizer(bundled / "tokenizer.json", 51865)
    cfg = json.loads((bundled / "config.json").read_text())
    assert tok.suppress_tokens() == cfg["suppress_ids"]
    assert tok.encode_pretoken(" ") + [tok.eot] == cfg["suppress_ids_begin"]
    assert tok.tokens[50364] == "<|0.00|>" and tok.tokens[-1] == "<|30.00|>"
    vocab_txt = load_tokenizer(bundled / "vocabulary.txt")
    assert vocab_txt.tokens == tok.tokens
    assert tok.decode(tok.encode_pretoken(" Größe") + tok.encode_pretoken("!")) == " Größe!"


def test_timestamp_rules():
    tok = _fake_vocab(True)
    ts0, v = tok.timestamp_begin, len(tok.tokens)
    rules = Rules(tok, DecodeOptions(), suppress=[4], n_vocab=v, device="cpu")
    state = RuleState.new(2, "cpu")
    first = rules.apply(torch.zeros(2, v), state)
    allowed = torch.isfinite(first[0]).nonzero()[:, 0].tolist()
    assert allowed == list(range(ts0, ts0 + 51))  # only <|0.00|> .. <|1.00|> may start
    rules.update(torch.tensor([ts0 + 5, ts0 + 5]), state)
    logits = torch.zeros(2, v)
    logits[:, ts0 + 7] = 5.0
    after_open = rules.apply(logits, state)
    assert torch.isinf(after_open[:, ts0:]).all() and torch.isfinite(after_open[:, 3]).all()
    rules.update(torch.tensor([3, 3]), state)
    rules.update(torch.tensor([ts0 + 9, 3]), state)  # row 0 closes a segment, row 1 continues text
    logits = torch.zeros(2, v)
    logits[:, tok.eot] = 10.0  # beats the ~1500 timestamps' total (log 1500 = 7.3) so text stays
    out = rules.apply(logits, state)
    assert torch.isinf(out[0, :tok.eot]).all() and torch.isfinite(out[0, tok.eot])
    assert torch.isinf(out[0, ts0:ts0 + 9]).all() and torch.isfinite(out[0, ts0 + 9:]).all()
    assert torch.isinf(out[1, ts0:ts0 + 6]).all() and torch.isinf(out[:, 4]).all()
    assert torch.isfinite(out[1, :4]).all() and torch.isfinite(out[1, ts0 + 6:]).all()
    logits = torch.zeros(2, v)  # flat text vs 1500 timestamps: the timestamp mass wins
    assert torch.isinf(rules.apply(logits, state)[1, :ts0]).all()


def test_repetition_helpers():
    assert trim_repetition([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6]
    assert trim_repetition([9, 1, 2, 1, 2, 1, 2, 1, 2]) == [9, 1, 2]
    assert compression_ratio("the cat " * 50) > 2.4 > compression_ratio("And so my fellow Americans, ask not.")



def test_compaction_swaps_the_fewest_rows():
    """Live rows past the front swap with finished rows inside it, nothing else moves; the host
    maps keep following their windows, finished windows' audio stays in some row."""
    progress = Progress(6)
    progress.rows = [0, -1, 2, -1, 4, 5]  # windows 1 and 3 finished
    perm = progress.keep([0, 2, 4, 5], 4)
    assert perm == [0, 4, 2, 5, 1, 3]  # two swaps: 4 rows copied, not the 5 from row 1 on
    assert progress.rows == [0, 4, 2, 5] and progress.order == [0, 4, 2, 5, 1, 3]
    perm = progress.keep([0, 1, 2], 3)  # window 5 (row 3) finished: rows 0..2 stay put
    assert perm == list(range(6)) and progress.rows == [0, 4, 2]
    perm = progress.keep([2], 2)  # one live row at the back of a 2-wide bucket
    assert perm[0] == 2 and sorted(perm) == list(range(6)) and progress.rows == [2, -1]
    assert sorted(progress.order) == list(range(6))


CLIPS = [("jfk/jfk.flac", "And so my fellow Americans, ask not what your country can do for you, "
          "ask what you can do for your country."),
         ("librispeech_test_other/1688/1688-142285-0002.flac", "YOU DON'T MEAN THAT YOU THOUGHT ME SO SILLY"),
         ("librispeech_test_other/1688/1688-142285-0004.flac",
          "HIS STATEMENT OF HAVING BEEN A SHOP BOY WAS THE THING I LIKED BEST OF ALL")]


@pytest.mark.skipif(not SPEECH.is_dir(), reason=f"shared speech data not found at {SPEECH}")
def test_bundled_base_transcribes_real_speech(bundled):
    from engines.whisper_engine import WhisperEngine, pad_window
    from transcribe.audio import load_audio
    from transcribe.bench import wer

    engine = WhisperEngine.from_bundled(batch_size=4, dtype="float32")
    audio = [load_audio(SPEECH / path, 16000) for path, _ in CLIPS]
    out = engine.transcribe_windows(audio)
    texts = [t for t, _ in out[:3]]
    assert wer([ref for _, ref in CLIPS], texts) <= 0.10, texts
    for (text, segments), wav in zip(out, audio):
        assert segments and all(0 <= a < b <= len(wav) / 16000 + 1e-6 for a, b, _ in segments)
        assert [a for a, _, _ in segments] == sorted(a for a, _, _ in segments)
        assert "<|" not in text and " ".join(s for _, _, s in segments) == text
    # Digital silence: base says "you" with no_speech_prob 0.93 but avg_logprob -0.82, which
    # OpenAI's rule keeps (logprob above -1); without the logprob guard it must be dropped.
    strict = GreedyDecoder(engine.decoder.model, engine.decoder.tok, DecodeOptions(logprob_threshold=None),
                           engine.decoder.suppress)
    silent = strict.decode(log_mel_spectrogram(torch.zeros(1, 16000)))[0]
    assert silent.no_speech_prob > 0.6 and silent.text == "" and silent.segments == ()
    # The pipeline's path skips silent pieces before decoding, whatever the rule: digital
    # silence, and 16-bit dither (one LSB of noise, where base also says "you"); the speech
    # beside them comes out as decoded alone, and quiet noise (-60 dB) is still decoded.
    dither = np.random.default_rng(0).standard_normal(10 * 16000).astype(np.float32) / 32768
    zeros, lsb, speech = (torch.from_numpy(engine.frontend(a))
                          for a in (np.zeros(10 * 16000, np.float32), dither, audio[0]))
    assert engine.decoder.decode(pad_window(lsb)[None])[0].text.strip()  # what the skip avoids
    alone = engine.transcribe_features([speech])[0]
    empty, spoken, empty2, empty3 = engine.transcribe_features([zeros, speech, zeros[:, :50], lsb])
    assert empty.text == empty2.text == empty3.text == "" and not empty.words and not empty3.tokens
    assert spoken.text == alone.text == out[0][0] and spoken.tokens == alone.tokens
    decoded = []
    real_decode = engine.decoder.decode
    engine.decoder.decode = lambda mel, *a, **k: (decoded.append(mel.shape[0]), real_decode(mel, *a, **k))[1]
    try:
        engine.transcribe_features([torch.from_numpy(engine.frontend(dither * 32.768))])  # -60 dB noise
    finally:
        engine.decoder.decode = real_decode
    assert decoded == [1]


def test_a_window_whose_text_stops_short_is_decoded_on_from_where_it_stopped():
    """Whisper base ends the first 29.9 s of test-other (utterances back to back) at 27.96 s,
    leaving out the last sentence; OpenAI's transcribe would seek there and decode on, and so
    does the engine now (`_decode_tails`), the same with word times or without."""
    import soundfile as sf

    from conftest import SPEECH, bundled_whisper_fp32

    engine = bundled_whisper_fp32(4)
    folder = SPEECH / "librispeech_test_other"
    rows = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()[:3]]
    audio = np.concatenate([sf.read(folder / r["audio_filepath"], dtype="float32")[0] for r in rows])[:int(29.9 * 16000)]
    features = [torch.from_numpy(engine.frontend(audio))]
    texts = {}
    for words in (False, True):
        engine.word_timestamps = words
        texts[words] = engine.transcribe_features(features)[0].text
        assert engine.transcribe_features(features, continuations=0)[0].text.lower().rstrip(".").endswith("shopboy")
    assert texts[False] == texts[True] and texts[True].lower().endswith("you thought me so silly.")


def _misc(utterance: str) -> np.ndarray:
    """A LibriSpeech utterance of the shared librispeech_misc folder, as float32 at 16 kHz."""
    import soundfile as sf

    from conftest import SPEECH

    return sf.read(SPEECH / "librispeech_misc" / f"{utterance}.flac", dtype="float32")[0]


def test_a_last_sentence_after_a_pause_is_decoded_from_a_short_tail():
    """22.1 s of speech, 3 s of pause, then "He could wait no longer." (2.1 s): base closes its
    last segment at 25.72 s, over the pause and into that sentence, and the 1.47 s left were
    under the 1.5 s a tail had to be: the sentence was lost. Tails from 1 s are decoded now,
    those under 1.5 s kept when clearly speech (no-speech 0.02 here)."""
    from conftest import bundled_whisper_fp32

    engine = bundled_whisper_fp32(4)
    audio = np.concatenate([_misc("2412-153948-0000"), _misc("1089-134686-0000"),
                            np.zeros(3 * 16000, np.float32), _misc("1089-134691-0000")])
    text = engine.transcribe_features([torch.from_numpy(engine.frontend(audio))])[0].text
    assert text.endswith("sauce. He could wait no longer."), text


def test_a_sentence_after_seconds_of_digital_silence_is_transcribed_at_its_time():
    """5 s of exact zeros, a sentence, 4 s of zeros, a sentence: base began its text with the
    second sentence and the first was lost. The leading zeros but 1 s are cut before decoding
    and the times moved back; a noise floor, or 1 s of zeros, is left as it is."""
    from conftest import bundled_whisper_fp32
    from engines.whisper_engine import _digital_silence_lead

    engine = bundled_whisper_fp32(4)
    zeros = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    first = _misc("1089-134686-0001")
    audio = np.concatenate([zeros(5), first, zeros(4), _misc("61-70968-0000")])
    engine.word_timestamps = True
    out = engine.transcribe_features([torch.from_numpy(engine.frontend(audio))])[0]
    assert out.text.startswith("Stuff it into you, his belly counsel"), out.text
    assert 5.0 <= out.words[0].start < 5.5 and out.segments[0].start >= 5.0, out.words[:2]
    feats = lambda a: torch.from_numpy(engine.frontend(a))  # noqa: E731
    assert _digital_silence_lead(feats(audio)) == 400  # 5 s of frames at the floor, 1 s kept
    noise = (np.random.default_rng(0).standard_normal(5 * 16000) * 0.003).astype(np.float32)  # -50 dBFS
    assert _digital_silence_lead(feats(np.concatenate([noise, first]))) == 0
    assert _digital_silence_lead(feats(np.concatenate([zeros(0.9), first]))) == 0
    assert _digital_silence_lead(feats(zeros(5))) == 0  # all silence: left to the silence check
    # The kept second of zeros is a pause before the first word: "And" of JFK, stretched back
    # over it, started 0.94 s before the sound.
    import soundfile as sf

    from transcribe.resample import resample

    jfk, rate = sf.read(SPEECH / "jfk" / "jfk.flac", dtype="float32")
    jfk = resample(jfk.mean(1) if jfk.ndim > 1 else jfk, rate, 16000)
    out = engine.transcribe_features([feats(np.concatenate([zeros(5), jfk]))])[0]
    assert out.words[0].word == "And" and 4.7 <= out.words[0].start < 5.3, out.words[:2]
    assert out.segments[0].start == out.words[0].start


def test_short_tails_are_kept_only_when_clearly_speech():
    """A tail of 1-1.5 s stands when its no-speech probability is at most 0.2 and its mean
    log-probability at least -1; a longer one when no-speech is at most 0.5, and, if only the
    temperature fallback's sample passed, at most 0.2. Constructed decoder output: "liner."
    after "aligner" (0.20 at -1.20) and "Thank you." (0.74) are dropped, and so is the 2.6 s
    tail of mfa_erpause (bf16 encoder), "Thanks for watching. I'll see you all in the next
    video. Bye." sampled at temperature 0.4 with no-speech 0.476 (16 errors for 3 words)."""
    from types import SimpleNamespace

    from engines.stage_times import StageTimes
    from engines.whisper_decoding import WindowResult
    from engines.whisper_engine import WhisperEngine

    tok = SimpleNamespace(eot=50257, timestamp_begin=50364)
    ts = lambda s: tok.timestamp_begin + round(s / 0.02)  # noqa: E731

    def window(text, end, logprob=-0.3, no_speech=0.02, temperature=0.0):
        return WindowResult(text, ((0.0, end, text),), (ts(0.0), 100, ts(end)), logprob, no_speech, 1.0, False,
                            temperature=temperature)

    cases = [((1.3, -0.35, 0.02, 0.0), True), ((1.3, -1.2, 0.196, 0.0), False), ((1.3, -0.8, 0.74, 0.0), False),
             ((1.3, -0.8, 0.25, 0.0), False), ((1.8, -0.8, 0.41, 0.0), True), ((1.8, -0.8, 0.55, 0.0), False),
             ((2.6, -0.82, 0.476, 0.4), False), ((2.6, -0.82, 0.15, 0.4), True)]
    for (tail, logprob, no_speech, temperature), kept in cases:
        decoded = iter([window("Main.", 10.0 - tail), window("Tail.", tail - 0.1, logprob, no_speech, temperature)])
        decoder = SimpleNamespace(device="cpu", model=SimpleNamespace(dims=SimpleNamespace(n_mels=80)), tok=tok,
                                  stage_seconds=StageTimes("cpu"),
                                  decode=lambda mel, frames, words, languages, after_pause=None, second_look=True: [next(decoded) for _ in frames])
        out = WhisperEngine(decoder).transcribe_features([torch.zeros(80, 1000)])[0]  # 10 s of sound
        assert out.text == ("Main. Tail." if kept else "Main."), (tail, logprob, no_speech, temperature)


def test_a_piece_whose_words_moved_past_its_tail_ends_where_the_tail_begins():
    """25 s of a tune, then JFK, in Romanian: base wrote <|0.00|> Muzica<|2.00|> for the tune's
    first piece (16.8 s), and the word alignment put "Muzica" at 15.36-16.76 s; the tail, decoded
    from the last timestamp (2 s, so the text does not depend on word times), came after it in
    the file at 2.0-9.16 s. The piece's times now end where its tail begins, as a piece's end
    where the next piece begins (`stitching.stitch`). Constructed decoder output, no model."""
    from types import SimpleNamespace

    from engines.stage_times import StageTimes
    from engines.whisper_decoding import WindowResult
    from engines.whisper_engine import WhisperEngine
    from transcribe.writers import write_srt

    tok = SimpleNamespace(eot=50257, timestamp_begin=50364)
    ts = lambda s: tok.timestamp_begin + round(s / 0.02)  # noqa: E731

    def window(tokens, words, no_speech=0.3):
        text = " ".join(w for _, _, w, _ in words)
        return WindowResult(text, ((words[0][0], words[-1][1], text),), tuple(tokens), -0.5, no_speech, 1.0,
                            False, words=tuple(words))

    decoded = iter([window([ts(0.0), 100, ts(2.0)], [(15.36, 16.76, "Muzica", 0.4)]),  # the piece, then its tail
                    window([ts(0.0), 101, 102, ts(14.0)], [(0.0, 0.38, "Bă,", 0.3), (0.38, 7.16, "bă.", 0.3)])])
    decoder = SimpleNamespace(device="cpu", model=SimpleNamespace(dims=SimpleNamespace(n_mels=80)), tok=tok,
                              stage_seconds=StageTimes("cpu"),
                              decode=lambda mel, frames, words, languages, after_pause=None, second_look=True: [next(decoded) for _ in frames])
    engine = WhisperEngine(decoder)
    out = engine.transcribe_features([torch.zeros(80, 1679)])[0]  # 16.77 s of sound (log-mel 0)
    assert out.text == "Muzica Bă, bă."  # the tail, from 2 s, is appended
    assert [(s.start, s.end) for s in out.segments] == [(2.0, 2.0), (2.0, 9.16)]
    assert [(w.word, w.start, w.end) for w in out.words] == [("Muzica", 2.0, 2.0), ("Bă,", 2.0, 2.38),
                                                             ("bă.", 2.38, 9.16)]
    # Its subtitle, of no length there, is shown in the second before (`subtitles._give_time`).
    assert write_srt(out).startswith("1\n00:00:01,000 --> 00:00:02,000\nMuzica\n\n2\n00:00:02,000 --> ")


def test_audio_under_one_hop_is_empty_text_as_openai_gives():
    """Files under 400 samples are transcribed now (NeMo does); openai-whisper decodes nothing
    under one hop (160 samples: no content frame for its seek loop) and faster-whisper gives
    empty text, where whisper-base decoded 100 samples of speech to "you"."""
    import soundfile as sf

    from conftest import bundled_whisper_fp32

    engine = bundled_whisper_fp32(4)
    speech, _ = sf.read(SPEECH / "librispeech_test_other" / "1688" / "1688-142285-0005.flac", dtype="float32")
    out = engine.transcribe_features([torch.from_numpy(engine.frontend(speech[:n])) for n in (1, 100, 159)])
    assert [r.text for r in out] == ["", "", ""]


def test_float_samples_far_past_full_scale_are_heard_at_full_scale():
    """int16 values saved as a float WAV (+-32768): whisper-base gave "" for jfk with status ok,
    where faster-whisper still got most of it. A piece past full scale is brought to it; one
    within it is left as it was (features bit for bit)."""
    from conftest import bundled_whisper_fp32
    from transcribe.audio import load_audio

    engine = bundled_whisper_fp32(4)
    speech = load_audio(SPEECH / "jfk" / "jfk.flac", 16000)
    peak = np.float32(np.abs(speech).max())
    assert np.array_equal(engine.frontend(speech * np.float32(0.5)), engine.frontend(speech * np.float32(0.5)))
    full = engine.frontend(speech / peak)
    for gain in (1.5, 32768.0, 1e4):  # (float32 rounding of the scaled samples: ~1e-5 in the log-mel)
        assert np.abs(engine.frontend(speech * np.float32(gain)) - full).max() < 1e-4, gain
    clean, loud = engine.transcribe_features([torch.from_numpy(engine.frontend(a)) for a in (speech, speech * 32768)])
    assert "ask not what your country can do for you" in clean.text
    assert loud.text == clean.text


def _arpeggio(seconds: float) -> np.ndarray:
    """Half-second sine notes with two harmonics, up and down a major chord: music, no speech."""
    t = np.arange(8000) / 16000
    notes = [sum(np.sin(2 * np.pi * 220 * 2 ** ([0, 4, 7, 12, 7, 4][k % 6] / 12) * h * t) / h for h in (1, 2, 3))
             * np.exp(-3 * t) for k in range(int(seconds * 2))]
    return (np.round(np.concatenate(notes) * 0.15 * 32767) / 32768).astype(np.float32)  # as a PCM_16 file holds it


def test_music_without_speech_is_no_text_as_with_openais_padding():
    """10 and 25 s of tones: whisper-base said "Thank you." (greedy, no-speech 0.71 but
    log-probability -0.97: OpenAI's rule keeps it) with our silence-floor padding; with OpenAI's
    and faster-whisper's zero padding it is silent (0.74, -1.26), and faster-whisper gives "".
    Windows one silence signal points at are decoded again with that padding and follow it;
    speech is not (jfk keeps its text)."""
    from conftest import bundled_whisper_fp32
    from engines.whisper_engine import audio_frames, pad_window
    from transcribe.audio import load_audio

    engine = bundled_whisper_fp32(4)
    dec = engine.decoder
    for seconds in (10, 25):
        music = _arpeggio(seconds)
        mel = pad_window(torch.from_numpy(engine.frontend(music)))[None]
        frames = [audio_frames(len(music))]
        before = dec.decode_audio(dec.model.encoder(mel), frames)[0]  # no mel: no second look
        assert before.text.strip(), seconds  # the hallucination this guards against
        assert dec.decode(mel, frames)[0].text == "", seconds
        (r,) = engine.transcribe_features([torch.from_numpy(engine.frontend(music))])
        assert r.text == "" and not r.words, seconds
    speech = load_audio(SPEECH / "jfk" / "jfk.flac", 16000)
    (r,) = engine.transcribe_features([torch.from_numpy(engine.frontend(speech))])
    assert "ask not what your country can do for you" in r.text
