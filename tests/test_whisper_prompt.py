"""Whisper's initial prompt (`--prompt`): the tokenizer's encoding equals tiktoken's, the prompt's
tokens equal OpenAI's, and decoding after it equals openai-whisper's own on real speech
(tests/data/whisper_prompt/reference.json, bench/make_whisper_prompt_references.py); the
prompt reaches the engine's settings (a rerun with another prompt redoes the file). A Parakeet
model refuses it as a usage error (test_cli.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import bundled_whisper_fp32
from engines.whisper_decoding import GreedyDecoder, previous_text
from engines.whisper_weights import WhisperWeightsError, bundled_base_dir
from test_whisper_words import audio_of, openai_window_mel

REFERENCE = json.loads((Path(__file__).parent / "data" / "whisper_prompt" / "reference.json").read_text())


@pytest.fixture(scope="module")
def base():
    return bundled_whisper_fp32(batch_size=16)  # openai-whisper ran fp32


def vocabularies():
    try:
        data = bundled_base_dir()[1]
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    from engines.whisper_tokenizer import load_tokenizer

    return [load_tokenizer(data / name, 51865) for name in ("tokenizer.json", "vocabulary.txt")
            if (data / name).is_file()]


def test_encode_equals_tiktoken():
    """Letters, numbers, contractions, whitespace runs, non-Latin scripts, emoji, a special
    token's name as text: the ids tiktoken gives, from tokenizer.json (whose merges list lacks
    GPT-2's first merge, "Ġ t") and from CTranslate2's vocabulary.txt (no merges at all)."""
    for tok in vocabularies():
        for entry in REFERENCE["texts"]:
            assert tok.encode(entry["text"]) == entry["ids"], entry["text"]
            assert tok.decode(entry["ids"]) == entry["text"]


def test_prompt_tokens_equal_openai():
    """<|startofprev|>, then " " + the stripped prompt's tokens, the last 223 of a long one."""
    tok = vocabularies()[0]
    long = [p for p in REFERENCE["prompts"] if len(p["ids"]) > 223]
    assert long, "no prompt long enough to be cut"
    for p in REFERENCE["prompts"]:
        assert previous_text(tok, p["prompt"], 448) == [tok.sot_prev] + p["ids"][-223:]
    assert previous_text(tok, None, 448) == previous_text(tok, " \n ", 448) == []


def runs_by_setting() -> dict[tuple[int, str | None], list[dict]]:
    groups: dict[tuple[int, str | None], list[dict]] = {}
    for run in REFERENCE["runs"]:
        groups.setdefault((run["prompt"], run["language"]), []).append(run)
    return groups


@pytest.mark.parametrize("setting", sorted(runs_by_setting(), key=str), ids=str)
def test_decoding_after_a_prompt_equals_openai_whisper(base, setting):
    """openai-whisper 20250625, same weights, fp32, greedy, given the windows it builds: the
    tokens, text, segments and their average log-probability and no-speech probability (read
    at <|startoftranscript|>, after the prompt) are OpenAI's; with the language left to
    detection it is detected without the prompt, as OpenAI's detect_language does."""
    p, language = setting
    runs = runs_by_setting()[setting]
    dec = base.decoder
    opts = replace(dec.opts, language=language, initial_prompt=REFERENCE["prompts"][p]["prompt"], temperatures=(0.0,))
    prompted = GreedyDecoder(dec.model, dec.tok, opts, dec.suppress)
    mel, frames = openai_window_mel([audio_of(r) for r in runs])
    results = prompted.decode(mel, frames)
    for run, res, n in zip(runs, results, frames, strict=True):
        where = f"{run['audio']} (prompt {p}, language {language})"
        segments = run["segments"]
        assert list(res.tokens) == [t for s in segments for t in s["tokens"]], where
        assert res.text.strip() == run["text"], where
        # Text never closed by a timestamp ends at 30 s here (the engine's `_clip` then cuts
        # every time to the audio); OpenAI ends it at its window's frames.
        ours = [(a, b if b < 30.0 else round(n * 0.01, 2), t) for a, b, t in res.segments]
        assert ours == [(s["start"], s["end"], s["text"]) for s in segments], where
        assert res.avg_logprob == pytest.approx(segments[0]["avg_logprob"], abs=2e-3), where
        assert res.no_speech_prob == pytest.approx(segments[0]["no_speech_prob"], abs=2e-3), where
        assert res.language == run["detected"], where
        if language is None:  # detected from sot alone: the prompt would move the probability
            assert res.language_probability == pytest.approx(run["detected_probability"], abs=1e-4), where


def test_the_prompt_changes_the_text(base):
    """The references are worth testing against: the lowercase, unpunctuated style prompt
    changed OpenAI's text of the first files (and so ours, above)."""
    plain = {r["audio"]: r["text"] for r in REFERENCE["runs"] if r["prompt"] == 0 and r["language"] == "en"}
    styled = [r for r in REFERENCE["runs"] if r["prompt"] == 1]
    changed = [r["audio"] for r in styled if r["text"] != plain[r["audio"]]]
    assert len(changed) >= 3 and any(r["text"] == r["text"].lower() for r in styled)


def test_settings_carry_the_prompt(base):
    """results.jsonl records the prompt, so a rerun with another one (or none) redoes the file
    (transcribe/resume.py compares settings)."""
    dec = base.decoder
    assert "prompt" not in base.settings
    prompted = GreedyDecoder(dec.model, dec.tok, replace(dec.opts, initial_prompt="  Quilter.  "), dec.suppress)
    engine = type(base)(prompted, batch_size=4, name=base.name)
    assert engine.settings == {**base.settings, "prompt": "Quilter."}
    assert "prompt of 4 tokens" in engine.runtime  # " Qu", "il", "ter", "."


def test_settings_record_the_prompt_the_decoder_reads(base):
    """A prompt longer than the decoder keeps is recorded as its kept tail: each results.jsonl
    line holds at most n_text_ctx // 2 - 1 tokens of text, however long the glossary, and two
    prompts that differ only in the part cut off record alike (a rerun skips the done files)."""
    dec = base.decoder
    glossary = " ".join(f"Name{i} Term{i}," for i in range(400))

    def engine(prompt):
        d = GreedyDecoder(dec.model, dec.tok, replace(dec.opts, initial_prompt=prompt), dec.suppress)
        return type(base)(d, batch_size=4, name=base.name)

    long, longer = engine(glossary), engine("Other words first. " + glossary)
    kept = long.decoder.previous[1:]
    assert len(kept) == dec.model.dims.n_text_ctx // 2 - 1 < len(dec.tok.encode(" " + glossary))
    assert long.settings["prompt"] == dec.tok.decode(kept).strip()
    assert glossary.endswith(long.settings["prompt"]) and len(long.settings["prompt"]) < len(glossary) // 2
    assert longer.settings == long.settings
    assert engine("caf\udce9").settings["prompt"] == "caf\ufffd"  # as the decoder reads it



def test_text_that_is_not_utf8_encodes_as_tiktoken_does():
    """A --prompt argument holding bytes that are not UTF-8 reaches Python with lone surrogates
    (argv's surrogateescape: "caf\\xe9" from a Latin-1 terminal is "caf\\udce9"). tiktoken gives
    them U+FFFD's ids ([15246, 5342] for " caf\\udce9", as for " caf\\ufffd") and joins a split
    surrogate pair into its character; encoding them as UTF-8 raised UnicodeEncodeError, which
    failed the run as "cannot load model"."""
    for tok in vocabularies():
        assert tok.encode(" caf\udce9") == tok.encode(" caf\ufffd") == [15246, 5342]
        assert tok.encode(" a\ud83d\ude00b") == tok.encode(" a\U0001F600b") == [257, 13125, 222, 65]
        assert previous_text(tok, "caf\udce9", 448) == [tok.sot_prev, 15246, 5342]


def test_a_given_language_after_a_prompt_decodes_as_that_language_asked_for(base):
    """With --language auto, a file's later pieces come with its language (`languages`): after
    a prompt they skip the detection pass and decode as with that language asked for."""
    dec, prompt = base.decoder, REFERENCE["prompts"][0]["prompt"]
    runs = [r for r in REFERENCE["runs"] if r["prompt"] == 0 and r["language"] is None][:2]
    mel, frames = openai_window_mel([audio_of(r) for r in runs])
    auto = GreedyDecoder(dec.model, dec.tok, replace(dec.opts, language=None, initial_prompt=prompt), dec.suppress)
    asked = GreedyDecoder(dec.model, dec.tok, replace(dec.opts, language="en", initial_prompt=prompt), dec.suppress)
    given = auto.decode(mel, frames, languages=["en"] * len(runs))
    want = asked.decode(mel, frames)
    assert [r.tokens for r in given] == [r.tokens for r in want]
    assert [r.no_speech_prob for r in given] == pytest.approx([r.no_speech_prob for r in want], abs=1e-6)
    assert all(r.language == "en" and r.language_probability is None for r in given)


def test_cli_prompt_reaches_the_decoder_the_log_and_the_bench_report(base, tmp_path):
    """`transcribe --prompt` and `transcribe bench --prompt` give the prompt to the decoder (the
    startup line counts its tokens, the text follows its spelling), record it in results.jsonl
    and in the bench report, and a rerun with the same prompt skips the done file."""
    from conftest import SPEECH
    from test_cli import run_cli

    jfk, prompt = str(SPEECH / "jfk" / "jfk.flac"), "my fellow Americans: ASK NOT!"
    counted = f"prompt of {len(base.decoder.tok.encode(' ' + prompt))} tokens"
    args = (jfk, "--model", "whisper-base", "--dtype", "float32", "--prompt", prompt)
    p = run_cli(*args, "--out", str(tmp_path / "t"), "--format", "txt", "--no-progress")
    assert p.returncode == 0 and counted in p.stderr, p.stderr
    assert "ask NOT what your country" in (tmp_path / "t" / "jfk.txt").read_text()
    row = json.loads((tmp_path / "t" / "results.jsonl").read_text())
    assert row["settings"]["prompt"] == prompt
    assert "1 already done" in run_cli(*args, "--out", str(tmp_path / "t"), "--format", "txt", "--no-progress").stderr
    b = run_cli("bench", *args, "--json", str(tmp_path / "r.json"))
    assert b.returncode == 0, b.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"] == row["settings"] and counted in report["runtime"]
