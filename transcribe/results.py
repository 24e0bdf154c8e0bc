"""Transcription results: plain frozen dataclasses, times in seconds from the audio start."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Word:
    """One word as the model spells it (NeMo: its word timestamps; Whisper: OpenAI's words,
    punctuation attached); start/end in seconds. probability: the model's confidence in the
    word (Whisper: mean token probability), None where the model gives none (Parakeet)."""

    word: str
    start: float
    end: float
    probability: float | None = None

    def to_json(self) -> dict:
        """As written in JSON outputs and streamed results: word, start, end (s, 1 ms), and
        probability when the model gives one."""
        doc = {"word": self.word, "start": round(self.start, 3), "end": round(self.end, 3)}
        if self.probability is not None:
            doc["probability"] = round(self.probability, 4)
        return doc


@dataclass(frozen=True)
class Segment:
    """A run of words (split on sentence punctuation and, optionally, long pauses); seconds."""

    text: str
    start: float
    end: float


@dataclass(frozen=True)
class Result:
    """Transcript of one utterance: text, word and segment timestamps, the token ids, and the
    language it was transcribed in where the model says (Whisper's multilingual models), with
    the probability the model gave it where it detected it (file_language.FileLanguages).
    `audio_start`, `audio_end`: where the audio it transcribes begins and ends, in the seconds
    of its times (0 and the file's end, or a manifest segment's offset and end:
    `stitching.stitch` sets them), so subtitles stay inside; `audio_end` None when unknown."""

    text: str
    words: list[Word] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    language: str | None = None
    language_probability: float | None = None
    audio_start: float = 0.0
    audio_end: float | None = None
