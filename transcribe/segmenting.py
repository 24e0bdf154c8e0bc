"""Segmenting: cut audio longer than the model's longest piece at pauses found by VAD.

The encoder attends over the whole piece (memory grows with its square), so long files are cut
into pieces of at most `max_seconds`. Pieces tile the file, nothing is dropped, so a VAD miss
can never lose words. Each cut is the middle of the longest non-speech run (webrtcvad, see
`transcribe/vad.py`) in the last half of the allowed span: pieces stay long (context for the
model, few cuts) and the cut lands between sentences. A span without one non-speech frame is
cut at its quietest 100 ms. `PieceCutter` works on a stream of blocks, so a worker holds at
most `max_seconds` plus one block of audio, whatever the file's length; files no longer than
`max_seconds` are one piece and never reach the VAD.

A model may tile longer files with shorter pieces (`cut_seconds` < `max_seconds`): Whisper takes
a file of up to 30 s whole, but cuts longer ones into pieces of at most 20 s, with which it drops
fewer words (see `engines/whisper_engine.PIECE_SECONDS`).
"""
from __future__ import annotations

import numpy as np

from transcribe.vad import PAUSE_AGGRESSIVENESS, VAD_RATES, frame_samples, runs, speech_flags

SEARCH_FRACTION = 0.5  # look for a pause in the last half of each piece
MIN_TAIL_SECONDS = 1.0  # never leave a last piece shorter than this when a file goes on
QUIET_FRAME_SECONDS = 0.1
LOOK_PAST_SECONDS = 1.0  # VAD context past the longest allowed cut


def _quietest(window: np.ndarray, sample_rate: int) -> int:
    """Index of the middle of the lowest-energy 100 ms frame of `window`."""
    frame = max(1, int(QUIET_FRAME_SECONDS * sample_rate))
    n = max(1, window.shape[0] // frame)
    frames = window[: n * frame].reshape(n, -1)
    energy = np.einsum("ij,ij->i", frames, frames)  # per-frame energy, no temporaries
    return int(np.argmin(energy)) * frame + frames.shape[1] // 2


def choose_cut(audio: np.ndarray, sample_rate: int, lo: int, hi: int) -> int:
    """A sample index in [lo, hi] to cut `audio` at: the middle of the longest non-speech run
    there (the latest of equals, for longer pieces), else the quietest 100 ms of [lo, hi].

    VAD looks up to LOOK_PAST_SECONDS beyond `hi` so that a pause straddling `hi` is measured
    whole; the cut itself stays within [lo, hi], inside that pause.
    """
    if sample_rate in VAD_RATES and hi - lo >= frame_samples(sample_rate):
        frame = frame_samples(sample_rate)
        end = min(audio.shape[0], hi + int(LOOK_PAST_SECONDS * sample_rate))
        starts, ends = runs(~speech_flags(audio[lo:end], sample_rate, PAUSE_AGGRESSIVENESS))
        overlap = starts * frame < hi - lo
        starts, ends = starts[overlap], ends[overlap]
        if len(starts):
            k = len(starts) - 1 - int(np.argmax((ends - starts)[::-1]))
            cut = lo + (int(starts[k]) + int(ends[k])) * frame // 2
            return min(max(cut, lo), hi)
    return min(lo + _quietest(audio[lo:hi], sample_rate), hi)


class PieceCutter:
    """Push blocks of samples, get back (offset in samples, piece): a file no longer than
    `max_seconds` is one piece, a longer one is tiled with pieces of at most `cut_seconds`
    (default: max_seconds); `finish()` returns the rest at the end of the file."""

    def __init__(self, sample_rate: int, max_seconds: float, cut_seconds: float | None = None):
        if cut_seconds is not None and cut_seconds > max_seconds:
            raise ValueError(f"cut_seconds={cut_seconds} must not exceed max_seconds={max_seconds}")
        self.sample_rate = sample_rate
        self.whole_len = int(max_seconds * sample_rate)  # a file up to this long stays whole
        self.max_len = int((cut_seconds or max_seconds) * sample_rate)
        self.min_tail = min(int(MIN_TAIL_SECONDS * sample_rate), self.max_len // 4)
        self.offset = 0  # file samples before the buffer
        self._blocks: list[np.ndarray] = []
        self._n = 0

    def push(self, block: np.ndarray) -> list[tuple[int, np.ndarray]]:
        self._blocks.append(block)
        self._n += block.shape[0]
        out = []
        # Cut only once the file is known to be longer than one whole piece, and to go on for
        # min_tail past a full piece.
        while self._longer_than_whole() and self._n >= self.max_len + self.min_tail:
            out.append(self._cut(int(self.max_len * (1 - SEARCH_FRACTION)), self.max_len))
        return out

    def _longer_than_whole(self) -> bool:
        return self.offset + self._n > self.whole_len

    def finish(self) -> list[tuple[int, np.ndarray]]:
        out = []
        if self._longer_than_whole() and self._n > self.max_len:  # the tail after the cut must fit too
            out.append(self._cut(max(self._n - self.max_len, int(self.max_len * (1 - SEARCH_FRACTION))),
                                 self.max_len))
        if self._n:
            out.append((self.offset, self._buffer()))
            self.offset += self._n
            self._blocks, self._n = [], 0
        return out

    def _buffer(self) -> np.ndarray:
        if len(self._blocks) > 1:
            self._blocks = [np.concatenate(self._blocks)]
        return self._blocks[0]

    def _cut(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
        buf = self._buffer()
        cut = max(1, choose_cut(buf, self.sample_rate, lo, hi))
        piece, offset = buf[:cut], self.offset
        self._blocks, self._n, self.offset = [buf[cut:]], self._n - cut, self.offset + cut
        return offset, piece


def split_long(audio: np.ndarray, sample_rate: int, max_seconds: float,
               cut_seconds: float | None = None) -> list[tuple[float, np.ndarray]]:
    """[(offset seconds, piece)] tiling `audio` [samples] as `PieceCutter` does: whole if no
    longer than max_seconds, else in pieces of <= cut_seconds (default max_seconds)."""
    cutter = PieceCutter(sample_rate, max_seconds, cut_seconds)
    pieces = cutter.push(audio) + cutter.finish()
    return [(offset / sample_rate, piece) for offset, piece in pieces]
