"""Chunked ("buffered") streaming of offline-trained models over a slot pool.

NeMo's `speech_to_text_streaming_infer_rnnt.py` semantics: a stream's audio is cut into chunks
of `chunk` encoder frames; each step encodes the audio window [left | chunk | right] with the
ordinary full-context `ConformerEncoder`, keeps only the encoder frames of the chunk, and
continues greedy label-looping decoding from the stream's decoder state after the previous
chunk (`engines.slot_pool.DecoderSlots`, RNN-T or TDT, with TDT's overshoot carried over).

Features are log-mel over the window's audio, normalised (`per_feature`) over that window, as
NeMo's script does by running its preprocessor on the audio buffer: a chunk's features, and so
its encodings, depend on its context and differ from the offline ones unless the window holds
the whole recording. They are computed on the model's device (on CUDA, the GPU). Every window
starts on an encoder-frame boundary (a multiple of hop * subsampling samples), so window frame
i is stream frame start/frame_samples + i.

`step` batches any set of streams at any positions: rows are encoded together with per-row
lengths (padded frames masked) and decoded from their own slots' states.

The encoder is called through the offline engine's backend interface
(`engines.encoder_backend`): eager torch on the CPU, CUDA graphs on CUDA, one per (batch,
window width) bucket (`window_profiles`), captured when the pool is made. Why: a window's width
grows with the stream's position until the left context is full and a step's batch is whatever
streams are ready, so eager steps met a new shape almost every time, and on a GPU a new shape
is paid in the step (allocator growth, cuDNN plans, lazy kernel loading); a short stream runs
only a few steps, most of them first-of-their-shape. The graphs fix the shapes at startup and
launch a step's ~1,000 kernels at once.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engines.conformer import ConformerEncoder
from engines.decode_stages import Hypothesis
from engines.encoder_backend import BucketProfile, EncoderBackend, tile_profiles
from engines.slot_pool import DecoderSlots, SlotPool
from engines.stage_times import StageTimes
from engines.stream_pool import pad_features
from engines.transducer import TransducerDecoder
from transcribe.features import FeatureConfig, LogMel

# Window widths a pool's encoder is bucketed on at most (captured graphs: this many per batch
# size). NeMo's 2/10/2 s chunking has 6 distinct widths; a short chunk with a long left context
# has many more, and those share the next bucket up (padding, masked).
MAX_WINDOW_PROFILES = 8
# Rows a bucket holds: a step with more ready streams runs as several replays of this many. At
# 64 rows of a 14 s window a 0.6B encoder's GEMMs already fill a GPU.
MAX_WINDOW_BATCH = 64


@dataclass(frozen=True)
class ChunkContext:
    """Window geometry in encoder frames: `left` context, `chunk` decoded per step, `right`
    context (lookahead). Theoretical latency = (chunk + right) frames."""

    left: int
    chunk: int
    right: int

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.left < 0 or self.right < 0:
            raise ValueError(f"chunked streaming needs chunk >= 1 and left, right >= 0 encoder frames, got {self}")

    @classmethod
    def from_ms(cls, chunk_ms: float, left_ms: float, right_ms: float, frame_samples: int, sample_rate: int
                ) -> "ChunkContext":
        """Milliseconds -> whole encoder frames, rounded down as NeMo does (int(secs * frames/s));
        ValueError if the chunk is shorter than one frame or a value is negative."""
        for name, ms in (("chunk", chunk_ms), ("left context", left_ms), ("right context", right_ms)):
            if ms < 0:
                raise ValueError(f"{name} must be >= 0 ms, got {ms}")
        frame_ms = 1000.0 * frame_samples / sample_rate
        if chunk_ms < frame_ms:
            raise ValueError(f"chunk must be at least one encoder frame ({frame_ms:g} ms), got {chunk_ms} ms")
        return cls(*(int(ms * sample_rate // (1000 * frame_samples)) for ms in (left_ms, chunk_ms, right_ms)))


@dataclass(frozen=True)
class ChunkWindow:
    """One stream's step: `audio` float32 [n] is the window, starting on an encoder-frame
    boundary; its first `left_frames` encoder frames are left context; `frames` encoder frames
    after them are decoded (None: all of them, the stream's last window, which has no right
    context)."""

    slot: int
    audio: Tensor
    left_frames: int
    frames: int | None


def window_samples(context: ChunkContext, frame_samples: int) -> list[int]:
    """The distinct lengths (samples) of the regular windows a stream runs, shortest first:
    [min(c, left) | chunk | right] for chunk starts c = 0, chunk, 2 chunk, ... until the left
    context is full. A stream's last window is never longer than the regular window at its
    position, so the longest here bounds every window."""
    left, chunk, right = (x * frame_samples for x in (context.left, context.chunk, context.right))
    out, c = [], 0
    while True:
        out.append(min(c, left) + chunk + right)
        if c >= left:
            return out
        c += chunk


def window_profiles(context: ChunkContext, frame_samples: int, fcfg: FeatureConfig, max_streams: int,
                    limit: int = MAX_WINDOW_PROFILES) -> tuple[BucketProfile, ...]:
    """The encoder's shape buckets for chunked windows: one per distinct window width in feature
    frames (at most `limit`: evenly spread over them, the widest always kept), tiling 1 ..
    widest, each of min(max_streams, MAX_WINDOW_BATCH) rows."""
    frames = sorted({int(fcfg.frame_count(torch.tensor([n]))[0]) for n in window_samples(context, frame_samples)})
    if len(frames) > limit:
        frames = sorted({frames[round(i * (len(frames) - 1) / (limit - 1))] for i in range(limit)})
    rows = max(1, min(max_streams, MAX_WINDOW_BATCH))
    return tile_profiles([(f * fcfg.hop_length / fcfg.sample_rate, f, rows) for f in frames])


class ChunkedStreamPool(SlotPool):
    """Decoder state for up to `max_streams` chunked streams; see the module docstring.
    `encoder`: the model's encoder, or a backend around it (`StreamingModel.new_pool` gives one
    bucketed on `window_profiles`)."""

    def __init__(self, encoder: ConformerEncoder | EncoderBackend, decoder: TransducerDecoder, logmel: LogMel,
                 max_streams: int, max_frames: int | None = None):
        """max_frames: the most encoder frames a step decodes for one stream (chunk + right, a
        last window's), for which the decoder's graphs are built now on CUDA (else at the
        first step)."""
        super().__init__(max_streams)
        self.encoder = encoder
        self.dec = DecoderSlots(decoder, max_streams, max_frames)
        self.device = self.dec.device
        # The windows' log-mel runs on the model's device (a copy: the caller's stays put). On
        # the host it was the biggest part of a step: 8 ms a 14 s window on the dev VM, and
        # 128 streams of NeMo's 2 s chunks bring 64 such windows a second.
        self.logmel = logmel if torch.device(self.device).type == "cpu" else copy.deepcopy(logmel).to(self.device)
        self.stage_seconds = StageTimes(self.device)  # per step: features, encoder, decoder

    def _reset(self, slot: int) -> None:
        self.dec.reset(slot)

    def features(self, audio: Tensor) -> Tensor:
        """float32 [n] on the host -> [n_mels, valid frames] on the pool's device, normalised over
        this window alone. One row at a time: a batched LogMel would sum in another order and
        make batching change results. The valid frames are counted on the host (no sync)."""
        n = audio.shape[0]
        feats, _ = self.logmel(audio.to(self.device)[None].float(), torch.tensor([n], device=self.device))
        return feats[0, :, : int(self.logmel.cfg.frame_count(torch.tensor([n]))[0])]

    @torch.inference_mode()
    def step(self, windows: Sequence[ChunkWindow]) -> list[Hypothesis]:
        """Encode each window, keep its chunk's frames, decode them continuing its slot (distinct
        slots). Returns per window the NEW tokens, frames counted from the stream's start."""
        if not windows:
            return []
        t0 = time.perf_counter()
        idx = torch.tensor([w.slot for w in windows], dtype=torch.int64, device=self.device)
        feats, lengths = pad_features([self.features(w.audio) for w in windows], self.device)
        t0 = self.stage_seconds.lap("features", t0)
        enc, enc_len = self.encoder(feats, lengths)  # [B, D, T], [B]
        t0 = self.stage_seconds.lap("encoder", t0)
        left = torch.tensor([w.left_frames for w in windows], dtype=torch.int64, device=self.device)
        rest = (enc_len - left).clamp(min=0)  # frames after the left context
        want = torch.tensor([-1 if w.frames is None else w.frames for w in windows], dtype=torch.int64,
                            device=self.device)
        n = torch.where(want < 0, rest, torch.minimum(want, rest))
        t = max(int(n.max()), 1)
        # Row b's chunk: its frames left[b] ... left[b] + n[b] - 1, left-aligned.
        pick = (left[:, None] + torch.arange(t, device=self.device)).clamp(max=enc.size(2) - 1)
        chunk = enc.transpose(1, 2).gather(1, pick[:, :, None].expand(-1, -1, enc.size(1)))
        hyps = self.dec.decode(idx, chunk, n)
        self.stage_seconds.lap("decoder", t0)
        return hyps
