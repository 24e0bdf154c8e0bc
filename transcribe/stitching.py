"""Stitching: join the results of a file's pieces into one, with file-relative times."""
from __future__ import annotations

import math
import unicodedata
from dataclasses import replace
from typing import Sequence

from transcribe.results import Result
from transcribe.subtitles import unspaced
from transcribe.timestamps import sentence_segments


def shift(result: Result, offset: float, until: float = math.inf) -> Result:
    """The same result with every word and segment time moved by `offset` seconds, and times
    past `until` (file seconds) pulled back to it, times before the piece's start up to it:
    Whisper's alignment puts a token it finds at the very first audio frame at -0.02 s (OpenAI's
    DTW backtrace steps along the border at frame -1), which in a 30 ms file was every word."""
    def at(t: float) -> float:
        return max(offset, min(t + offset, until))

    return replace(
        result,
        words=[replace(w, start=at(w.start), end=at(w.end)) for w in result.words],
        segments=[replace(s, start=at(s.start), end=at(s.end)) for s in result.segments],
    )


def stitch(parts: list[Result], offsets: list[float], duration: float = math.inf,
           sentence_delimiters: Sequence[str] | None = None) -> Result:
    """One Result for a whole file from its pieces (in order), their start offsets (s) and the
    file's duration (s).

    A piece's times end where the next piece begins, and the last piece's at the end of the
    file: a transducer's last token can end a few frames past its audio (its TDT duration, the
    80 ms frame grid), which would overlap the next piece's first word and subtitle cue, or
    run past the file (NeMo's word times do, on every fixture file but RNN-T's: up to 0.3 s).
    Times inside the audio are NeMo's, unchanged. The result's `audio_start` and `audio_end`
    are the first offset and the file's end, which the subtitles' cues keep within
    (`subtitles.cues`).

    `sentence_delimiters`: the pieces' segments are sentences ending in one of these (a
    transducer's, NeMo's rule), so the file's are made again over all its words, as NeMo makes
    them decoding the file whole: a sentence that runs on over a cut stays one segment (each
    piece closed its last one at its end: segments and subtitle cues broke every 20-40 s), and
    a piece that opens with a closing mark (the end of the sentence cut before it) gives it to
    the word before (`_glue_marks`). None: each piece keeps its segments (Whisper's timestamp
    spans, which OpenAI's long-form decoding never joins across its windows either).

    Piece texts are joined with a space, but none between two characters of a script written
    without spaces (Chinese, Japanese, Thai: `subtitles.unspaced`)."""
    end = None if math.isinf(duration) else duration
    if len(parts) == 1:
        return replace(shift(parts[0], offsets[0], duration), audio_start=offsets[0], audio_end=end)
    moved = [shift(p, o, until) for p, o, until in zip(parts, offsets, [*offsets[1:], duration])]
    if sentence_delimiters is not None:
        moved = _glue_marks(moved)
    words = [w for p in moved for w in p.words]
    language = main_language(moved)
    return replace(
        moved[0],
        text=join_texts(p.text for p in moved),
        words=words,
        segments=([s for p in moved for s in p.segments] if sentence_delimiters is None
                  else sentence_segments(words, sentence_delimiters)),
        tokens=[t for p in moved for t in p.tokens],
        language=language,
        audio_start=offsets[0],
        audio_end=end,
        # The surest detection of the file's language: the piece that decided it (the pieces
        # decoded in it after that were not asked, file_language), not the first piece's.
        language_probability=max((p.language_probability for p in moved
                                  if p.language == language and p.language_probability is not None), default=None),
    )


def join_texts(texts) -> str:
    """Texts of consecutive pieces (or a piece and its tail) as one: stripped, the empty ones
    left out, a space between two unless both sides of the join are of an unspaced script."""
    out = ""
    for text in texts:
        text = text.strip()
        if text:
            out += ("" if not out or (unspaced(out[-1]) and unspaced(text[0])) else " ") + text
    return out


# Marks NeMo glues to the word before, that may open a piece: punctuation that closes (a full
# stop, a comma, a closing quote or bracket), not one that opens a phrase ("(", "«", "¿").
_OPENING = ("Ps", "Pi")
_OPENING_MARKS = "¿¡"


def _closing_marks(word: str) -> bool:
    return bool(word) and all(unicodedata.category(ch).startswith("P") and unicodedata.category(ch) not in _OPENING
                              and ch not in _OPENING_MARKS for ch in word)


def _glue_marks(parts: list[Result]) -> list[Result]:
    """A piece whose first word is only closing punctuation (a transducer can emit the "." of
    the sentence cut before it first, in the pause) gives it to the last word of the pieces
    before, as NeMo glues a mark to the word before: "house ." -> "house.", one segment, not a
    lone "." word, cue and segment. The word keeps its times: the mark has none of its own
    (NeMo's TDT rule puts it at the word's end)."""
    out = list(parts)
    for k in range(1, len(out)):
        p = out[k]
        j = next((i for i in range(k - 1, -1, -1) if out[i].words), None)
        if j is None or not p.words or not _closing_marks(p.words[0].word.strip()):
            continue
        mark, q, text = p.words[0].word.strip(), out[j], p.text.strip()
        glued = replace(q.words[-1], word=q.words[-1].word + mark)
        if text.startswith(mark):  # the texts too, else they would no longer spell the words
            out[j] = replace(q, words=[*q.words[:-1], glued], text=q.text.rstrip() + mark)
            out[k] = replace(p, words=p.words[1:], text=text[len(mark):].lstrip())
    return out


def main_language(parts: list[Result]) -> str | None:
    """The language of most of the text (pieces may be detected apart: Whisper's --language
    auto); the first piece's on a tie; None when no piece has one."""
    chars: dict[str, int] = {}
    for p in parts:
        if p.language is not None:
            chars[p.language] = chars.get(p.language, 0) + len(p.text.strip())
    return max(chars, key=chars.__getitem__) if chars else None
