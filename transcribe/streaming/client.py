"""A streaming client over TCP or WebSocket (tests, `bench/streaming_load.py`): sends a file's
samples in pieces, at real-time pace or as fast as possible, and records every reply with its
arrival time. `websockets` is imported only by `stream_audio_ws`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from transcribe.streaming import protocol as P
from transcribe.streaming.transcript import join_texts


@dataclass
class ClientRun:
    """What one client saw. Times are `time.monotonic()` seconds."""

    stream_id: str
    messages: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    sent: list[tuple[float, float]] = field(default_factory=list)  # (time, audio seconds sent so far)
    end_time: float | None = None

    @property
    def final(self) -> dict | None:
        return next((m for m in self.messages if m["type"] == "final"), None)

    @property
    def error(self) -> dict | None:
        return next((m for m in self.messages if m["type"] == "error"), None)

    def transcripts(self) -> list[str]:
        """The transcript so far after each step: the segments received before its partial,
        then the partial's text (protocol.py; the last step's equals the final)."""
        out, committed = [], []
        for m in self.messages:
            if m["type"] == "segment":
                committed.append(m["text"])
            elif m["type"] == "partial":
                out.append(join_texts([*committed, m["text"]]))
        return out

    def final_latency(self) -> float | None:
        """Seconds from sending "end" (after the last audio) to the final result."""
        for m, t in zip(self.messages, self.arrivals):
            if m["type"] == "final" and self.end_time is not None:
                return t - self.end_time
        return None

    def partial_latencies(self) -> list[float]:
        """Per partial: arrival minus when the audio it covers had been sent."""
        out = []
        for m, t in zip(self.messages, self.arrivals):
            if m["type"] == "partial":
                sent_at = next((ts for ts, secs in self.sent if secs >= m["audio_seconds"] - 1e-6), None)
                if sent_at is not None:
                    out.append(t - sent_at)
        return out


Send = Callable[[dict], Awaitable[None]]
SendAudio = Callable[[np.ndarray], Awaitable[None]]


async def _reader(reader: asyncio.StreamReader, run: ClientRun) -> None:
    while line := await reader.readline():
        _record(run, line)


def _record(run: ClientRun, message: bytes | str) -> None:
    run.messages.append(P.parse_json(message))
    run.arrivals.append(time.monotonic())


async def _feed(run: ClientRun, send: Send, send_audio: SendAudio, audio: np.ndarray, sample_rate: int,
                piece_s: float, realtime: bool, fmt: str) -> None:
    """hello, the audio in pieces (stopping early on an error reply), end."""
    await send({"type": "hello", "stream_id": run.stream_id, "sample_rate": sample_rate, "format": fmt})
    piece = max(int(piece_s * sample_rate), 1)
    t0 = time.monotonic()
    for i in range(0, audio.shape[0], piece):
        if run.error is not None:
            break
        recorded = min(i + piece, audio.shape[0]) / sample_rate  # the last piece may be short
        if realtime:  # send piece k once its audio would have been recorded
            await asyncio.sleep(max(t0 + recorded - time.monotonic(), 0.0))
        await send_audio(audio[i: i + piece])
        run.sent.append((time.monotonic(), recorded))
    await send({"type": "end"})
    run.end_time = time.monotonic()


def _client_error(run: ClientRun, e: BaseException) -> None:
    run.messages.append({"type": "error", "code": "client", "message": repr(e)})
    run.arrivals.append(time.monotonic())


async def stream_audio(host: str, port: int, stream_id: str, audio: np.ndarray, sample_rate: int = 16000,
                       piece_s: float = 0.1, realtime: bool = True, fmt: str = "pcm16",
                       timeout_s: float = 60.0) -> ClientRun:
    """Stream `audio` (float32 mono) and wait for the final result, an error or the close."""
    run = ClientRun(stream_id)
    reader, writer = await asyncio.open_connection(host, port, limit=P.MAX_LINE_BYTES)
    task = asyncio.create_task(_reader(reader, run))

    async def send(msg: dict) -> None:
        writer.write(P.encode(msg))
        await writer.drain()

    async def send_audio(samples: np.ndarray) -> None:
        await send(P.audio_message(samples, fmt))

    try:
        await _feed(run, send, send_audio, audio, sample_rate, piece_s, realtime, fmt)
        await asyncio.wait_for(task, timeout_s)
    except (ConnectionError, asyncio.TimeoutError) as e:
        _client_error(run, e)
    finally:
        task.cancel()
        writer.close()
    return run


async def server_stats(host: str, port: int, timeout_s: float = 10.0) -> dict:
    """The server's `stats` message (protocol.py): what its steps have cost so far."""
    reader, writer = await asyncio.open_connection(host, port, limit=P.MAX_LINE_BYTES)
    try:
        writer.write(P.encode({"type": "stats"}))
        await writer.drain()
        return P.parse_json(await asyncio.wait_for(reader.readline(), timeout_s))
    finally:
        writer.close()


async def stream_audio_ws(url: str, stream_id: str, audio: np.ndarray, sample_rate: int = 16000,
                          piece_s: float = 0.1, realtime: bool = True, fmt: str = "pcm16",
                          binary: bool = True, timeout_s: float = 60.0) -> ClientRun:
    """`stream_audio` over WebSocket (`url` like ws://host:port); binary: audio as raw PCM
    binary frames, else as base64 "audio" messages in text frames."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    run = ClientRun(stream_id)
    async with connect(url, max_size=P.MAX_LINE_BYTES, compression=None) as ws:
        async def read() -> None:
            async for frame in ws:  # ends when the server closes (after the final or an error)
                _record(run, frame)

        async def send(msg: dict) -> None:
            await ws.send(P.encode(msg).decode())

        async def send_audio(samples: np.ndarray) -> None:
            await (ws.send(P.encode_pcm(samples, fmt)) if binary else send(P.audio_message(samples, fmt)))

        task = asyncio.create_task(read())
        try:
            await _feed(run, send, send_audio, audio, sample_rate, piece_s, realtime, fmt)
            await asyncio.wait_for(task, timeout_s)
        except (ConnectionClosed, asyncio.TimeoutError) as e:
            _client_error(run, e)
        finally:
            task.cancel()
    return run
