"""A stream's transcript as it grows: committed segments, then the open tail.

Rebuilding and sending the whole transcript at every step made a long stream quadratic: an
hour of speech is ~12k tokens, ~90 ms to build and ~270 KB to send, per step, per stream. So
each step commits the words that can no longer change in segments, sent once, and rebuilds
and resends only the open tail after them:

- a word can change until the next word starts (a later token may extend it: a sub-word
  piece, or punctuation, which is glued to the word before); so cuts fall only on a token
  that starts a word (a '▁' piece that does not open with punctuation);
- the tail is cut before each word that follows a sentence end (. ? !) or a pause of at
  least PAUSE_S; and once it spans MAX_OPEN_S with no such word, before its last word;
- never before a token that ends past the audio decoded (its time is clamped to that, and
  would be clamped less at a later step).

The cut tokens' words are exactly the whole transcript's (`timestamps.word_spans` never looks
back across a word start, and the TDT punctuation refinement moves only punctuation), and
the committed texts joined with spaces, then the tail's, are the whole text (tested against
`build_result` over every token). The final result is built once over every token, as
offline decoding builds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engines.tokenizer import WORD_START, Tokenizer
from transcribe.results import Result
from transcribe.stitching import shift
from transcribe.timestamps import DEFAULT_SEGMENT_DELIMITERS, FrameTiming, Kind, build_result, token_spans

PAUSE_S = 0.6  # a pause this long between words ends a segment
MAX_OPEN_S = 8.0  # the open tail is cut before its last word once it spans this long


@dataclass(frozen=True)
class Update:
    """What one step adds to a stream's transcript (times: seconds from the stream start).

    segments: committed this step, in order, numbered from `first_index`; they never change.
    open: the words after the last committed one (index `first_index + len(segments)` once
    committed); final: the whole transcript, once the stream has ended (else None)."""

    segments: list[Result]
    first_index: int
    open: Result
    final: Result | None = None

    @property
    def open_index(self) -> int:
        return self.first_index + len(self.segments)


def join_texts(texts: Sequence[str]) -> str:
    """Committed segments' texts and the tail's -> the transcript so far."""
    return " ".join(t for t in texts if t)


class StreamTranscript:
    """Cuts one stream's tokens into committed segments and builds the open tail (see above)."""

    def __init__(self, tokenizer: Tokenizer, kind: Kind, timing: FrameTiming):
        self.tokenizer, self.kind, self.timing = tokenizer, kind, timing
        self.committed = 0  # tokens [0, committed) are in segments already sent
        self.segments = 0  # segments sent
        self._plain_until = 0  # tokens [committed + 1, this) hold no word-start piece (see _cuts)
        self._pause = PAUSE_S / timing.frame_seconds  # in encoder frames
        self._max_open = MAX_OPEN_S / timing.frame_seconds

    def update(self, tokens: Sequence[int], frames: Sequence[int], durations: Sequence[int],
               decoded_seconds: float, final: bool) -> Update:
        """The step's new segments and open tail; `decoded_seconds` bounds every time (a
        token's frame or duration can reach past the audio decoded)."""
        first = self.segments
        cuts = self._cuts(tokens, frames, durations, decoded_seconds)
        segments = []
        for end in cuts:
            segments.append(self._build(tokens, frames, durations, self.committed, end, decoded_seconds))
            self.committed = end
        self.segments += len(segments)
        tail = self._build(tokens, frames, durations, self.committed, len(tokens), decoded_seconds)
        whole = self._build(tokens, frames, durations, 0, len(tokens), decoded_seconds) if final else None
        return Update(segments, first, tail, whole)

    def _build(self, tokens, frames, durations, start: int, end: int, until: float) -> Result:
        result = build_result(self.tokenizer, tokens[start:end], frames[start:end],
                              durations[start:end], self.kind, self.timing)
        return shift(result, 0.0, until=until)

    def _cuts(self, tokens, frames, durations, decoded_seconds: float) -> list[int]:
        """Token indices (ascending, past `committed`) where committed segments end."""
        start = self.committed
        if len(tokens) - start < 2:
            return []
        # Cuts fall only on a word-start piece after the tail's first token. While none has come
        # (one long word, or a model emitting only sub-word pieces, as the random fixture models
        # do) there is nothing to cut, and only the tokens added since the last look are read:
        # spelling the whole tail here at every step had made such a stream quadratic.
        scan = max(self._plain_until, start + 1)
        if not any(piece.startswith(WORD_START) for piece in self.tokenizer.pieces(tokens[scan:])):
            self._plain_until = len(tokens)
            return []
        spans = token_spans(self.tokenizer, tokens[start:], frames[start:],
                            durations[start:], self.kind)
        punctuation = self.tokenizer.supported_punctuation
        # Word starts: a '▁' piece whose text does not open with punctuation (NeMo glues that
        # to the word before, and the transcript drops the space before it: "word 's" ->
        # "word's"), so cutting there leaves both the words and the joined text unchanged.
        # And only where every token before ends inside the audio decoded: a later step would
        # clamp a word's end less (a TDT duration can reach past the chunk), changing it.
        ends, inside = 0, []
        for span in spans:
            ends = max(ends, span.end)
            inside.append(self.timing.seconds(ends) <= decoded_seconds)
        starts = [i for i in range(1, len(spans))
                  if spans[i].piece.startswith(WORD_START) and spans[i].text.strip()
                  and spans[i].text.strip()[0] not in punctuation and not spans[i].text[0].isspace()
                  and inside[i - 1]]
        cuts = []
        for i in starts:
            before = spans[i - 1].text.strip()
            if (before and before[-1] in DEFAULT_SEGMENT_DELIMITERS) or spans[i].start - spans[i - 1].end >= self._pause:
                cuts.append(i)
        last = cuts[-1] if cuts else 0
        if starts and starts[-1] > last and spans[starts[-1]].start - spans[last].start >= self._max_open:
            cuts.append(starts[-1])
        return [start + i for i in cuts]
