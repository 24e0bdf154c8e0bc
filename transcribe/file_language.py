"""A file's spoken language, detected once, for models that detect it (Whisper, --language auto).

OpenAI's `transcribe` and faster-whisper detect the language once per file, from its first
30 s, and decode every window in it. Our pieces of a file decode in parallel, so detecting per
piece came free, but it let a long monolingual file flip language mid-way: whisper-base misreads
the language of about 1 % of English pieces (2 of our 235 English files), one or two pieces in
an hour of speech, each then transcribed in, or translated into, another language.

`FileLanguages` keeps to one language per file. A file's first piece is batched at once and
detects (a probe); the file's later pieces are held (in their slab slots) until the language is
decided, then batched in it. A probe that says nothing (silent, or no text) passes the choice to
the next piece. A probe with text decides when the model is sure of its language (probability
>= `SURE`); one it is not sure of (music before the speech: whisper-base took a 25 s tune for
Romanian at 0.64, then wrote the whole English talk in Romanian) keeps its slot and result
aside and the next piece probes too. At most `MAX_UNSURE` probes wait so; a further one lets
the oldest go as it was decoded (a long intro's music: three 12 s pieces of a tune, called
Romanian at 0.36-0.45, had voted the English talk after them Romanian). After `MAX_PROBES`
unsure probes, or at the end of the file, the language with the most probability summed over
those still waiting wins (faster-whisper's vote over `language_detection_segments`; the ones
let go, an intro's most likely, have no say), and those detected as another language are
decoded again in it.

A held piece waits one batch per probe before it: that piece is already in the batcher, and the
main loop runs a batch whenever the batcher holds one. That relies on a file's pieces arriving
in order, which they do: one worker cuts a file front to back and its events keep their order.
Only probes wait for a piece not yet cut, at most MAX_UNSURE - 1 = 2 slots per file a worker is
cutting (the oldest goes before a third would wait); the slab has at least 2 slots per worker + 1 (`pipeline`), so a worker always finds one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from transcribe.preprocess import Piece
from transcribe.results import Result

# The language probability at which one piece decides its file's. whisper-base gave 20 s of a
# synthetic tune 0.64 (Romanian) and of white noise 0.56 (Nynorsk). Over the 570 windows of our
# English speech (each file, or 20 s windows of the long ones) its 3 misreadings had 0.14-0.44,
# and 18 right ones were under 0.8 (median 0.997): those pass the choice on at the cost of one
# batch's wait, and a file of one piece decides by it all the same.
SURE = 0.8
MAX_UNSURE = 3  # unsure probes held at once (each keeps its slot until the language is known)
# Unsure probes before the vote: a file's first 8 pieces (2-4 min of a podcast's music and
# jingles, pieces being cut at pauses into 20-30 s) may pass the choice on; a file the model is
# never sure of (a language it knows little) is decided by the last 3 of them, the first 5
# standing as they came.
MAX_PROBES = 8

# What a decoded piece leads to: results that are final now (store them; their slots go back)
# and pieces to batch now (held ones in the file's language, unsure probes to decode again).
Outcome = tuple[list[tuple[Piece, Result]], list[Piece]]


@dataclass
class _Deciding:
    probe: int = 0  # the piece that detects next, until the language is decided
    language: str | None = None
    expected: int | None = None  # the file's piece count, once its worker has cut it all
    held: dict[int, Piece] = field(default_factory=dict)  # index -> piece waiting for the language
    unsure: dict[int, tuple[Piece, Result]] = field(default_factory=dict)  # probes awaiting the vote
    n_unsure: int = 0  # unsure probes so far, those let go included


class FileLanguages:
    """Per file: which pieces may be batched now, in which language, and which results stand."""

    def __init__(self) -> None:
        self.files: dict[int, _Deciding] = {}

    def admit(self, piece: Piece) -> bool:
        """True: batch `piece` now (the language is known, or it is the one to detect it);
        False: it is held until `decided` returns it."""
        st = self.files.setdefault(piece.fid, _Deciding())
        if st.language is not None or piece.index == st.probe:
            return True
        st.held[piece.index] = piece
        return False

    def language(self, piece: Piece) -> str | None:
        """The language to decode `piece` in; None: detect it."""
        st = self.files.get(piece.fid)
        return st.language if st is not None else None

    def decided(self, piece: Piece, result: Result) -> Outcome:
        """`piece` was decoded to `result`: what stands, and what to batch now. `piece` itself is
        in neither while it is an unsure probe (its slot stays taken)."""
        st = self.files.setdefault(piece.fid, _Deciding())
        if st.language is not None or piece.index != st.probe:
            return [(piece, result)], []
        if result.language and result.text:
            sure = result.language_probability is None or result.language_probability >= SURE
            if sure:
                return self._decide(st, result.language, [(piece, result)])
            st.unsure[piece.index] = (piece, result)
            st.n_unsure += 1
            if st.n_unsure >= MAX_PROBES:
                return self._decide(st, _vote(st.unsure.values()), [])
            final: list[tuple[Piece, Result]] = []
            if len(st.unsure) >= MAX_UNSURE:  # the oldest stands as decoded, its slot back
                final.append(st.unsure.pop(min(st.unsure)))
        else:
            final = [(piece, result)]  # nothing said: the next piece detects
        st.probe += 1
        if st.expected is not None and st.probe >= st.expected:
            return self._end(st, final)
        return final, [st.held.pop(st.probe)] if st.probe in st.held else []

    def ended(self, fid: int, expected: int) -> Outcome:
        """The file's worker has cut all `expected` pieces: a file whose every piece has probed
        without a sure one decides now, by the vote."""
        st = self.files.setdefault(fid, _Deciding())
        st.expected = expected
        if st.language is None and st.probe >= expected:
            return self._end(st, [])
        return [], []

    def forget(self, fid: int) -> list[Piece]:
        """The file is finished or failed: the pieces whose slots it still holds (none once it
        is finished), for the caller to release."""
        st = self.files.pop(fid, None)
        if st is None:
            return []
        return list(st.held.values()) + [p for p, _ in st.unsure.values()]

    def _end(self, st: _Deciding, final: list[tuple[Piece, Result]]) -> Outcome:
        """No piece is left to probe: the vote of the unsure ones, if any."""
        if not st.unsure:
            return final, []  # no piece said anything, or none waits any more
        return self._decide(st, _vote(st.unsure.values()), final)

    def _decide(self, st: _Deciding, language: str, final: list[tuple[Piece, Result]]) -> Outcome:
        st.language = language
        again = [p for p, r in st.unsure.values() if r.language != language]
        final = final + [(p, r) for p, r in st.unsure.values() if r.language == language]
        held, st.held, st.unsure = st.held, {}, {}
        return final, sorted(again + list(held.values()), key=lambda p: p.index)


def _vote(unsure) -> str:
    """The language with the most probability summed over the unsure probes (ties: the first's)."""
    score: dict[str, float] = {}
    for _, r in unsure:
        score[r.language] = score.get(r.language, 0.0) + (r.language_probability or 0.0)
    return max(score, key=score.__getitem__)
