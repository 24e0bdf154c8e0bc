"""A decoded window's tokens -> its segments, and with token start times -> its words.

`split_segments` cuts the tokens at timestamp tokens (`<|a|> text <|b|>` -> a segment from a to
b). `window_words` is OpenAI's `add_word_timestamps` for one window (whisper/timing.py): text
tokens grouped into words (`split_words`: at spaces and punctuation, or at every complete
character for languages written without spaces), each word from the start of its first token to
the start of the token after it (`engines.whisper_alignment`), OpenAI's two length heuristics
(a word at a sentence end or after a pause is cut to twice the median word length, at most
1.4 s), punctuation merged into the neighbouring word, and each segment's start and end moved
to its words unless a word looks stretched over a pause. Times are seconds from the window
start, rounded to 10 ms as OpenAI rounds them.

The probability of a word is the mean of its tokens' probabilities as the greedy decoder chose
them (its log-probabilities, kept for the average log-probability anyway). OpenAI and
faster-whisper read them from the forced alignment pass instead (a prompt without timestamps);
that needs the vocabulary projection for every text token once more, which the alignment here
avoids.
"""
from __future__ import annotations

import math
import string
from dataclasses import dataclass

import numpy as np

from engines.whisper_tokenizer import TIME_PRECISION, WhisperTokenizer

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
MAX_MEDIAN_WORD_SECONDS = 0.7


@dataclass(frozen=True)
class WindowSegment:
    """Times in seconds from the window start; tokens: the text tokens (no timestamps)."""

    start: float
    end: float
    tokens: tuple[int, ...]


@dataclass
class WindowWord:
    """A word (OpenAI spelling: leading space, merged punctuation), seconds from the window start."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def split_segments(tokens: list[int] | tuple[int, ...], tok: WhisperTokenizer) -> list[WindowSegment]:
    """<|a|> text <|b|> -> (a, b, text tokens); text after a closed segment starts where it ended;
    text never closed ends at 30 s (the caller clips to the window's audio). Other special
    tokens (suppressed while decoding) are dropped."""
    ts0, segs, start, cur, prev_end = tok.timestamp_begin, [], None, [], 0.0
    for t in tokens:
        if t < ts0:
            if t < tok.eot:
                cur.append(t)
            continue
        sec = (t - ts0) * TIME_PRECISION
        if cur:  # closes the open segment (or text that followed a closed one)
            segs.append(WindowSegment(prev_end if start is None else start, sec, tuple(cur)))
            start, cur, prev_end = None, [], sec
        else:
            start = sec
    if cur:
        segs.append(WindowSegment(prev_end if start is None else start, 30.0, tuple(cur)))
    return segs


def split_words(tokens: list[int], tok: WhisperTokenizer, language: str | None) -> list[list[int]]:
    """Text tokens -> their words' tokens (OpenAI's `split_to_word_tokens`): complete characters
    first (a token may end inside a multi-byte character), then, except for languages written
    without spaces, a new word at a leading space or at punctuation."""
    full = tok.decode(tokens)
    units, current, offset = [], [], 0
    for t in tokens:
        current.append(t)
        text = tok.decode(current)
        cut = text.find("\ufffd")
        if cut < 0 or full[offset + cut:offset + cut + 1] == "\ufffd":
            units.append((text, current))
            current, offset = [], offset + len(text)
    if current:
        units.append((tok.decode(current), current))
    if language in NO_SPACE_LANGUAGES:
        return [u for _, u in units]
    words: list[list[int]] = []
    for text, unit in units:
        # `in string.punctuation` is a substring test, as in OpenAI ("" counts too)
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(list(unit))
        else:
            words[-1].extend(unit)
    return words


def window_words(segments: list[WindowSegment], token_starts: np.ndarray, token_logprobs: list[float],
                 tok: WhisperTokenizer, language: str | None, after_pause: bool = False
                 ) -> tuple[list[WindowSegment], list[list[WindowWord]]]:
    """Segments of one window + the start of each of its text tokens and of the <|endoftext|>
    after them (seconds, `Aligner.token_starts`) + each text token's log-probability ->
    (segments with times moved to their words, the words of each segment).

    after_pause: the window begins in a pause that follows earlier speech (a later piece of a
    long file, cut in a pause): its first word counts as following a pause, as OpenAI's does
    with the last speech of the window before; counted from the window's start (as for a
    file's first window), the stretched first word kept its start at the cut, 0.15-0.67 s
    before the speech on the long-form joins."""
    text = [t for s in segments for t in s.tokens]
    if len(token_starts) != len(text) + 1 or len(token_logprobs) != len(text):
        raise ValueError(f"{len(text)} text tokens, {len(token_starts)} start times, {len(token_logprobs)} log-probs")
    words, first = [], 0
    for word_tokens in split_words(text, tok, language):
        last = first + len(word_tokens)
        prob = float(np.mean(np.exp(token_logprobs[first:last])))
        words.append(WindowWord(tok.decode(word_tokens), word_tokens, float(token_starts[first]),
                                float(token_starts[last]), prob))
        first = last
    median, longest = _cut_long_words(words)
    _merge_punctuations(words)
    return _fit_segments(segments, words, median, longest, -math.inf if after_pause else 0.0)


def _cut_long_words(words: list[WindowWord]) -> tuple[float, float]:
    """Words at a sentence end longer than twice the median word: cut to that. -> (median,
    longest allowed), as OpenAI derives them."""
    durations = [w.end - w.start for w in words if w.end - w.start != 0]
    median = min(MAX_MEDIAN_WORD_SECONDS, float(np.median(durations))) if durations else 0.0
    longest = 2 * median
    if durations:
        for prev, w in zip(words, words[1:]):
            if w.end - w.start > longest:
                if w.word in SENTENCE_END_MARKS:  # substring tests, as in OpenAI
                    w.end = w.start + longest
                elif prev.word in SENTENCE_END_MARKS:
                    w.start = w.end - longest
    return median, longest


def _merge_punctuations(words: list[WindowWord]) -> None:
    """Opening punctuation joins the next word, closing punctuation the previous one (OpenAI's
    `merge_punctuations`); the emptied entry keeps its place with no text and no tokens."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev.word.startswith(" ") and prev.word.strip() in PREPEND_PUNCTUATIONS:
            nxt.word, nxt.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev.word.endswith(" ") and nxt.word in APPEND_PUNCTUATIONS:
            prev.word, prev.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            nxt.word, nxt.tokens = "", []
        else:
            i = j
        j += 1


def _fit_segments(segments: list[WindowSegment], words: list[WindowWord], median: float,
                  longest: float, last_speech: float = 0.0) -> tuple[list[WindowSegment], list[list[WindowWord]]]:
    """Deal the words out to the segments by token count, then OpenAI's segment-boundary rules
    (`last_speech`: where speech before the window ended, seconds from its start)."""
    out_segments, out_words, k = [], [], 0
    for seg in segments:
        mine, taken = [], 0
        while k < len(words) and taken < len(seg.tokens):
            w = words[k]
            if w.word:
                mine.append(WindowWord(w.word, w.tokens, _round(w.start), _round(w.end), w.probability))
            taken += len(w.tokens)
            k += 1
        start, end = seg.start, seg.end
        if mine:
            first = mine[0]
            # The first word after a pause, stretched over it: cut to the longest allowed.
            if first.end - last_speech > median * 4 and (
                    first.end - first.start > longest
                    or (len(mine) > 1 and mine[1].end - first.start > longest * 2)):
                if len(mine) > 1 and mine[1].end - mine[1].start > longest:
                    boundary = max(mine[1].end / 2, mine[1].end - longest)
                    first.end = mine[1].start = boundary
                first.start = max(0.0, first.end - longest)
            # The segment's own timestamps win over a first or last word stretched past them.
            if start < first.end and start - 0.5 > first.start:
                first.start = max(0.0, min(first.end - median, start))
            else:
                start = first.start
            if end > mine[-1].start and end + 0.5 < mine[-1].end:
                mine[-1].end = max(mine[-1].start + median, end)
            else:
                end = mine[-1].end
            last_speech = end
        out_segments.append(WindowSegment(start, end, seg.tokens))
        out_words.append(mine)
    return out_segments, out_words


def _round(seconds: float) -> float:
    """OpenAI's round(x, 2) (and never -0.0)."""
    return round(seconds, 2) + 0.0
