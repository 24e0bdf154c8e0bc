"""One cache-aware stream's host-side state: incremental log-mel features, chunking, and its
transcript (`SessionBase`, shared with the chunked streams of `chunked_session.py`).

Audio arrives in pieces of any size; `IncrementalLogMel` turns it into exactly the frames that
`LogMel` computes over the whole recording (center-padded STFT, preemphasis carried across
pieces), emitting a frame as soon as its 25 ms window is complete. `StreamSession` cuts those
frames into the encoder's chunks (`engines.streaming_encoder.next_chunk`, NeMo's chunk rules)
and accumulates the tokens each pool step returns.
"""
from __future__ import annotations

import collections
import enum
import time

import numpy as np
import torch
from torch import Tensor

from engines.stream_pool import ChunkInput
from engines.streaming_encoder import StreamingConfig, chunk_features, next_chunk
from transcribe.features import LogMel
from transcribe.streaming.transcript import StreamTranscript

# A stream ended with less than one 25 ms analysis window (at 16 kHz) gets an empty final.
MIN_STREAM_SAMPLES = 400


class IncrementalLogMel:
    """Push float32 samples; `take` returns the feature frames [n_mels, k] whose windows are
    complete and not yet taken; `finish` flushes the rest.

    The concatenation of everything taken equals `LogMel` over the whole stream:
    samples // hop valid frames, then `pad_value` frames up to LogMel's frame count. Only the
    samples from the first frame not yet taken on are kept, so memory does not grow with the
    stream. `push` only preemphasises and keeps the piece: the STFT runs when a chunk needs
    frames (`take`), over many pieces at once. Per 100 ms piece it had been most of the serving
    event loop's time (60 % of its samples at 100 real-time streams), taken from the GIL that
    the step thread's decoder loop needs."""

    def __init__(self, logmel: LogMel):
        cfg = logmel.cfg
        if cfg.normalize_mode is not None or cfg.exact_pad or cfg.frame_splicing != 1:
            raise ValueError("streaming features need preprocessor.normalize=NA, exact_pad=false and "
                             "frame_splicing=1 (a cache-aware checkpoint has no per-utterance normalisation)")
        self.logmel = logmel
        self.hop, self.n_fft = cfg.hop_length, cfg.n_fft_resolved
        self.half = self.n_fft // 2  # center=True: frame t covers samples t*hop - half ... t*hop + half - 1
        self._y = torch.zeros(0)  # preemphasised samples from absolute index _base on ...
        self._pieces: list[np.ndarray] = []  # ... then these, joined by the next `take`
        self._base = 0
        self._prev: float | None = None  # last raw sample (preemphasis crosses piece boundaries)
        self.samples = 0
        self.frames = 0  # frames taken so far

    def push(self, audio: np.ndarray) -> None:
        """float32 samples [n], kept preemphasised for the next `take`."""
        x = np.asarray(audio, dtype=np.float32).reshape(-1)
        if not x.size:
            return
        pre = self.logmel.cfg.preemph
        y = x.copy()
        if pre is not None:
            y[1:] -= np.float32(pre) * x[:-1]
            if self._prev is not None:
                y[0] -= np.float32(pre * self._prev)
        self._prev = float(x[-1])
        self._pieces.append(y)
        self.samples += x.size

    @property
    def ready(self) -> int:
        """Frames (taken or not) whose 25 ms windows are complete."""
        end = (self.samples - self.half) // self.hop + 1 if self.samples >= self.half else 0
        return min(end, self.samples // self.hop)

    def take(self) -> Tensor:
        """The frames completed since the last take: [n_mels, ready - frames taken before]."""
        return self._frames(self.ready, final=False)

    def finish(self) -> Tensor:
        """The remaining valid frames (window zero-padded past the end) and LogMel's pad frames."""
        valid = self._frames(self.samples // self.hop, final=True)
        total = self.samples // self.hop + 1
        pad_to = self.logmel.cfg.pad_to
        if pad_to > 0:
            total = -(-total // pad_to) * pad_to
        pad = torch.full((valid.shape[0], total - self.frames), self.logmel.cfg.pad_value)
        self.frames = total
        return torch.cat((valid, pad), dim=1)

    def _frames(self, end: int, final: bool) -> Tensor:
        start = self.frames
        n_mels = self.logmel.cfg.features
        if end <= start:
            return torch.zeros(n_mels, 0)
        if self._pieces:
            self._y = torch.cat((self._y, torch.from_numpy(np.concatenate(self._pieces))))
            self._pieces = []
        lo, hi = start * self.hop - self.half, (end - 1) * self.hop + self.half
        seg = self._y[max(lo - self._base, 0): hi - self._base]
        left = max(self._base - lo, 0)  # stream start: center padding
        right = hi - lo - left - seg.numel()  # stream end (final only): center padding
        seg = torch.nn.functional.pad(seg, (left, right))
        spec = torch.stft(seg[None], n_fft=self.n_fft, hop_length=self.hop, win_length=self.logmel.cfg.win_length,
                          window=self.logmel.window, center=False, return_complex=True)
        ri = torch.view_as_real(spec)
        power = ri[..., 0].square() + ri[..., 1].square()
        if self.logmel.cfg.mag_power != 2.0:
            power = power.sqrt().pow(self.logmel.cfg.mag_power)
        mel = torch.matmul(self.logmel.fb, power)[0]
        if self.logmel.cfg.log:
            mel = self.logmel._log(mel)
        self.frames = end
        keep = end * self.hop - self.half  # first sample the next frame needs
        if keep > self._base:
            self._y = self._y[keep - self._base:]
            self._base = keep
        return mel


class SessionState(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no slot yet
    ACTIVE = "active"  # holds a pool slot
    DONE = "done"  # final result produced, slot returned
    FAILED = "failed"  # error or disconnect, slot returned


class SessionBase:
    """What every stream keeps whatever its chunking: identity, slot, state and transcript."""

    def __init__(self, stream_id: str, sample_rate: int, transcript: StreamTranscript):
        self.stream_id = stream_id
        self.sample_rate = sample_rate
        self.state = SessionState.WAITING
        self.slot: int | None = None
        self.admitted_at: float | None = None  # time.monotonic() when it got its slot
        self.ended = False  # client sent end of stream
        self.tokens: list[int] = []
        self.token_frames: list[int] = []
        self.token_durations: list[int] = []  # TDT predicted durations (empty for RNN-T)
        self.transcript = transcript  # cuts the tokens into committed segments + open tail
        self.steps = 0
        self.last_audio_time = time.monotonic()  # arrival of the newest audio (latency origin)
        self.audio_seconds = 0.0
        # decoded_seconds as each chunk was taken, for chunks whose tokens are not added yet
        # (the server takes a stream's next chunk while the engine still runs its last one)
        self._in_flight: collections.deque[float] = collections.deque()
        self._added_seconds = 0.0  # the same, for the last chunk whose tokens were added

    def _arrived(self, audio: np.ndarray) -> None:
        self.audio_seconds += audio.shape[0] / self.sample_rate
        self.last_audio_time = time.monotonic()

    def next_chunk(self):
        """The next chunk ready to run (the cursor advances past it), or None. Its tokens come
        back through `add`, chunks in the order taken."""
        chunk = self._cut_chunk()
        if chunk is not None:
            self._in_flight.append(self.decoded_seconds)
        return chunk

    def add(self, tokens: list[int], frames: list[int], durations: list[int]) -> None:
        """The tokens of the oldest chunk taken and not yet added."""
        self._added_seconds = self._in_flight.popleft()
        self.tokens.extend(tokens)
        self.token_frames.extend(frames)
        self.token_durations.extend(durations)
        self.steps += 1

    def prepare(self) -> None:
        """Do now what taking the next chunk will need, if its audio is all here (the server
        calls it as audio arrives, mostly while a step runs). Nothing by default."""

    @property
    def covered_seconds(self) -> float:
        """Audio the tokens added so far cover (s from the start): a transcript's times are cut
        to it, and its messages say it. `decoded_seconds` unless a chunk is still in flight."""
        return self._added_seconds if self._in_flight else self.decoded_seconds

    @property
    def complete(self) -> bool:
        """Ended, every chunk taken, and their tokens added: the final can be built."""
        return self.finished_input and not self._in_flight


class StreamSession(SessionBase):
    """Features, chunk cursor and transcript of one cache-aware stream (not thread-safe; one
    event loop)."""

    def __init__(self, stream_id: str, features: IncrementalLogMel, cfg: StreamingConfig,
                 transcript: StreamTranscript):
        super().__init__(stream_id, features.logmel.cfg.sample_rate, transcript)
        self.features = features
        self.cfg = cfg
        # Frames computed and not yet cut, from _feat_base on: the next chunk's pre-encode
        # cache, then what the last `take` (one per chunk cut) or `finish` added.
        self._feats = torch.zeros(features.logmel.cfg.features, 0)
        self._feat_base = 0
        self._next = 0  # first feature frame of the next chunk

    def push_audio(self, audio: np.ndarray) -> None:
        """float32 mono samples at the model's rate (their frames are computed by the chunk
        that needs them: `next_chunk`)."""
        self._arrived(audio)
        self.features.push(audio)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            rest = self.features.finish()
            if round(self.audio_seconds * self.sample_rate) < MIN_STREAM_SAMPLES:
                # Less than one 25 ms analysis window: the final is empty; the padded
                # features would decode into made-up tokens.
                self._feats = self._feats[:, :0]
                return
            self._append(rest)

    def _append(self, frames: Tensor) -> None:
        if frames.shape[1]:
            self._feats = torch.cat((self._feats, frames), dim=1)

    @property
    def _available(self) -> int:
        """Feature frames this stream can cut chunks from: held, or ready to be computed."""
        f = self.features
        return self._feat_base + self._feats.shape[1] + max(f.ready - f.frames, 0)

    def _cut_chunk(self) -> ChunkInput | None:
        """The next complete chunk (any remainder once ended), or None; advances the cursor."""
        if self.slot is None:
            return None
        span = next_chunk(self._next, self._available, self.ended, self.cfg)
        if span is None:
            return None
        self._features_through(span.end)  # computed already when `prepare` ran for it
        local = type(span)(span.start - self._feat_base, span.end - self._feat_base,
                           span.cache_start - self._feat_base, span.first)
        feats = chunk_features(self._feats, local, self.cfg)
        self._next = span.end
        # Keep only what the next chunk's pre-encode cache needs.
        keep_from = max(span.end - self.cfg.pre_encode_cache[1], self._feat_base)
        self._feats = self._feats[:, keep_from - self._feat_base:]
        self._feat_base = keep_from
        return ChunkInput(self.slot, feats.contiguous(), span.first)

    def prepare(self) -> None:
        """Compute the next chunk's features now if its audio is all here (once per chunk: a
        no-op until then and after): the server calls it as audio arrives, so the STFT mostly
        runs while a step does, and taking the chunk between two steps costs none (log-mel had
        been most of the event loop's time there)."""
        if self.slot is None or self.ended:
            return
        span = next_chunk(self._next, self._available, False, self.cfg)
        if span is not None:
            self._features_through(span.end)

    def _features_through(self, end: int) -> None:
        """Hold the feature frames up to `end`: the STFT of every ready frame, unless those are
        held already (once ended, `end` holds them all)."""
        if end > self._feat_base + self._feats.shape[1]:
            self._append(self.features.take())

    @property
    def decoded_seconds(self) -> float:
        """Audio covered by the chunks taken so far (s from the stream start); the last feature
        frame is centred on the last sample, so frames can span a hop more than the audio."""
        cfg = self.features.logmel.cfg
        return min(self._next * cfg.hop_length / cfg.sample_rate, self.audio_seconds)

    @property
    def finished_input(self) -> bool:
        """Ended and no chunk left to run."""
        if not self.ended:
            return False
        return next_chunk(self._next, self._available, True, self.cfg) is None
