"""Admission and batching of streams over one `StreamPool`.

`Scheduler.open` gives a new stream a slot, or a place in a bounded waiting queue (FIFO);
`collect` takes at most one ready chunk from every active stream (whatever its position) for
one batched pool step; `apply` hands the step's tokens back to the sessions and turns them into
partial / final results; `close` returns a slot (finish, error or disconnect) and admits the
next waiting stream. Not thread-safe: the server calls everything from its event loop except
`StreamingModel.run` (pure compute on the pool), and slots closed while a step runs are
released only after it (`begin_step` / `end_step`), so a step never writes a reused slot.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from engines.decode_stages import Hypothesis
from engines.parakeet import ParakeetEngine
from engines.stream_pool import ChunkInput, StreamPool
from engines.streaming_encoder import CacheAwareEncoder
from transcribe.features import LogMel
from transcribe.results import Result
from transcribe.streaming.session import IncrementalLogMel, SessionState, StreamSession
from transcribe.timestamps import build_result


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
    """The pieces of a loaded cache-aware RNN-T `.nemo` that streaming needs."""

    def __init__(self, engine: ParakeetEngine):
        if engine.kind != "rnnt":
            raise ValueError(f"streaming needs a cache-aware RNN-T checkpoint, {engine.name} is {engine.kind}")
        self.engine = engine
        self.encoder = CacheAwareEncoder(engine.encoder)  # ValueError for offline-trained encoders
        self.logmel = LogMel(engine.feature_cfg, torch.from_numpy(engine.frontend.window),
                             torch.from_numpy(engine.frontend.fb))
        self.sample_rate = engine.sample_rate

    @classmethod
    def from_nemo(cls, path: str | Path) -> "StreamingModel":
        return cls(ParakeetEngine.from_nemo(path, device="cpu"))

    def new_pool(self, max_streams: int) -> StreamPool:
        return StreamPool(self.encoder, self.engine.decoder, max_streams)

    def new_session(self, stream_id: str) -> StreamSession:
        return StreamSession(stream_id, IncrementalLogMel(self.logmel), self.encoder.cfg)

    def result(self, session: StreamSession) -> Result:
        """Text and word times (s from the stream start) of everything decoded so far."""
        e = self.engine
        return build_result(e.tokenizer, session.tokens, session.token_frames, [], "rnnt", e.timing)


class Scheduler:
    """See the module docstring."""

    def __init__(self, model: StreamingModel, cfg: SchedulerConfig):
        self.model, self.cfg = model, cfg
        self.pool = model.new_pool(cfg.max_streams)
        self.active: dict[str, StreamSession] = {}
        self.waiting: collections.deque[StreamSession] = collections.deque()
        self._stepping = False
        self._deferred: list[int] = []
        self._admitted: list[StreamSession] = []  # WAITING -> ACTIVE since take_admitted()

    def open(self, stream_id: str) -> StreamSession:
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

    def _activate(self, session: StreamSession) -> None:
        session.slot = self.pool.acquire()
        session.state = SessionState.ACTIVE
        self.active[session.stream_id] = session

    def close(self, session: StreamSession, failed: bool = False) -> None:
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

    def take_admitted(self) -> list[StreamSession]:
        """Sessions given a slot since the last call (the server tells their clients)."""
        out, self._admitted = self._admitted, []
        return out

    def collect(self) -> tuple[list[StreamSession], list[ChunkInput]]:
        """At most one ready chunk per active stream, up to max_batch, oldest streams first."""
        limit = self.cfg.max_batch or self.cfg.max_streams
        sessions, chunks = [], []
        for session in self.active.values():
            if len(chunks) >= limit:
                break
            chunk = session.next_chunk()
            if chunk is not None:
                sessions.append(session)
                chunks.append(chunk)
        return sessions, chunks

    def begin_step(self) -> None:
        self._stepping = True

    def end_step(self) -> None:
        """Release the slots closed during the step and admit waiting streams into them."""
        self._stepping = False
        for slot in self._deferred:
            self.pool.release(slot)
        self._deferred.clear()
        self._admit()

    def apply(self, sessions: Sequence[StreamSession], hyps: Sequence[Hypothesis]
              ) -> list[tuple[StreamSession, Result, bool]]:
        """Record a step's tokens; (session, transcript so far, is_final) for each live session.
        A final session is closed (its slot returned) before this returns."""
        out = []
        for session, hyp in zip(sessions, hyps):
            if session.state != SessionState.ACTIVE:
                continue  # closed (disconnected) while its chunk was running
            session.add(hyp.tokens, hyp.frames)
            final = session.finished_input
            out.append((session, self.model.result(session), final))
            if final:
                self.close(session)
        return out

    def finish_idle(self) -> list[tuple[StreamSession, Result, bool]]:
        """Ended streams with no chunk left (e.g. too short for one chunk): final now."""
        out = []
        for session in list(self.active.values()):
            if session.finished_input:
                out.append((session, self.model.result(session), True))
                self.close(session)
        return out

    def run_once(self) -> list[tuple[StreamSession, Result, bool]]:
        """collect -> pool step -> apply, synchronously (tests, `transcribe stream`)."""
        sessions, chunks = self.collect()
        out = self.apply(sessions, self.pool.step(chunks)) if chunks else []
        return out + self.finish_idle()
