"""Fixtures shared by the streaming tests: the cache-aware fixture model and its recordings.
Import them into a test module (`from streaming_fixtures import model, files`)."""
from __future__ import annotations

import asyncio
import json

import pytest
import soundfile as sf

from conftest import NEMO_REF
from transcribe.streaming.scheduler import Scheduler, SchedulerConfig, StreamingModel
from transcribe.streaming.server import ServerConfig, StreamServer
from transcribe.streaming.session import SessionState
from transcribe.streaming.transcript import Update, join_texts

VARIANT = NEMO_REF / "rnnt_streaming_tiny"


@pytest.fixture(scope="module")
def model() -> StreamingModel:
    return StreamingModel.from_nemo(VARIANT / "model.nemo")


@pytest.fixture(scope="module")
def files() -> list[dict]:
    """reference.json's per-file entries, each with its 16 kHz float32 `samples`."""
    meta = json.loads((VARIANT / "reference.json").read_text())
    out = []
    for f in meta["files"]:
        audio, sr = sf.read(str((NEMO_REF / f["audio"]).resolve()), dtype="float32")
        if sr != 16000:
            raise ValueError(f"{f['audio']}: {sr} Hz, the fixture's references are at 16 kHz")
        out.append({**f, "samples": audio})
    return out


class RunningText:
    """One stream's transcript so far after each update (what a client shows: the committed
    segments, then the open tail). At the final it checks that the segments and the tail
    joined are the final's text and words, built at once over every token."""

    def __init__(self):
        self.texts, self.words = [], []

    def __call__(self, update: Update) -> str:
        self.texts += [seg.text for seg in update.segments]
        self.words += [w for seg in update.segments for w in seg.words]
        so_far = join_texts([*self.texts, update.open.text])
        if update.final is not None:
            assert so_far == update.final.text
            assert self.words + update.open.words == update.final.words
        return so_far


def _pushed_alone(model: StreamingModel, audio, piece: int):
    """A scheduler of one slot, and its one session holding the whole file, pushed in
    `piece`-sample pieces, and ended."""
    sched = Scheduler(model, SchedulerConfig(max_streams=1))
    s = sched.open("a")
    for i in range(0, audio.shape[0], piece):
        s.push_audio(audio[i: i + piece])
    s.end()
    return sched, s


def stream_alone(model: StreamingModel, audio, piece: int, after_step=None):
    """The whole file through one session of its own in `piece`-sample pieces, all pushed, then
    stepped to the end; `after_step(pool)` runs after every step. -> (session, partial texts)."""
    sched, s = _pushed_alone(model, audio, piece)
    texts, running = [], RunningText()
    while s.state == SessionState.ACTIVE:
        texts += [running(u) for _, u in sched.run_once()]
        if after_step is not None:
            after_step(sched.pool)
    return s, texts


def updates_of(model: StreamingModel, audio, piece: int, pipelined: bool) -> list[tuple[str, float, bool]]:
    """The whole file through one session, pushed in `piece`-sample pieces and ended, then
    stepped: (transcript so far, the session's covered seconds, final?, the update's word
    times) after each update.
    `pipelined`: as the server steps, each step's tokens are added only after the next step's
    chunk was taken and run, so the stream always has a chunk in flight when its tokens come."""
    sched, s = _pushed_alone(model, audio, piece)
    out, running, pending, most_in_flight = [], RunningText(), None, 0

    def record(updates):
        out.extend((running(u), s.covered_seconds, u.final is not None,
                    [(w.start, w.end) for r in (*u.segments, u.open) for w in r.words]) for _, u in updates)

    while s.state == SessionState.ACTIVE:
        sessions, chunks = sched.collect()
        most_in_flight = max(most_in_flight, len(s._in_flight))
        step = (sessions, sched.pool.step(chunks)) if chunks else None
        if pipelined:
            step, pending = pending, step
        if step is not None:
            record(sched.apply(*step))
        if pending is None:
            record(sched.finish_idle())
    assert most_in_flight == (2 if pipelined and len(out) > 1 else 1)
    return out


def serve_and_check(model: StreamingModel, cfg: ServerConfig, scenario):
    """Start a server (TCP, and WebSocket when cfg.ws_port is set), run
    `await scenario(server, (tcp host, tcp port))`, then check the pool is whole again: every
    slot free, no stream active or waiting. Returns the scenario's result."""
    async def main():
        server = StreamServer(model, cfg)
        tcp = await server.start()
        try:
            out = await scenario(server, tcp)
            for _ in range(50):  # disconnect handling runs in the server's own tasks
                if server.scheduler.pool.free_slots == cfg.max_streams:
                    break
                await asyncio.sleep(0.02)
            assert server.scheduler.pool.free_slots == cfg.max_streams
            assert not server.scheduler.active and not server.scheduler.waiting
            return out
        finally:
            await server.stop()
    return asyncio.run(main())


def drive_staggered(sched: Scheduler, samples: list, paces: list[int], inspect, max_ticks: int = 2000):
    """Stream i opens at tick i and sends `paces[i]` samples a tick until its audio ends; every
    tick steps whoever has work (`inspect(batch)` sees each batch the pool steps). Returns the
    sessions and each stream's result texts, once every stream is done."""
    sessions, cursor, texts = {}, {}, {i: [] for i in range(len(samples))}
    running = {i: RunningText() for i in range(len(samples))}
    for tick in range(max_ticks):
        if tick < len(samples):
            sessions[tick], cursor[tick] = sched.open(f"s{tick}"), 0
        for i, s in sessions.items():
            a = samples[i]
            if cursor[i] < a.shape[0]:
                s.push_audio(a[cursor[i]: cursor[i] + paces[i]])
                cursor[i] += paces[i]
                if cursor[i] >= a.shape[0]:
                    s.end()
        stepped, batch = sched.collect()
        inspect(batch)
        for s, u in sched.apply(stepped, sched.pool.step(batch)) + sched.finish_idle():
            i = int(s.stream_id[1:])
            texts[i].append(running[i](u))
        if len(sessions) == len(samples) and all(s.state == SessionState.DONE for s in sessions.values()):
            break
    return sessions, texts


def serve_until_it_stops(model, cfg: ServerConfig, first_bytes: bytes, pool=None) -> tuple[list[dict], int]:
    """`serve_forever` on cfg.port, one client sending `first_bytes`, reading every message
    until the server closes its connection -> (the messages, serve_forever's exit status)."""
    from transcribe.streaming.server import serve_forever

    async def main():
        server = asyncio.ensure_future(serve_forever(model, cfg, pool))
        for _ in range(100):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", cfg.port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        writer.write(first_bytes)
        await writer.drain()
        msgs = []
        while line := await asyncio.wait_for(reader.readline(), 10.0):
            msgs.append(json.loads(line))
        writer.close()
        return msgs, await asyncio.wait_for(server, 10.0)

    return asyncio.run(main())
