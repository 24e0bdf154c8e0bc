"""A stream's transcript in committed segments + open tail (transcribe/streaming/transcript.py):
joined, they are what building the whole transcript at once gives, at every step; and the open
tail, which is rebuilt and resent every step, stays bounded however long the stream runs."""
from __future__ import annotations

import io
import json
import random

import pytest
import sentencepiece

from conftest import SPEECH, needs_shared
from engines.tokenizer import Tokenizer
from transcribe.stitching import shift
from transcribe.streaming.transcript import MAX_OPEN_S, PAUSE_S, StreamTranscript, join_texts
from transcribe.timestamps import FrameTiming, build_result

pytestmark = needs_shared
TIMING = FrameTiming(0.01, 8)  # 80 ms encoder frames, as Parakeet's


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A BPE model trained (in 30 ms) on the shared speech's reference texts, whose LJSpeech
    part is punctuated: pieces such as '.', ',' and '?' then exist, as in
    parakeet-tdt-0.6b-v2's vocabulary; the fixture models' vocabularies have none."""
    texts = [json.loads(line)["text"] for line in (SPEECH / "manifest_eval_short.jsonl").read_text().splitlines()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=400,
                                             model_type="bpe", character_coverage=1.0, minloglevel=2)
    tokenizer = Tokenizer.from_bytes(model.getvalue())
    assert {".", ",", "?", "'"} <= tokenizer.supported_punctuation
    return tokenizer


def _random_stream(rng: random.Random, tokenizer: Tokenizer, n: int, kind: str):
    """n random token ids (any piece: word starts, sub-words, punctuation, <unk>) with frames
    that advance 0-3 frames a token, now and then by a pause, and TDT durations."""
    punct = [i for i, p in enumerate(tokenizer.vocab) if p and p[-1] in ".?!,'" and len(p) <= 2]
    tokens, frames, durations, frame = [], [], [], 0
    for _ in range(n):
        tokens.append(rng.choice(punct) if rng.random() < 0.08 else rng.randrange(tokenizer.vocab_size))
        frame += rng.choice((0, 1, 1, 2, 3)) + (rng.randrange(5, 20) if rng.random() < 0.03 else 0)
        frames.append(frame)
        durations.append(rng.randrange(0, 5))
    return tokens, frames, durations if kind == "tdt" else []


@pytest.mark.parametrize("kind", ["tdt", "rnnt"])
def test_segments_and_tail_joined_equal_the_whole_transcript_at_every_step(tokenizer, kind):
    rng = random.Random(7)
    for trial in range(5):
        tokens, frames, durations = _random_stream(rng, tokenizer, 800, kind)
        transcript = StreamTranscript(tokenizer, kind, TIMING)
        texts, words, n, segments = [], [], 0, 0
        while n < len(tokens):
            n = min(n + rng.randrange(0, 12), len(tokens))  # a step adds 0-11 tokens
            final = n == len(tokens)
            decoded = (frames[n - 1] + 2) * TIMING.frame_seconds if n else 0.0
            u = transcript.update(tokens[:n], frames[:n], durations[:n] if durations else [], decoded, final)
            assert u.first_index == segments
            segments += len(u.segments)
            texts += [s.text for s in u.segments]
            words += [w for s in u.segments for w in s.words]
            whole = shift(build_result(tokenizer, tokens[:n], frames[:n], durations[:n] if durations else [], kind,
                                       TIMING), 0.0, until=decoded)
            assert join_texts([*texts, u.open.text]) == whole.text, (trial, n)
            assert words + u.open.words == whole.words, (trial, n)
            if final:
                assert u.final == whole
        assert segments > 10  # the rules did cut: this checked more than one long tail


@pytest.mark.parametrize("kind", ["tdt", "rnnt"])
def test_a_tail_of_one_long_word_is_not_respelled_at_every_step(tokenizer, kind, monkeypatch):
    """A stream that opens with a long run of sub-word pieces (the random fixture models emit
    only those, for whole streams): while the tail is one word there is nothing to cut and
    the cut search reads only the tokens added since it last looked (it had spelled the whole
    tail at every step, quadratic in the stream); once word starts come, cuts resume, and
    segments + tail join to the whole transcript at every step."""
    import transcribe.streaming.transcript as T

    spelled = []
    monkeypatch.setattr(T, "token_spans", lambda tok, toks, *a, real=T.token_spans: spelled.append(len(toks))
                        or real(tok, toks, *a))
    rng = random.Random(5)
    sub_words = [i for i, p in enumerate(tokenizer.vocab) if p.isalpha()]  # no '▁', no punctuation
    plain = [rng.choice(sub_words) for _ in range(600)]
    tokens, frames, durations = _random_stream(rng, tokenizer, 600, kind)
    tokens = plain + tokens
    frames = list(range(600)) + [600 + f for f in frames]
    durations = [1] * 600 + durations if durations else []
    transcript = StreamTranscript(tokenizer, kind, TIMING)
    texts, n, spelled_in_plain = [], 0, None
    while n < len(tokens):
        n = min(n + rng.randrange(1, 12), len(tokens))
        if spelled_in_plain is None and n > 600:
            spelled_in_plain = list(spelled)
        decoded = (frames[n - 1] + 2) * TIMING.frame_seconds
        u = transcript.update(tokens[:n], frames[:n], durations[:n], decoded, n == len(tokens))
        texts += [seg.text for seg in u.segments]
        whole = shift(build_result(tokenizer, tokens[:n], frames[:n], durations[:n], kind, TIMING), 0.0, until=decoded)
        assert join_texts([*texts, u.open.text]) == whole.text
    assert spelled_in_plain == []  # the one-word tail: no cut search spelled it
    assert len(texts) > 10  # and cuts came once words did


def test_the_open_tail_stays_bounded_on_a_long_stream(tokenizer):
    """An hour-long stream, stepped every 0.5 s: what each step rebuilds and sends is the open
    tail, a few seconds of words, never the transcript so far (12k tokens by the end)."""
    rng = random.Random(3)
    tokens, frames, durations = _random_stream(rng, tokenizer, 12000, "tdt")
    transcript = StreamTranscript(tokenizer, "tdt", TIMING)
    step = 0.5
    n, t, longest, words = 0, 0.0, 0, 0
    while n < len(tokens):
        t += step
        while n < len(tokens) and frames[n] * TIMING.frame_seconds < t:
            n += 1
        u = transcript.update(tokens[:n], frames[:n], durations[:n], t, n == len(tokens))
        words += sum(len(s.words) for s in u.segments)
        if u.open.words:
            assert u.open.words[-1].start - u.open.words[0].start <= MAX_OPEN_S + step
        longest = max(longest, len(tokens) - transcript.committed if n == len(tokens) else n - transcript.committed)
    assert longest < 400 and words + len(u.open.words) == len(u.final.words) > 4000


def test_cuts_fall_after_sentence_ends_and_pauses_never_inside_a_word(tokenizer):
    text = "We went. Then we stopped and waited"
    tokens = tokenizer._sp.encode(text)
    pieces = tokenizer.pieces(tokens)
    word = [0] * len(pieces)  # each token's word
    for i in range(1, len(pieces)):
        word[i] = word[i - 1] + pieces[i].startswith("\u2581")
    pause = round(PAUSE_S / TIMING.frame_seconds) + 1
    frames, frame = [], 0
    for i in range(len(pieces)):
        # a pause before "and" (word 5), and one inside "stopped" if it is several pieces
        inside = i > 0 and word[i] == word[i - 1] == 4
        frame += 1 + (pause if (word[i] == 5 and word[i - 1] == 4) or inside else 0)
        frames.append(frame)
    durations = [1] * len(tokens)
    transcript = StreamTranscript(tokenizer, "tdt", TIMING)
    u = transcript.update(tokens, frames, durations, 100.0, final=False)
    assert [s.text for s in u.segments] == ["We went.", "Then we stopped"]  # "." and the pause
    assert u.open.text == "and waited" and u.open_index == 2
    # The tail's last word may still grow ("waited" + "ly"?): never cut before the next word.
    u = transcript.update(tokens, frames, durations, 100.0, final=True)
    assert u.segments == [] and u.final.text == text
