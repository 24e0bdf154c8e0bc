"""Segmenting: cut audio longer than the model's longest piece at pauses found by VAD.

The encoder attends over the whole piece (memory grows with its square), so long files are cut
into pieces of at most `max_seconds`. Pieces tile the file, nothing is dropped. Each cut is in
the longest non-speech run (webrtcvad, see `transcribe/vad.py`) in the last half of the
allowed span, at its quietest 100 ms (`choose_cut`): pieces stay long (context for the model,
few cuts) and the cut lands between sentences. A cut inside a word would still lose or repeat
it at the pieces' edges: hence the VAD's warm-up and the quietest point, not the run's middle.
A span without a pause is cut at its quietest 100 ms. `PieceCutter` works on a stream of blocks, so a worker holds at
most `max_seconds` plus one block of audio, whatever the file's length; files no longer than
`max_seconds` are one piece and never reach the VAD.

A model may tile longer files with shorter pieces (`cut_seconds` < `max_seconds`): Whisper takes
a file of up to 30 s whole, but cuts longer ones into pieces of at most 20 s, with which it drops
fewer words (see `engines/whisper_engine.PIECE_SECONDS`).
"""
from __future__ import annotations

import numpy as np

import webrtcvad

from transcribe.vad import PAUSE_AGGRESSIVENESS, VAD_RATES, frame_samples, runs, speech_flags

SEARCH_FRACTION = 0.5  # look for a pause in the last half of each piece
MIN_TAIL_SECONDS = 1.0  # never leave a last piece shorter than this when a file goes on
QUIET_FRAME_SECONDS = 0.1
MIN_PAUSE_SECONDS = 0.09  # 3 VAD frames: a shorter non-speech run is a gap inside a word
EDGE_SECONDS = 0.15  # a pause's edges, where soft onsets and tails are, are not cut in


def _quietest(window: np.ndarray, sample_rate: int) -> int:
    """Index of the middle of the lowest-energy 100 ms of `window` (sliding in 10 ms steps),
    the one nearest the window's middle among equals (digital silence is all equal)."""
    hop = max(1, int(0.01 * sample_rate))
    frame = max(1, int(QUIET_FRAME_SECONDS * sample_rate)) // hop
    n = window.shape[0] // hop
    if n <= frame:
        return window.shape[0] // 2
    steps = window[: n * hop].reshape(n, hop)
    energy = np.convolve(np.einsum("ij,ij->i", steps, steps, dtype=np.float64), np.ones(frame), "valid")
    quietest = np.flatnonzero(energy <= energy.min() * (1 + 1e-6))
    k = int(quietest[np.argmin(np.abs(quietest - (len(energy) - 1) / 2))])
    return k * hop + frame * hop // 2


def choose_cut(audio: np.ndarray, sample_rate: int, lo: int, hi: int,
               pauses: tuple[np.ndarray, np.ndarray] | None) -> int:
    """A sample index in [lo, hi] to cut `audio` at: in the longest of the `pauses` (start and
    end sample arrays, the VAD's non-speech runs) there (its part within [lo, hi]; the latest
    of equals, for longer pieces), at the quietest 100 ms of the pause's inner part; else the
    quietest 100 ms of [lo, hi].

    The quietest point of the pause, not its middle: a soft voice (a quiet speaker, a trailing
    word) can be non-speech to the VAD, which then joins it to the true pause beside it; the
    middle of such a run fell in the words, the quietest 100 ms falls in the pause. The pause's
    edges (up to EDGE_SECONDS) are left out, where a soft onset or tail begins. Runs shorter
    than MIN_PAUSE_SECONDS are gaps inside words.
    """
    if pauses is not None:
        starts, ends = np.maximum(pauses[0], lo), np.minimum(pauses[1], hi)
        keep = ends - starts >= MIN_PAUSE_SECONDS * sample_rate
        starts, ends = starts[keep], ends[keep]
        if len(starts):
            k = len(starts) - 1 - int(np.argmax((ends - starts)[::-1]))
            a, b = int(starts[k]), int(ends[k])
            edge = min((b - a) // 4, int(EDGE_SECONDS * sample_rate))
            return a + edge + _quietest(audio[a + edge: b - edge], sample_rate)
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
        # One VAD over the whole file, made at its first cut and fed as the buffer grows: its
        # flags are the whole file's. A detector started afresh at each search span (cold: it
        # adapts to the level as it goes) missed the pauses of a loud recording and called one
        # 30 ms frame inside a word a pause, and the word came out in both pieces.
        self._vad = None
        self._speech = np.zeros(0, dtype=bool)  # VAD flags of file frames _frame0, _frame0 + 1, ...
        self._frame0 = 0

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

    def _pauses(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The VAD's non-speech runs over `buf` (the buffer) as start and end sample indices into
        it, the file's frames flagged up to the buffer's end; None at a rate webrtcvad lacks."""
        if self.sample_rate not in VAD_RATES:
            return None
        frame = frame_samples(self.sample_rate)
        if self._vad is None:
            self._vad = webrtcvad.Vad(PAUSE_AGGRESSIVENESS)
        flagged = (self._frame0 + len(self._speech)) * frame - self.offset  # buffer samples flagged
        new = speech_flags(buf[flagged:], self.sample_rate, vad=self._vad)
        self._speech = np.concatenate([self._speech, new])
        starts, ends = runs(~self._speech)
        at = self._frame0 * frame - self.offset  # where the first flagged frame starts in buf
        return np.maximum(starts * frame + at, 0), ends * frame + at

    def _cut(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
        buf = self._buffer()
        cut = max(1, choose_cut(buf, self.sample_rate, lo, hi, self._pauses(buf)))
        piece, offset = buf[:cut], self.offset
        self._blocks, self._n, self.offset = [buf[cut:]], self._n - cut, self.offset + cut
        # flags of frames wholly before the new buffer are not needed again
        drop = self.offset // frame_samples(self.sample_rate) - self._frame0 if self._vad is not None else 0
        self._speech, self._frame0 = self._speech[drop:], self._frame0 + drop
        return offset, piece


def split_long(audio: np.ndarray, sample_rate: int, max_seconds: float,
               cut_seconds: float | None = None) -> list[tuple[float, np.ndarray]]:
    """[(offset seconds, piece)] tiling `audio` [samples] as `PieceCutter` does: whole if no
    longer than max_seconds, else in pieces of <= cut_seconds (default max_seconds)."""
    cutter = PieceCutter(sample_rate, max_seconds, cut_seconds)
    pieces = cutter.push(audio) + cutter.finish()
    return [(offset / sample_rate, piece) for offset, piece in pieces]

