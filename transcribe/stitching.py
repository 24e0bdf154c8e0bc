"""Stitching: join the results of a file's pieces into one, with file-relative times."""
from __future__ import annotations

import math
from dataclasses import replace

from transcribe.results import Result


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


def stitch(parts: list[Result], offsets: list[float], duration: float = math.inf) -> Result:
    """One Result for a whole file from its pieces (in order), their start offsets (s) and the
    file's duration (s).

    A piece's times end where the next piece begins, and the last piece's at the end of the
    file: a transducer's last token can end a few frames past its audio (its TDT duration, the
    80 ms frame grid), which would overlap the next piece's first word and subtitle cue, or
    run past the file (NeMo's word times do, on every fixture file but RNN-T's: up to 0.3 s).
    Times inside the audio are NeMo's, unchanged. The result's `audio_start` and `audio_end`
    are the first offset and the file's end, which the subtitles' cues keep within
    (`subtitles.cues`)."""
    end = None if math.isinf(duration) else duration
    if len(parts) == 1:
        return replace(shift(parts[0], offsets[0], duration), audio_start=offsets[0], audio_end=end)
    moved = [shift(p, o, until) for p, o, until in zip(parts, offsets, [*offsets[1:], duration])]
    language = main_language(moved)
    return replace(
        moved[0],
        text=" ".join(p.text.strip() for p in moved if p.text.strip()),
        words=[w for p in moved for w in p.words],
        segments=[s for p in moved for s in p.segments],
        tokens=[t for p in moved for t in p.tokens],
        language=language,
        audio_start=offsets[0],
        audio_end=end,
        # The surest detection of the file's language: the piece that decided it (the pieces
        # decoded in it after that were not asked, file_language), not the first piece's.
        language_probability=max((p.language_probability for p in moved
                                  if p.language == language and p.language_probability is not None), default=None),
    )


def main_language(parts: list[Result]) -> str | None:
    """The language of most of the text (pieces may be detected apart: Whisper's --language
    auto); the first piece's on a tie; None when no piece has one."""
    chars: dict[str, int] = {}
    for p in parts:
        if p.language is not None:
            chars[p.language] = chars.get(p.language, 0) + len(p.text.strip())
    return max(chars, key=chars.__getitem__) if chars else None
