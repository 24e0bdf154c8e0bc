"""One chunked stream's host side: a rolling audio buffer cut into [left | chunk | right] windows.

The chunk schedule follows NeMo's `speech_to_text_streaming_infer_rnnt.py` on a complete file
of L samples, so it depends only on the audio, never on how it was paced or split into pieces:
with the next chunk starting at sample c (a multiple of the chunk size),

- a regular window [max(c - left, 0), c + chunk + right) runs once MORE than c + chunk + right
  samples have arrived (NeMo: L > c + chunk + right), decoding the chunk's frames;
- once the stream has ended and at most chunk + right samples remain, the last window
  [max(c - left, 0), L) decodes everything from c on (NeMo moves the right context into the
  last chunk the same way).

Differences from NeMo's script: its buffer holds at most left + chunk + right samples, so a
last chunk longer than `chunk` loses that much left context (rounded down to whole encoder
frames, which shifts its frames); here the last window keeps the full left context. Only the
audio a window can still need is kept: memory stays bounded by left + chunk + right plus what
has arrived and not yet been decoded.
"""
from __future__ import annotations

import numpy as np
import torch

from engines.chunked_pool import ChunkContext, ChunkWindow
from transcribe.streaming.session import MIN_STREAM_SAMPLES, SessionBase
from transcribe.streaming.transcript import StreamTranscript


class ChunkedSession(SessionBase):
    """See the module docstring. frame_samples: audio samples per encoder frame (hop * subsampling)."""

    def __init__(self, stream_id: str, sample_rate: int, frame_samples: int, context: ChunkContext,
                 transcript: StreamTranscript):
        super().__init__(stream_id, sample_rate, transcript)
        self.context = context
        self.left = context.left * frame_samples
        self.chunk = context.chunk * frame_samples
        self.right = context.right * frame_samples
        self.frame_samples = frame_samples
        self._audio = np.zeros(0, dtype=np.float32)  # samples from _base on ...
        self._pending: list[np.ndarray] = []  # ... then these, joined when a window is cut:
        self._pending_n = 0  # joining at every push made a long upload quadratic
        self._base = 0
        self._next = 0  # first sample of the next chunk
        self._last_taken = False

    def push_audio(self, audio: np.ndarray) -> None:
        """float32 mono samples at the model's rate."""
        self._arrived(audio)
        if audio.shape[0]:
            self._pending.append(audio.astype(np.float32))  # a copy: the caller may reuse its buffer
            self._pending_n += audio.shape[0]

    def end(self) -> None:
        self.ended = True

    @property
    def _available(self) -> int:
        return self._base + self._audio.shape[0] + self._pending_n

    def _is_last(self) -> bool:
        return self.ended and self._available - self._next <= self.chunk + self.right

    def _cut_chunk(self) -> ChunkWindow | None:
        """The next window ready to run, or None; advances the cursor."""
        if self.slot is None or self._last_taken:
            return None
        c = self._next
        start = max(c - self.left, 0)
        if self._is_last():
            self._last_taken = True
            end, frames = self._available, None
            if end - c <= 0:
                return None  # nothing after the previous chunk (the stream ended on its boundary)
            if end < MIN_STREAM_SAMPLES:
                # Less than one 25 ms analysis window in all: the final is empty, as the
                # cache-aware session ends it; the padded features decoded into made-up
                # tokens ("g" from 255 samples).
                return None
        elif self._available > c + self.chunk + self.right:
            end, frames = c + self.chunk + self.right, self.context.chunk
            self._next = c + self.chunk
        else:
            return None
        if self._pending:
            self._audio = np.concatenate([self._audio, *self._pending])
            self._pending, self._pending_n = [], 0
        window = torch.from_numpy(self._audio[start - self._base: end - self._base].copy())
        keep_from = max(self._next - self.left, self._base)  # what later windows can still need
        self._audio = self._audio[keep_from - self._base:]
        self._base = keep_from
        return ChunkWindow(self.slot, window, (c - start) // self.frame_samples, frames)

    @property
    def decoded_seconds(self) -> float:
        """Audio covered by the windows taken so far, right context excluded (s from the start)."""
        end = self._available if self._last_taken else self._next
        return end / self.sample_rate

    @property
    def finished_input(self) -> bool:
        """Ended and the last window taken (or nothing left to decode)."""
        return self.ended and (self._last_taken or (self._is_last() and self._available <= self._next))
