"""Admission and batching of streams over one slot pool: `StreamPool` (cache-aware
checkpoints) or `ChunkedStreamPool` (offline-trained ones, chunked with left/right context).

`Scheduler.open` gives a new stream a slot, or a place in a bounded waiting queue (FIFO);
`collect` takes at most one ready chunk from every active stream (whatever its position) for
one batched pool step; `apply` hands the step's tokens back to the sessions and turns them into
transcript updates (committed segments, the open tail, the final: `transcript.py`); `close`
returns a slot (finish, error or disconnect) and admits the next waiting stream. A stream
whose own chunking or final update raises is closed as failed and reported by `take_failed`,
so one stream's bad audio ends that stream, not the step or the server.
Not thread-safe: the server calls everything from its event loop except the pool's `step`
(pure compute, in the engine process under `transcribe serve`), and slots closed while a step
runs are released only after it (`begin_step` / `end_step`), so a step never writes a reused
slot.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from engines.choices import DEFAULT_CHUNK_MS, DEFAULT_LEFT_MS, DEFAULT_RIGHT_MS, STREAM_BACKENDS
from engines.chunked_pool import ChunkContext, ChunkedStreamPool, ChunkWindow, window_profiles
from engines.decode_stages import Hypothesis
from engines.encoder_backend import make_backend, resolve_backend
from engines.loader import OptionError
from engines.parakeet import ParakeetEngine
from engines.stream_pool import ChunkInput, StreamPool
from engines.streaming_encoder import CacheAwareEncoder
from engines.transducer import TransducerDecoder
from transcribe import heap
from transcribe.features import LogMel
from transcribe.streaming.chunked_session import ChunkedSession
from transcribe.streaming.session import IncrementalLogMel, SessionBase, SessionState, StreamSession
from transcribe.streaming.transcript import StreamTranscript, Update


class Busy(RuntimeError):
    """Every slot is taken and the waiting queue is full."""


@dataclass(frozen=True)
class SchedulerConfig:
    """max_streams: pool slots (streams decoded concurrently); max_waiting: streams queued
    for a slot before new ones are refused; max_batch: chunks per step (0 = max_streams)."""

    max_streams: int = 16
    max_waiting: int = 64
    max_batch: int = 0

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_waiting < 0 or self.max_batch < 0:
            raise ValueError(f"invalid scheduler config {self}")


class StreamingModel:
    """The pieces of a loaded transducer `.nemo` that streaming needs. A cache-aware checkpoint
    streams with its own trained chunking; an offline-trained one streams in chunks with left
    and right context (`chunk_ms`, `left_ms`, `right_ms`; None = NeMo's 2 s / 10 s / 2 s), its
    encoder through `encoder_backend` (auto: CUDA graphs per window bucket on CUDA, eager torch
    on the CPU; `engines.chunked_pool`)."""

    def __init__(self, engine: ParakeetEngine, chunk_ms: float | None = None, left_ms: float | None = None,
                 right_ms: float | None = None, encoder_backend: str = "auto"):
        if engine.kind not in ("rnnt", "tdt") or not isinstance(engine.decoder, TransducerDecoder):
            raise ValueError(f"streaming needs an RNN-T or TDT transducer checkpoint, {engine.name} decodes {engine.kind}")
        if encoder_backend not in STREAM_BACKENDS:
            raise OptionError(f"--encoder-backend {encoder_backend!r}: streaming takes one of {', '.join(STREAM_BACKENDS)}")
        self.engine = engine
        if str(engine.device) == "cpu" and engine.encoder_backend.name == "torch":
            engine.encoder.pack_layers()  # a step's tens of rows run faster packed (see pack_layers)
        self.logmel = LogMel(engine.feature_cfg, torch.from_numpy(engine.frontend.window),
                             torch.from_numpy(engine.frontend.fb))
        self.sample_rate = engine.sample_rate
        given = [v for v in (chunk_ms, left_ms, right_ms) if v is not None]
        try:
            self.encoder: CacheAwareEncoder | None = CacheAwareEncoder(engine.encoder)
        except ValueError:  # not trained for cache-aware streaming: chunked with context instead
            self.encoder = None
        if self.encoder is not None and encoder_backend not in ("auto", "torch"):
            raise OptionError(f"{engine.name} is a cache-aware streaming checkpoint: its chunk step runs in eager "
                              "torch; --encoder-backend is for offline-trained models")
        self.encoder_backend = resolve_backend(encoder_backend, str(engine.device))  # ValueError: cuda-graphs on a CPU
        if self.encoder is not None and given:  # OptionError: a usage error (exit 2), as --language for Parakeet
            raise OptionError(f"{engine.name} is a cache-aware streaming checkpoint: it streams with its own "
                             "trained chunk size; --chunk-ms/--left-context-ms/--right-context-ms are for "
                             "offline-trained models")
        self.frame_samples = engine.feature_cfg.hop_length * engine.encoder.cfg.subsampling_factor
        self.context: ChunkContext | None = None
        if self.encoder is None:
            try:
                self.context = ChunkContext.from_ms(
                    DEFAULT_CHUNK_MS if chunk_ms is None else chunk_ms, DEFAULT_LEFT_MS if left_ms is None else left_ms,
                    DEFAULT_RIGHT_MS if right_ms is None else right_ms, self.frame_samples, self.sample_rate)
            except ValueError as e:  # a --chunk-ms shorter than this model's encoder frame
                raise OptionError(f"--chunk-ms/--left-context-ms/--right-context-ms: {e}") from None

        self.front = StreamingFront(engine.tokenizer, engine.kind, engine.timing, self.logmel, self.sample_rate,
                                    self.frame_samples, engine.feature_cfg.hop_length,
                                    None if self.encoder is None else self.encoder.cfg, self.context, str(engine.device))

    # What sessions and transcripts need is the front's (the server process holds only that).
    @property
    def mode(self) -> str:
        return self.front.mode

    @property
    def device(self) -> str:
        return self.front.device

    @property
    def step_seconds(self) -> float:
        return self.front.step_seconds

    def new_session(self, stream_id: str) -> StreamSession | ChunkedSession:
        return self.front.new_session(stream_id)

    def update(self, session: SessionBase, final: bool) -> Update:
        return self.front.update(session, final)

    @classmethod
    def from_nemo(cls, path: str | Path, **context_ms: float | None) -> "StreamingModel":
        return cls(ParakeetEngine.from_nemo(path, device="cpu"), **context_ms)

    def new_pool(self, max_streams: int) -> StreamPool | ChunkedStreamPool:
        """The preallocated slots; ValueError (a message, not the allocator's traceback) when
        `max_streams` of them do not fit in memory."""
        try:
            if self.encoder is None:
                # A step decodes a chunk, or a last window's chunk + right (+1: its encoder length
                # rounds up over the whole window).
                return ChunkedStreamPool(self._window_encoder(max_streams), self.engine.decoder, self.logmel,
                                         max_streams, self.context.chunk + self.context.right + 1)
            return StreamPool(self.encoder, self.engine.decoder, max_streams)
        except RuntimeError as e:
            if not heap.out_of_memory(e):
                raise
            raise ValueError(f"cannot allocate the cache pool for --max-streams {max_streams} on "
                             f"{self.engine.device}: {str(e).strip().splitlines()[0][:200]}; "
                             "give a smaller --max-streams") from None

    def _window_encoder(self, max_streams: int):
        """The chunked pool's encoder backend, bucketed on this chunking's window widths and,
        for CUDA graphs, captured now (startup) for batches of up to `max_streams` windows; a
        capture that fails or disagrees with eager turns the graphs off, logged once."""
        e = self.engine
        profiles = window_profiles(self.context, self.frame_samples, e.feature_cfg, max_streams)
        backend = make_backend(self.encoder_backend, e.encoder, profiles, e.feature_cfg.pad_value)
        backend.reserve(max_streams)
        return backend


class StreamingFront:
    """The half of a `StreamingModel` that makes sessions (features, chunking) and turns their
    tokens into transcripts: no weights, no pool. `transcribe serve` keeps only this in its
    event-loop process, the model and its pool living in the engine process
    (`engine_process.py`), which sends it over (it pickles: tokenizer, log-mel tables, configs)."""

    def __init__(self, tokenizer, kind: str, timing, logmel: LogMel, sample_rate: int, frame_samples: int,
                 hop_length: int, encoder_cfg, context: ChunkContext | None, device: str):
        self.tokenizer, self.kind, self.timing, self.logmel = tokenizer, kind, timing, logmel
        self.sample_rate, self.frame_samples, self.hop_length = sample_rate, frame_samples, hop_length
        self.encoder_cfg, self.context, self.device = encoder_cfg, context, device

    @property
    def mode(self) -> str:
        return "cache-aware" if self.context is None else "chunked"

    @property
    def step_seconds(self) -> float:
        """Audio a stream holds beyond what it has decoded before its next step can run: the
        chunk, and an offline-trained model's right context."""
        if self.context is not None:
            samples = (self.context.chunk + self.context.right) * self.frame_samples
        else:
            samples = max(self.encoder_cfg.chunk_frames) * self.hop_length
        return samples / self.sample_rate

    def new_session(self, stream_id: str) -> StreamSession | ChunkedSession:
        transcript = StreamTranscript(self.tokenizer, self.kind, self.timing)
        if self.context is not None:
            return ChunkedSession(stream_id, self.sample_rate, self.frame_samples, self.context, transcript)
        return StreamSession(stream_id, IncrementalLogMel(self.logmel), self.encoder_cfg, transcript)

    def update(self, session: SessionBase, final: bool) -> Update:
        """The transcript's new segments, open tail and (when `final`) the whole of it, in
        seconds from the stream start, none past the audio its tokens cover (a token's frame, 80 ms, or
        TDT duration can reach beyond it; offline results are cut back the same way,
        transcribe.stitching)."""
        return session.transcript.update(session.tokens, session.token_frames, session.token_durations,
                                         session.covered_seconds, final)


class Scheduler:
    """See the module docstring."""

    def __init__(self, model: StreamingModel | StreamingFront, cfg: SchedulerConfig, pool=None):
        """pool: the slot pool to step (a `StreamPool`, `ChunkedStreamPool`, or the engine
        process's `RemotePool`, of at least `cfg.max_streams` slots); None: `model.new_pool`, here."""
        self.model, self.cfg = model, cfg
        self.pool = model.new_pool(cfg.max_streams) if pool is None else pool
        if self.pool.max_streams < cfg.max_streams:
            raise ValueError(f"the pool has {self.pool.max_streams} slots, fewer than max_streams={cfg.max_streams}")
        self.active: dict[str, SessionBase] = {}
        self.waiting: collections.deque[SessionBase] = collections.deque()
        self._stepping = False
        self._deferred: list[int] = []
        self._admitted: list[SessionBase] = []  # WAITING -> ACTIVE since take_admitted()
        self._failed: list[tuple[SessionBase, Exception]] = []  # closed by their own error (take_failed)
        self.steps = 0  # pool steps `run_once` ran (a call that only finished ended streams runs none)

    def open(self, stream_id: str) -> SessionBase:
        """A new session, ACTIVE with a slot or WAITING in the queue; Busy if both are full;
        ValueError if the id is already in use."""
        if stream_id in self.active or any(s.stream_id == stream_id for s in self.waiting):
            raise ValueError(f"stream id {stream_id!r} is already in use")
        session = self.model.new_session(stream_id)
        if self.pool.free_slots and not self.waiting:
            self._activate(session)
        elif len(self.waiting) < self.cfg.max_waiting:
            self.waiting.append(session)
        else:
            raise Busy(f"server busy: {self.cfg.max_streams} streams active and {len(self.waiting)} waiting")
        return session

    def _activate(self, session: SessionBase) -> None:
        session.slot = self.pool.acquire()
        session.admitted_at = time.monotonic()
        session.state = SessionState.ACTIVE
        self.active[session.stream_id] = session

    def close(self, session: SessionBase, failed: bool = False) -> None:
        """Return the session's slot (deferred past a running step) and admit waiting streams
        (see `take_admitted`). Idempotent."""
        if session.state in (SessionState.DONE, SessionState.FAILED):
            return
        if session.state == SessionState.WAITING:
            self.waiting.remove(session)
        elif session.slot is not None:
            self.active.pop(session.stream_id, None)
            if self._stepping:
                self._deferred.append(session.slot)
            else:
                self.pool.release(session.slot)
            session.slot = None
        session.state = SessionState.FAILED if failed else SessionState.DONE
        self._admit()

    def _admit(self) -> None:
        while self.waiting and self.pool.free_slots:
            session = self.waiting.popleft()
            self._activate(session)
            self._admitted.append(session)

    def take_admitted(self) -> list[SessionBase]:
        """Sessions given a slot since the last call (the server tells their clients)."""
        out, self._admitted = self._admitted, []
        return out

    def collect(self) -> tuple[list[SessionBase], list[ChunkInput | ChunkWindow]]:
        """At most one ready chunk per active stream, up to max_batch, oldest streams first."""
        limit = self.cfg.max_batch or self.cfg.max_streams
        sessions, chunks = [], []
        for session in list(self.active.values()):
            if len(chunks) >= limit:
                break
            try:
                chunk = session.next_chunk()
            except Exception as e:  # this stream's audio tripped a bug: it fails, not the others
                self._fail(session, e)
                continue
            if chunk is not None:
                sessions.append(session)
                chunks.append(chunk)
        return sessions, chunks

    def prepare(self, session: SessionBase) -> None:
        """What `collect` will need of the stream, done now if its next chunk's audio is all
        here (its features: `StreamSession.prepare`): the server calls it as audio arrives,
        mostly while a step runs, so that taking the chunks between two steps computes no
        STFT. A stream whose own work raises fails alone, as in `collect` (`take_failed`)."""
        try:
            session.prepare()
        except Exception as e:
            self._fail(session, e)

    def begin_step(self) -> None:
        self._stepping = True

    def end_step(self) -> None:
        """Release the slots closed during the step and admit waiting streams into them."""
        self._stepping = False
        for slot in self._deferred:
            self.pool.release(slot)
        self._deferred.clear()
        self._admit()

    def apply(self, sessions: Sequence[SessionBase], hyps: Sequence[Hypothesis]
              ) -> list[tuple[SessionBase, Update]]:
        """Record a step's tokens; (session, its transcript update) for each live session (the
        update has `final` when its stream is over). A final session is closed (its slot
        returned) before this returns."""
        out = []
        for session, hyp in zip(sessions, hyps):
            if session.state != SessionState.ACTIVE:
                continue  # closed (disconnected) while its chunk was running
            session.add(hyp.tokens, hyp.frames, hyp.durations)
            final = session.complete
            out.append((session, self.model.update(session, final)))
            if final:
                self.close(session)
        return out

    def finish_idle(self) -> list[tuple[SessionBase, Update]]:
        """Ended streams with no chunk left (e.g. too short for one chunk): final now."""
        out = []
        for session in list(self.active.values()):
            try:
                if session.complete:
                    out.append((session, self.model.update(session, True)))
                    self.close(session)
            except Exception as e:  # as in collect: this stream fails alone
                self._fail(session, e)
        return out

    def _fail(self, session: SessionBase, e: Exception) -> None:
        self.close(session, failed=True)
        self._failed.append((session, e))

    def take_failed(self) -> list[tuple[SessionBase, Exception]]:
        """Sessions closed (FAILED) since the last call because their own chunking or final
        update raised, with the exception (the server tells their clients)."""
        out, self._failed = self._failed, []
        return out

    def run_once(self) -> list[tuple[SessionBase, Update]]:
        """collect -> pool step -> apply, synchronously (tests, `transcribe stream`); a
        session's own error is raised here (after it is closed)."""
        sessions, chunks = self.collect()
        self._raise_failed()
        out = self.apply(sessions, self.pool.step(chunks)) if chunks else []
        self.steps += bool(chunks)
        out += self.finish_idle()
        self._raise_failed()
        return out

    def _raise_failed(self) -> None:
        if self._failed:
            raise self.take_failed()[0][1]
