"""Subtitle cues: a result's segments cut to what a viewer can read, on word times.

A segment is a sentence (Parakeet: up to `.?!`) or a Whisper timestamp span, and either can
run to 20 s and 250 characters: whisper-base gave 209 of 659 segments over two lines of 42
characters on our speech set. Broadcast guidelines (Netflix, BBC) keep a cue to two lines of
about 42 characters and at most 7 s, so a segment that is longer is cut at word boundaries
into the fewest cues that fit, as even as can be, preferring cuts after punctuation; each
cue's times are those of its first and last words. The text of the cues, joined, is the
segment's text: words are never moved or respelled, only the whitespace between them.

A cue never spans a pause of MAX_CUE_PAUSE_SECONDS or more between two of its words: shown
through it, its later words would be read seconds before they are heard (a Parakeet sentence
runs on over a long file's pauses; an unpunctuated model's segment is a whole piece).

Cues are then settled in time (`_settle`): none overlaps the next, and one shorter than
MIN_CUE_SECONDS (a word or two said fast, or a segment whose times were capped to a point)
takes up to that much of the silence around it, or, where a point has none, joins the next cue.

Word times come from `Result.words`, matched to the segment text character by character
(whitespace aside: Whisper's words split "self-substantial" in two, the text does not). A
result whose words do not spell its segments (none aligned) keeps one cue per segment.

Scripts written without spaces (Chinese, Japanese, Thai, ...: Whisper's words there are a few
characters each, the segment text one unbroken run) are cut between words inside a run and
rejoined without a space. Widths are display columns: a wide (CJK) character takes two, so a
line holds 21 of them, near the 16 of Netflix's Chinese guideline, and a 7 s cue of speech at
4-5 characters a second fills well under two lines.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass

MAX_LINE_CHARS = 42
MAX_LINES = 2
MAX_CUE_CHARS = MAX_LINE_CHARS * MAX_LINES
MAX_CUE_SECONDS = 7.0
# Among splits into the fewest cues: a cut after a punctuation mark is worth half the
# difference between an empty cue and a full one.
_PUNCTUATION_BONUS = 0.5
_PUNCTUATION = tuple(",;:.?!，、；：。？！")
# Scripts written without spaces between words that are not East Asian wide: Thai, Lao,
# Myanmar, Khmer (wide ones, CJK, are found by their width).
_UNSPACED_RANGES = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF))
# A shorter cue (`_give_time`) is shown this long where the silence around it allows: about
# the shortest time a line of subtitle can be read in (Netflix's minimum duration is 5/6 s);
# "And on." timed to its 0.2 s of speech flashed by.
MIN_CUE_SECONDS = 1.0
# A pause between words this long or longer ends a cue (BBC and Netflix practice: no subtitle
# through a silence of more than a second or two).
MAX_CUE_PAUSE_SECONDS = 1.5


@dataclass(frozen=True)
class Cue:
    """One subtitle: seconds from the start of the file, and its lines (at most MAX_LINES,
    unless one word is longer than a line)."""

    start: float
    end: float
    lines: tuple[str, ...]


@dataclass(frozen=True)
class _Token:
    text: str  # whitespace-free, as in the segment text
    start: float
    end: float
    glued: bool = False  # no space before it in the text (a word inside an unspaced run)

    @property
    def columns(self) -> int:
        return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in self.text)


def unspaced(ch: str) -> bool:
    """A character of a script written without spaces between words."""
    return unicodedata.east_asian_width(ch) in "WF" or any(a <= ord(ch) <= b for a, b in _UNSPACED_RANGES)


def _join(tokens: list[_Token]) -> str:
    """Tokens as the text spells them: a space before each unless it is glued (or first)."""
    return "".join(("" if t.glued or i == 0 else " ") + t.text for i, t in enumerate(tokens))


@dataclass
class _Draft:
    """A cue before its times are settled (`_settle`) and its tokens wrapped into lines."""

    start: float
    end: float
    tokens: list[_Token]


def cues(result) -> list[Cue]:
    """The result's subtitle cues, in order, each shown for a time of its own and none
    overlapping another (`_settle`); segments without text give none."""
    segments = [s for s in result.segments if s.text.strip()]
    timed = _timed_tokens(segments, result.words)
    drafts: list[_Draft] = []
    for i, seg in enumerate(segments):
        if timed is None:
            drafts.append(_Draft(seg.start, seg.end, [_Token(t, seg.start, seg.end) for t in seg.text.split()]))
            continue
        groups = [g for run in _between_pauses(timed[i]) for g in _cut(run)]
        for k, group in enumerate(groups):
            # The first and last cue keep the segment's own times.
            drafts.append(_Draft(seg.start if k == 0 else group[0].start,
                                 seg.end if k == len(groups) - 1 else group[-1].end, group))
    end = math.inf if result.audio_end is None else result.audio_end
    return [Cue(d.start, d.end, wrap(d.tokens)) for d in _settle(drafts, result.audio_start, end)]


def _between_pauses(tokens: list[_Token]) -> list[list[_Token]]:
    """A segment's tokens in runs split where a pause of MAX_CUE_PAUSE_SECONDS or more lies
    between one word's end and the next one's start."""
    runs: list[list[_Token]] = []
    for t in tokens:
        if runs and t.start - runs[-1][-1].end < MAX_CUE_PAUSE_SECONDS:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _ms(seconds: float) -> int:
    """A time as srt and vtt print it (`writers._clock`): cue times are compared as shown."""
    return round(seconds * 1000)


def _settle(drafts: list[_Draft], begin: float = 0.0, end: float = math.inf) -> list[_Draft]:
    """The cues in text order, none overlapping the one before, none of zero length. A
    segment's times can overlap the next one's (Whisper's word times move segment ends past
    the next start; RNN-T word times overlap), run out of order (word times moved a segment
    past the next), or close up to nothing: a piece's times are capped where the next piece,
    or its own tail, begins (`stitching.stitch`, `whisper_engine._decode_tails`), so a segment
    whose words were put past that point starts and ends there, as does a one-word segment
    whose word has no length (a TDT token of duration 0). A player skips or flashes such a
    cue, and overlapping ones stack on screen. `begin`, `end`: where the audio begins and
    ends (a manifest segment's audio begins at its offset): no cue is shown outside."""
    _order(drafts)
    return _give_time(drafts, begin, end)


def _order(drafts: list[_Draft]) -> None:
    """A cue that begins while the one before is shown ends that one, so every cue still
    appears as its first word is heard (as subtitle editors fix overlaps: a cue taken off a
    little early misleads less than one put up late); one that begins no later than the one
    before (out of order) waits until that one ends. A cue ending before it begins ends there."""
    for prev, d in zip([None, *drafts], drafts):
        if prev is not None and _ms(d.start) < _ms(prev.end):
            if _ms(d.start) > _ms(prev.start):
                prev.end = d.start
            else:
                d.start = prev.end
        if _ms(d.end) < _ms(d.start):
            d.end = d.start


def _give_time(drafts: list[_Draft], begin: float = 0.0, end: float = math.inf) -> list[_Draft]:
    """A cue shorter than MIN_CUE_SECONDS gets up to that much of the silence around it, centred
    on its time where the cues before and after leave room: it stays where it was in the
    file (a zero-length time is where its words were capped, or where its word was) and no
    other cue moves. A cue of zero length with no silence on either side (cues meeting at its
    time) gives its words to the cue after it, which begins at that time: no words are lost
    and no time is made up for them, at the cost of a fuller cue (cut again if it no longer
    fits, `_refit`). The first cue has from `begin`, the last until `end` (the audio's start
    and end: a cue outside them shows words over audio that is not theirs, or outlasts the
    file); at the end with no room, it joins the cue before."""
    out: list[_Draft] = []
    joined: set[int] = set()  # ids of the drafts that took in another's words
    for i, d in enumerate(drafts):
        if _ms(d.end) - _ms(d.start) < _ms(MIN_CUE_SECONDS):
            before = out[-1].end if out else min(begin, d.start)
            after = drafts[i + 1].start if i + 1 < len(drafts) else max(end, d.end)
            start, stop = d.start, d.end
            d.start = max(before, (start + stop - MIN_CUE_SECONDS) / 2)
            d.end = max(stop, min(after, d.start + MIN_CUE_SECONDS))
            d.start = min(start, max(before, d.end - MIN_CUE_SECONDS))
            if _ms(d.end) == _ms(d.start):  # no room on either side
                if i + 1 < len(drafts):
                    drafts[i + 1].tokens = d.tokens + drafts[i + 1].tokens
                    joined.add(id(drafts[i + 1]))
                    continue
                if out:  # the last, where the audio and the cue before end
                    out[-1].tokens += d.tokens
                    joined.add(id(out[-1]))
                    continue
        out.append(d)
    return [part for d in out for part in (_refit(d) if id(d) in joined and _overfull(d.tokens) else [d])]


def _overfull(tokens: list[_Token]) -> bool:
    """More words than two lines hold: `wrap` made a line too long (one that a single word
    overfills is a cue of its own once cut again)."""
    return len(tokens) > 1 and max(_Token(line, 0.0, 0.0).columns for line in wrap(tokens)) > MAX_LINE_CHARS


def _refit(d: _Draft) -> list[_Draft]:
    """A cue that took in a zero-length one's words, cut again where it no longer fits two
    lines (`_cut`), its time shared among the parts by their width: the joined words have no
    time of their own to show them by."""
    groups = _cut(d.tokens)
    widths = [len(_join(g)) for g in groups]
    edges = [d.start + (d.end - d.start) * sum(widths[:k]) / sum(widths) for k in range(len(groups) + 1)]
    edges[-1] = d.end
    return [_Draft(a, b, g) for a, b, g in zip(edges, edges[1:], groups)]


def _timed_tokens(segments, words) -> list[list[_Token]] | None:
    """Each segment's whitespace tokens with the times of the words that spell them: a token
    starts when the word holding its first character starts and ends when the word holding
    its last character ends; a token is also split where one word ends and the next starts
    between two characters of an unspaced script (the second part glued to the first). None
    when the words do not spell the segments' text."""
    owner: list[int] = []  # word index of each non-space character of the words, in order
    chars: list[str] = []
    for k, w in enumerate(words):
        for ch in w.word:
            if not ch.isspace():
                chars.append(ch)
                owner.append(k)
    pos, out = 0, []
    for seg in segments:
        tokens = []
        for text in seg.text.split():
            if "".join(chars[pos:pos + len(text)]) != text:
                return None
            cuts = [0] + [c for c in range(1, len(text)) if owner[pos + c] != owner[pos + c - 1]
                          and unspaced(text[c - 1]) and unspaced(text[c])] + [len(text)]
            for a, b in zip(cuts, cuts[1:]):
                first, last = words[owner[pos + a]], words[owner[pos + b - 1]]
                tokens.append(_Token(text[a:b], first.start, last.end, glued=a > 0))
            pos += len(text)
        out.append(tokens)
    return out if pos == len(chars) else None


def _cut(tokens: list[_Token]) -> list[list[_Token]]:
    """Split a segment's tokens into cues that fit: the fewest cues, then the least sum of
    `_cost` (dynamic programming over cut points). A cue of tokens[j:i] fits when it holds at
    most MAX_CUE_CHARS columns and MAX_CUE_SECONDS seconds and its words wrap into lines of
    MAX_LINE_CHARS (84 characters of uneven words can need a 43-character line). A single
    token that does not fit on its own is a cue by itself. Linear in the tokens: a cue spans
    a few dozen of them at most, and prefix sums price each candidate in O(1)."""
    n = len(tokens)
    ends = [0]  # ends[i]: columns of tokens[:i], each with the space before it (if not glued)
    for t in tokens:
        ends.append(ends[-1] + t.columns + (0 if t.glued else 1))

    def width(j: int, i: int) -> int:  # tokens[j:i] on one line (no space before the first)
        return ends[i] - ends[j] - (0 if tokens[j].glued else 1)

    best = [(0, 0.0)] + [(n + 1, 0.0)] * n  # (cues, cost) of the best split of tokens[:i]
    back = [0] * (n + 1)
    for i in range(1, n + 1):
        # The smallest k whose second line tokens[k:i] fits: a cue tokens[j:i] wraps when
        # its first line tokens[j:k] fits too (any later k only lengthens the first line).
        k = i  # i: not even the last token fits a line
        while k > 0 and width(k - 1, i) <= MAX_LINE_CHARS:
            k -= 1
        for j in range(i - 1, -1, -1):
            chars = width(j, i)
            fill = max(chars / MAX_CUE_CHARS, (tokens[i - 1].end - tokens[j].start) / MAX_CUE_SECONDS)
            fits = fill <= 1.0 and (chars <= MAX_LINE_CHARS or (k > j and width(j, k) <= MAX_LINE_CHARS))
            if not fits and j < i - 1:
                break
            cost = (best[j][0] + 1, best[j][1] + _cost(tokens[i - 1].text, fill, last=i == n))
            if cost < best[i]:
                best[i], back[i] = cost, j
    groups, i = [], n
    while i > 0:
        groups.append(tokens[back[i]:i])
        i = back[i]
    return groups[::-1]


def _cost(last_token: str, fill: float, last: bool) -> float:
    """A cue's cost among splits into as many cues: its emptiness squared (even cues beat a
    full one and a scrap), less a bonus when it ends on punctuation (not the segment's last)."""
    bonus = _PUNCTUATION_BONUS if not last and last_token.endswith(_PUNCTUATION) else 0.0
    return (1.0 - min(fill, 1.0)) ** 2 - bonus


def wrap(tokens: list[_Token]) -> tuple[str, ...]:
    """A cue's text as lines: one line if it fits MAX_LINE_CHARS columns, else two split
    between the tokens where the longer line is shortest (a cue holds at most MAX_CUE_CHARS,
    so both fit unless a single word is longer than a line)."""
    cols = [t.columns + (0 if t.glued or i == 0 else 1) for i, t in enumerate(tokens)]
    if sum(cols) <= MAX_LINE_CHARS or len(tokens) < 2:
        return (_join(tokens),)
    # Line two drops the space before its first token: cols[k] - 1 unless that one is glued.
    k = min(range(1, len(tokens)),
            key=lambda k: max(sum(cols[:k]), sum(cols[k:]) - (0 if tokens[k].glued else 1)))
    return (_join(tokens[:k]), _join(tokens[k:]))
