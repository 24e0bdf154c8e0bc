"""Token ids + encoder frames (+ durations) -> words and segments with times, as NeMo does.

Port of NeMo's `compute_rnnt_timestamps` / `get_words_offsets` / `get_segment_offsets` for
SentencePiece BPE models, working on frame offsets and converting to seconds at the end with
NeMo's exact arithmetic (`frame * window_stride * subsampling_factor`), so times are equal to
NeMo's to the last bit (plus `offset_s`, for chunks stitched into a longer recording).

Token spans (in encoder frames):
- TDT: [frame, frame + predicted duration); a token whose text is a supported punctuation mark
  is moved to a zero-length span at the previous token's end (NeMo's `_refine_timestamps_tdt`);
- RNN-T: [frame, frame + 1) (NeMo derives them from per-frame alignments: one frame each);
- CTC: [the previous token's first frame, its own first frame] (the first token starting one
  frame early: NeMo's CTC offsets); a token whose text begins with a punctuation mark is cut to
  no length at its start (NeMo's CTC `_refine_timestamps`).

Words: a token starts a new word when its piece differs from its text (a '▁' piece, or a
control piece such as <unk>, which renders ' ⁇ ' and so always stands alone), unless it is
punctuation, which is glued to the word before. A word's start is its first token's start,
its end the last token's end; its text is `decode_pieces` of its pieces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from engines.tokenizer import WORD_START, Tokenizer
from transcribe.results import Result, Segment, Word

Kind = Literal["tdt", "rnnt", "ctc"]
DEFAULT_SEGMENT_DELIMITERS = (".", "?", "!")
_WORD_DELIMITER = " "


@dataclass(frozen=True)
class FrameTiming:
    """Encoder frame -> seconds. Kept as NeMo's two factors so products round identically."""

    window_stride: float  # seconds per feature frame (preprocessor.window_stride)
    subsampling_factor: int  # feature frames per encoder frame (encoder.subsampling_factor)

    def seconds(self, frame: int, offset_s: float = 0.0) -> float:
        return offset_s + frame * self.window_stride * self.subsampling_factor

    @property
    def frame_seconds(self) -> float:
        return self.window_stride * self.subsampling_factor


@dataclass
class _Span:
    """Mutable work item: text (or piece) with [start, end) in encoder frames."""

    text: str
    piece: str
    start: int
    end: int


def token_spans(tokenizer: Tokenizer, tokens: Sequence[int], frames: Sequence[int],
                durations: Sequence[int], kind: Kind) -> list[_Span]:
    """Per-token text, piece and [start, end) frames, with NeMo's TDT punctuation refinement."""
    if len(frames) != len(tokens) or (kind != "rnnt" and len(durations) != len(tokens)):
        raise ValueError(f"need one frame{'' if kind == 'rnnt' else ' and duration'} per token: "
                         f"{len(tokens)} tokens, {len(frames)} frames, {len(durations)} durations")
    pieces, texts = tokenizer.pieces(tokens), tokenizer.token_texts(tokens)
    spans = []
    for i, (text, piece, frame) in enumerate(zip(texts, pieces, frames)):
        if kind == "ctc":
            # NeMo's CTC offsets: token k spans [frame of token k-1, its own first frame], the
            # first token starting one frame early; so words tile the time axis without gaps.
            start = frames[i - 1] if i > 0 else max(0, frames[0] - 1)
            spans.append(_Span(text, piece, int(start), int(frame)))
            continue
        end = frame + 1 if kind == "rnnt" else frame + durations[i]
        spans.append(_Span(text, piece, int(frame), int(end)))
    punctuation = tokenizer.supported_punctuation
    if kind == "tdt" and punctuation:  # NeMo refines TDT and CTC offsets, not RNN-T's
        for i in range(1, len(spans)):
            if spans[i].text in punctuation:  # often emitted late, after a pause: pin to the word
                spans[i].start = spans[i].end = spans[i - 1].end
    elif kind == "ctc" and punctuation:
        # NeMo's CTC rule (`CTCDecoding._refine_timestamps`) is its own: a token whose text
        # *begins* with a mark ("...", "»,") ends where it starts, keeping its own start. Taking
        # TDT's rule moved `the?!` and `«Привет»,` ends by 0.24-0.40 s.
        for i in range(1, len(spans)):
            if spans[i].text and spans[i].text[0] in punctuation:
                spans[i].end = spans[i].start
    return spans


def _next_text(spans: list[_Span], i: int) -> str | None:
    """Text of the next token that is neither empty nor the word delimiter (NeMo's lookahead)."""
    for span in spans[i + 1:]:
        if span.text and span.text != _WORD_DELIMITER:
            return span.text
    return None


def word_spans(tokenizer: Tokenizer, spans: list[_Span]) -> list[_Span]:
    """Group token spans into words exactly as NeMo's `get_words_offsets` (BPE, ' ' delimiter)."""
    punctuation = tokenizer.supported_punctuation
    words: list[_Span] = []
    built: list[str] = []  # pieces of the word being built
    first = 0  # index of its first token
    for i, span in enumerate(spans):
        is_punct = span.text in punctuation and span.text != _WORD_DELIMITER
        starts_word = span.piece != span.text or (
            span.text == _WORD_DELIMITER and _next_text(spans, i) not in punctuation)
        if starts_word and not is_punct:
            if built:
                words.append(_Span(tokenizer.decode_pieces(built), "", spans[first].start, spans[i - 1].end))
            built = []
            if span.text != _WORD_DELIMITER:
                built, first = [span.piece], i
        elif is_punct and not built and words:
            last = words[-1]  # punctuation after a finished word: append it to that word
            last.end = span.end
            last.text = (last.text[:-1] if last.text.endswith(" ") else last.text) + span.text
        elif is_punct and built:
            if built[-1] in (" ", "_", WORD_START):
                built.pop()
            built.append(span.piece)
        else:
            if not built:
                first = i
            built.append(span.piece)
    if built:
        start = spans[first].start if words else spans[0].start
        words.append(_Span(tokenizer.decode_pieces(built), "", start, spans[-1].end))
    if words:
        words[0].start = spans[0].start  # NeMo pins the first word to the first token
    return words


def segment_spans(words: list[_Span], delimiters: Sequence[str] = DEFAULT_SEGMENT_DELIMITERS,
                  max_gap_frames: float | None = None) -> list[_Span]:
    """Join words into segments, ending one after a word that ends with (or is) a delimiter.

    With `max_gap_frames`, a pause of at least that many frames between words also starts a new
    segment (checked before the delimiter rule; NeMo's version skips the delimiter rule when a
    gap threshold is set, which we consider a bug). With None this equals NeMo's default."""
    segments: list[_Span] = []
    texts: list[str] = []
    first = 0
    for i, word in enumerate(words):
        if max_gap_frames is not None and texts and word.start - words[i - 1].end >= max_gap_frames:
            segments.append(_Span(" ".join(texts), "", words[first].start, words[i - 1].end))
            texts, first = [], i
        texts.append(word.text)
        if word.text and (word.text[-1] in delimiters or word.text in delimiters):
            segments.append(_Span(" ".join(texts), "", words[first].start, word.end))
            texts, first = [], i + 1
    if texts:
        segments.append(_Span(" ".join(texts), "", words[first].start, words[-1].end))
    return segments


def sentence_segments(words: Sequence[Word], delimiters: Sequence[str] = DEFAULT_SEGMENT_DELIMITERS) -> list[Segment]:
    """Segments of words already in seconds (a whole file's, stitched from its pieces:
    `stitching.stitch`) by `segment_spans`' rule: the same segments as a piece's own."""
    spans = segment_spans([_Span(w.word, "", w.start, w.end) for w in words], delimiters)
    return [Segment(s.text, s.start, s.end) for s in spans]


def build_result(tokenizer: Tokenizer, tokens: Sequence[int], frames: Sequence[int],
                 durations: Sequence[int], kind: Kind, timing: FrameTiming, *, offset_s: float = 0.0,
                 segment_delimiters: Sequence[str] = DEFAULT_SEGMENT_DELIMITERS,
                 max_gap_s: float | None = None) -> Result:
    """Greedy output of one utterance -> `Result` with text, words and segments in seconds.

    `tokens`/`frames`/`durations` are a `Hypothesis`' fields (durations unused for RNN-T);
    `offset_s` is added to every time (start of this chunk in the whole recording);
    `max_gap_s` optionally splits segments on pauses at least that long."""
    tokens = [int(t) for t in tokens]
    spans = token_spans(tokenizer, tokens, frames, durations, kind) if tokens else []
    words = word_spans(tokenizer, spans) if spans else []
    gap_frames = None if max_gap_s is None else max_gap_s / timing.frame_seconds
    segments = segment_spans(words, segment_delimiters, gap_frames)
    sec = timing.seconds
    return Result(
        text=tokenizer.text(tokens),
        words=[Word(w.text, sec(w.start, offset_s), sec(w.end, offset_s)) for w in words],
        segments=[Segment(s.text, sec(s.start, offset_s), sec(s.end, offset_s)) for s in segments],
        tokens=tokens,
    )
