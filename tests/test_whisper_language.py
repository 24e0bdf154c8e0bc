"""Whisper's language: fixed (`--language en`, the default) or detected per window (`auto`).

Detection is OpenAI's `detect_language` (the logits after <|startoftranscript|> alone, the
likeliest language token), folded into the prompt's first forward pass; each window is then
decoded in its own language, in one batch with the others.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import NEMO_REF, SPEECH, bundled_whisper_fp32
from engines.decode_modes import DecodeMode
from engines.whisper_decoding import DecodeOptions
from engines.whisper_engine import language_options
from engines.whisper_graph import WhisperGraphs
from engines.whisper_languages import LANGUAGES, language_code
from transcribe.results import Result, Word
from transcribe.stitching import main_language, stitch
from transcribe.writers import write_json
from whisper_random import random_audio, random_decoder, random_vocab, random_whisper

GREEDY = (0.0,)
DETECT = DecodeOptions(language=None, max_length=60, temperatures=GREEDY)


@pytest.fixture(scope="module")
def model():
    return random_whisper()


@pytest.fixture(scope="module")
def audio(model):
    return random_audio(model, 8, seed=2)  # windows detected as en and as de (checked below)


def openai_detect_language(model, audio: torch.Tensor) -> list[str]:
    """OpenAI's `detect_language`, written out: <|startoftranscript|> alone on a fresh cache,
    every non-language logit masked, argmax."""
    tok = random_vocab()
    dec = model.decoder
    logits = dec(torch.full((audio.shape[0], 1), tok.sot), dec.new_cache(audio, 1))[:, 0]
    mask = torch.ones(logits.shape[-1], dtype=torch.bool)
    mask[list(tok.languages.values())] = False
    logits[:, mask] = -torch.inf
    code = {i: c for c, i in tok.languages.items()}
    return [code[i] for i in logits.argmax(-1).tolist()]


def openai_language_probability(model, audio: torch.Tensor) -> list[float]:
    """OpenAI's `detect_language` probabilities: the softmax over the language tokens; the top one."""
    tok = random_vocab()
    dec = model.decoder
    logits = dec(torch.full((audio.shape[0], 1), tok.sot), dec.new_cache(audio, 1))[:, 0]
    return logits[:, list(tok.languages.values())].float().softmax(-1).max(-1).values.tolist()


@torch.inference_mode()
def test_detected_language_is_openais_and_each_window_decodes_in_its_own(model, audio):
    detected = random_decoder(model, DETECT).decode_audio(audio)
    languages = [r.language for r in detected]
    assert languages == openai_detect_language(model, audio)
    assert [r.language_probability for r in detected] == pytest.approx(openai_language_probability(model, audio),
                                                                       abs=1e-5)
    assert set(languages) == {"en", "de"}  # a mixed batch: rows get different prompts
    for code in set(languages):
        fixed = random_decoder(model, DecodeOptions(language=code, max_length=60, temperatures=GREEDY))
        forced = fixed.decode_audio(audio)
        for w, r in enumerate(detected):
            assert forced[w].language == code
            if r.language == code:  # the same tokens as decoding in that language from the start
                assert forced[w].tokens == r.tokens and forced[w].avg_logprob == pytest.approx(r.avg_logprob, abs=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("mode", [DecodeMode.UNROLLED, DecodeMode.FULL_GRAPH])
def test_static_path_detects_as_eager_does(model, audio, mode):
    eager = random_decoder(model, DETECT).decode_audio(audio)
    dec = random_decoder(model, DETECT)
    dec.graphs = WhisperGraphs(dec, mode, capture=False)  # the graph modes' steps, uncaptured
    static = dec.decode_audio(audio)
    assert [r.language for r in static] == [r.language for r in eager]
    assert [r.tokens for r in static] == [r.tokens for r in eager]


@torch.inference_mode()
@pytest.mark.parametrize("mode", [DecodeMode.EAGER, DecodeMode.UNROLLED])
def test_given_languages_fix_their_rows_and_the_rest_detect(model, audio, mode):
    """A file's later pieces come with its language (None: detect): those rows decode in it,
    the same tokens as a decoder fixed to it; the others detect, as with no languages given."""
    detected = random_decoder(model, DETECT).decode_audio(audio)
    flip = {"en": "de", "de": "en"}
    given = [flip[r.language] if w % 2 else None for w, r in enumerate(detected)]
    dec = random_decoder(model, DETECT)
    if mode is not DecodeMode.EAGER:
        dec.graphs = WhisperGraphs(dec, mode, capture=False)  # the graph modes' steps, uncaptured
    mixed = dec.decode_audio(audio, languages=given)
    assert [r.language for r in mixed] == [g or r.language for g, r in zip(given, detected)]
    # a probability where the row detected, none where its language was given
    assert [r.language_probability for r in mixed] == [None if g else r.language_probability
                                                       for g, r in zip(given, detected)]
    forced = {code: random_decoder(model, DecodeOptions(language=code, max_length=60, temperatures=GREEDY)
                                   ).decode_audio(audio) for code in flip}
    for w, r in enumerate(mixed):
        assert r.tokens == (detected[w] if given[w] is None else forced[given[w]][w]).tokens, w


@torch.inference_mode()
def test_a_silent_piece_names_the_language_a_decoded_one_would(model):
    """A silent piece is not decoded (whisper_engine.SILENCE_LOG_MEL), yet its result names the
    language a decoded piece's does: the one given (--language de) or its file's; none where
    it was to be detected. A silent file's JSON had no `language` where a noisy one's had."""
    import numpy as np

    from engines.whisper_engine import WhisperEngine, WhisperFrontend

    frontend = WhisperFrontend(model.dims.n_mels)
    silence = torch.from_numpy(frontend(np.zeros(16000, np.float32)))
    noise = torch.from_numpy(frontend(np.random.default_rng(0).standard_normal(16000).astype(np.float32)))
    fixed = WhisperEngine(random_decoder(model, DecodeOptions(language="de", max_length=60, temperatures=GREEDY)),
                          word_timestamps=False)
    quiet, decoded = fixed.transcribe_features([silence, noise], continuations=0)
    assert quiet.text == "" and quiet.language == decoded.language == "de"
    assert "language" in json.loads(write_json(quiet))
    auto = WhisperEngine(random_decoder(model, DETECT), word_timestamps=False)
    assert [r.language for r in auto.transcribe_features([silence, silence], ["en", None])] == ["en", None]


@torch.inference_mode()
def test_fallback_samples_keep_the_windows_language(model, audio, monkeypatch):
    """Every window fails (logprob_threshold 0): each temperature samples it best_of times in
    the language the greedy pass detected, and the winner carries it."""
    greedy = random_decoder(model, DETECT).decode_audio(audio)
    opts = DecodeOptions(language=None, max_length=60, logprob_threshold=0.0, temperatures=(0.0, 0.5), best_of=2)
    dec = random_decoder(model, opts)
    asked, token_loop = [], dec.token_loop
    monkeypatch.setattr(dec, "token_loop", lambda *a, **k: (asked.append(a[3] if len(a) > 3 else None),
                                                            token_loop(*a, **k))[1])
    results = dec.decode_audio(audio)
    # The greedy pass detects (None); the fallback samples 4 windows per pass, 2 rows each.
    samples = [r.language for r in greedy for _ in range(2)]
    assert asked == [None, samples[:8], samples[8:]]
    assert [r.language for r in results] == [r.language for r in greedy]
    assert [r.language_probability for r in results] == [r.language_probability for r in greedy]
    assert any(r.temperature > 0 for r in results)


def test_real_speech_detected_per_window_with_words():
    """whisper-base hears test-other 2414-128291-0008 ("THOU ALSO THOU ALSO") as Russian: auto
    transcribes it in Cyrillic, with words aligned in its language, while the English files
    beside it in the batch stay English; `en` forces English."""
    from engines.whisper_engine import language_options
    from transcribe.audio import load_audio

    engine = bundled_whisper_fp32(4)
    files = ["jfk/jfk.flac", "librispeech_test_other/2414/2414-128291-0008.flac",
             "librispeech_test_other/1688/1688-142285-0002.flac"]
    wavs = [load_audio(SPEECH / f, 16000) for f in files]
    fixed = engine.decoder
    engine.decoder = type(fixed)(fixed.model, fixed.tok, language_options("auto"), fixed.suppress)
    auto = engine.decode_windows(wavs, words=True)
    assert [r.language for r in auto] == ["en", "ru", "en"]
    assert any("\u0400" <= ch <= "\u04ff" for ch in auto[1].text)
    assert auto[1].words and "".join(w[2] for w in auto[1].words) == auto[1].text.replace(" ", "")
    (alone,) = engine.decode_windows(wavs[1:2], words=True)
    assert (alone.text, alone.words) == (auto[1].text, auto[1].words)
    engine.decoder = fixed
    english = engine.decode_windows(wavs[1:2])[0]
    assert english.language == "en" and english.text.isascii()
    assert [r.text for r in engine.decode_windows(wavs[0::2])] == [auto[0].text, auto[2].text]


def test_language_options_and_parakeet_refuses_a_language():
    from engines.loader import load_engine
    from engines.whisper_engine import language_options

    assert language_options("auto").language is None and language_options("de").language == "de"
    with pytest.raises(ValueError, match="--language is for Whisper models"):
        load_engine(str(NEMO_REF / "tdt_tiny" / "model.nemo"), "cpu", language="de")


def test_json_carries_the_language_and_a_stitched_file_takes_its_main_one():
    short, long = Result("Ja.", language="de"), Result("A longer English piece.", [Word("A", 0.0, 0.1)], language="en")
    assert main_language([short, long]) == "en" and main_language([Result("x")]) is None
    assert main_language([Result("ab", language="de"), Result("cd", language="en")]) == "de"  # a tie: the first
    joined = stitch([short, long], [0.0, 20.0])
    assert joined.language == "en" and joined.words[0].start == 20.0
    assert '"language": "en"' in write_json(joined)
    assert "language" not in write_json(Result("parakeet text"))
    # The detection's probability: the surest piece in the file's language, not the first
    # piece's (a tune detected as Romanian at 0.64 before English speech at 0.97).
    tune = Result("Muzica", language="ro", language_probability=0.64)
    speech = [Result("Ask not what your country can do for you,", language="en", language_probability=0.97),
              Result("ask what you can do for your country.", language="en")]  # decoded in it, not asked
    joined = stitch([tune, *speech], [0.0, 25.0, 30.0])
    assert joined.language == "en" and joined.language_probability == 0.97
    assert json.loads(write_json(joined))["language_probability"] == 0.97
    assert "language_probability" not in write_json(Result("Given.", language="en"))


def test_cli_language_auto_writes_each_files_language(tmp_path):
    from test_cli import run_cli

    bundled_whisper_fp32(1)  # skips without the bundled model or the shared speech
    files = [SPEECH / "jfk" / "jfk.flac", SPEECH / "librispeech_test_other/2414/2414-128291-0008.flac"]
    proc = run_cli(*map(str, files), "--out", str(tmp_path), "--model", "whisper-base", "--language", "auto",
                   "--format", "json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "language auto" in proc.stderr
    assert json.loads((tmp_path / "jfk.json").read_text())["language"] == "en"
    assert json.loads((tmp_path / "2414-128291-0008.json").read_text())["language"] == "ru"
    bad = run_cli(str(files[0]), "--out", str(tmp_path / "x"), "--model", "whisper-base", "--language", "xx")
    assert bad.returncode == 2 and "language='xx' is not in this vocabulary" in bad.stderr  # a usage error
    # Translating English speech into English keeps it English. Into the same folder: the
    # language and task are part of what is done, so the file is redone, not skipped as done
    # by the auto-language run, and a second identical run skips it.
    translate = (str(files[0]), "--out", str(tmp_path), "--model", "whisper-base", "--task", "translate",
                 "--format", "json", "--no-progress")
    translated = run_cli(*translate)
    assert translated.returncode == 0 and "language en, translate" in translated.stderr
    assert "0 already done" in translated.stderr
    assert "ask not what your country can do for you" in json.loads((tmp_path / "jfk.json").read_text())["text"].lower()
    rows = {r["audio_filepath"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows[str(files[0])]["settings"] == {"language": "en", "task": "translate"}
    assert rows[str(files[1])]["settings"] == {"language": "auto", "task": "transcribe"}
    # A language's name is its code: "English" asks for what the default en did.
    assert "1 already done" in run_cli(*translate, "--language", "English").stderr


def test_cli_language_auto_detects_once_per_file(tmp_path):
    """A file cut into pieces is decoded in its first piece's language, as OpenAI detects once
    per file: JFK, then (after a pause the cutter splits at) test-other 2414-128291-0008, which
    whisper-base alone hears as Arabic or Russian. Detected per piece, the file's second half
    came out in Arabic script."""
    import numpy as np
    import soundfile as sf

    from test_cli import run_cli
    from transcribe.resample import resample

    bundled_whisper_fp32(1)  # skips without the bundled model or the shared speech
    jfk, rate = sf.read(SPEECH / "jfk" / "jfk.flac", dtype="float32", always_2d=True)
    other, _ = sf.read(SPEECH / "librispeech_test_other/2414/2414-128291-0008.flac", dtype="float32")
    pause = np.zeros(16000 * 2, np.float32)
    joined = np.concatenate([resample(jfk.mean(1), rate, 16000), pause, pause, other] + [pause] * 7)
    sf.write(tmp_path / "joined.wav", joined, 16000)  # 32 s: cut into pieces at the first pause
    proc = run_cli(str(tmp_path / "joined.wav"), "--out", str(tmp_path / "out"), "--model", "whisper-base",
                   "--language", "auto", "--format", "json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "out" / "joined.json").read_text())
    assert out["language"] == "en" and out["text"].startswith("And so my fellow Americans")
    late = [s for s in out["segments"] if s["start"] > 13.0]
    assert late and all(s["text"].isascii() for s in late), late  # the second piece is in English too


def test_cli_language_auto_is_not_decided_by_a_tune_before_the_speech(tmp_path):
    """25 s of a synthetic tune (chords and drum hits), then JFK. whisper-base takes the tune
    for Romanian at 0.64 and writes text for it; with that piece deciding, the whole file came
    out in Romanian and JFK's words were lost. The tune's piece is unsure (below
    file_language.SURE), so the next piece decides (English), and the tune's is decoded again."""
    import numpy as np
    import soundfile as sf

    from test_cli import run_cli
    from transcribe.resample import resample

    bundled_whisper_fp32(1)  # skips without the bundled model or the shared speech
    rate = 16000
    rng, t = np.random.default_rng(1), np.arange(25 * rate) / rate
    tune = np.zeros_like(t)
    for beat in range(50):
        s, e = beat * rate // 2, (beat + 1) * rate // 2
        for f in rng.choice([220, 247, 262, 294, 330, 349, 392, 440], 3):
            tune[s:e] += 0.1 * np.sin(2 * np.pi * f * t[s:e]) * np.exp(-3 * (t[s:e] - t[s]))
        tune[s:s + 400] += 0.2 * rng.standard_normal(400)
    jfk, jfk_rate = sf.read(SPEECH / "jfk" / "jfk.flac", dtype="float32", always_2d=True)
    sf.write(tmp_path / "tune_jfk.wav", np.concatenate([tune.astype(np.float32), np.zeros(rate // 2, np.float32),
                                                        resample(jfk.mean(1), jfk_rate, rate)]), rate)
    proc = run_cli(str(tmp_path / "tune_jfk.wav"), "--out", str(tmp_path / "out"), "--model", "whisper-base",
                   "--language", "auto", "--format", "json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "out" / "tune_jfk.json").read_text())
    assert out["language"] == "en" and "ask not what your country can do for you" in out["text"], out["text"]
    assert out["language_probability"] >= 0.8  # the sure piece that decided it, not the tune's


def test_language_names_read_as_codes():
    """--language takes OpenAI's codes and names (and its aliases) in any case; other two or
    three letters pass on to the vocabulary; anything else names the nearest spellings."""
    assert [language_code(v) for v in ("en", "EN", "German", "haitian  creole", "Mandarin", "lao", "yue",
                                       "Auto", "xx")] == ["en", "en", "de", "ht", "zh", "lo", "yue", "auto", "xx"]
    assert len(LANGUAGES) == 100 and all(language_code(name) == code for code, name in LANGUAGES.items())
    with pytest.raises(ValueError, match=r"did you mean portuguese\?"):
        language_code("portugese")
    with pytest.raises(ValueError, match="not a Whisper language code or name; expected"):
        language_code("klingon")
    assert language_options("Spanish").language == "es" and language_options("auto").language is None


@torch.inference_mode()
def test_translate_task_takes_the_prompts_task_slot(model, audio):
    from engines.loader import load_engine
    from engines.whisper_tokenizer import WhisperTokenizer

    tok = random_vocab()
    de = tok.language_token("de")
    assert tok.sot_sequence("de", False, "translate") == [tok.sot, de, tok.translate, tok.no_timestamps]
    with pytest.raises(ValueError, match="task must be"):
        tok.sot_sequence("de", task="summarise")
    english_only = WhisperTokenizer(tuple(t for t in tok.tokens if t not in ("<|en|>", "<|de|>")))
    with pytest.raises(ValueError, match="English-only model cannot translate"):
        english_only.sot_sequence(None, task="translate")
    translating = random_decoder(model, DecodeOptions(language=None, task="translate", max_length=60,
                                                      temperatures=GREEDY))
    assert translating.prompt[2] == tok.translate and translating.aligner.prompt[2] == tok.translate
    transcribed = random_decoder(model, DETECT).decode_audio(audio)
    translated = translating.decode_audio(audio, words=True)
    assert [r.language for r in translated] == [r.language for r in transcribed]  # the spoken language
    assert [r.tokens for r in translated] != [r.tokens for r in transcribed]
    with pytest.raises(ValueError, match="--task translate is for Whisper models"):
        load_engine(str(NEMO_REF / "tdt_tiny" / "model.nemo"), "cpu", task="translate")
