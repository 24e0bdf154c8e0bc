"""A TCP streaming client (tests, `bench/streaming_load.py`): sends a file's samples in
pieces, at real-time pace or as fast as possible, and records every reply with its arrival time.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from transcribe.streaming import protocol as P


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


async def _reader(reader: asyncio.StreamReader, run: ClientRun) -> None:
    while line := await reader.readline():
        run.messages.append(P.parse_json(line))
        run.arrivals.append(time.monotonic())


async def stream_audio(host: str, port: int, stream_id: str, audio: np.ndarray, sample_rate: int = 16000,
                       piece_s: float = 0.1, realtime: bool = True, fmt: str = "pcm16",
                       timeout_s: float = 60.0) -> ClientRun:
    """Stream `audio` (float32 mono) and wait for the final result, an error or the close."""
    run = ClientRun(stream_id)
    reader, writer = await asyncio.open_connection(host, port, limit=P.MAX_LINE_BYTES)
    task = asyncio.create_task(_reader(reader, run))
    try:
        writer.write(P.encode({"type": "hello", "stream_id": stream_id, "sample_rate": sample_rate, "format": fmt}))
        piece = max(int(piece_s * sample_rate), 1)
        t0 = time.monotonic()
        for i in range(0, audio.shape[0], piece):
            if run.error is not None:
                break
            if realtime:  # send piece k once its audio would have been recorded
                await asyncio.sleep(max(t0 + (i + piece) / sample_rate - time.monotonic(), 0.0))
            writer.write(P.encode(P.audio_message(audio[i: i + piece], fmt)))
            await writer.drain()
            run.sent.append((time.monotonic(), min(i + piece, audio.shape[0]) / sample_rate))
        writer.write(P.encode({"type": "end"}))
        await writer.drain()
        run.end_time = time.monotonic()
        await asyncio.wait_for(task, timeout_s)
    except (ConnectionError, asyncio.TimeoutError) as e:
        run.messages.append({"type": "error", "code": "client", "message": repr(e)})
        run.arrivals.append(time.monotonic())
    finally:
        task.cancel()
        writer.close()
    return run
