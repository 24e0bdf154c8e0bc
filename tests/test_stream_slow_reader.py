"""A client that keeps sending audio but never reads its results is dropped: after one send has
blocked for `send_timeout_s`, or once `send_queue` results are waiting. Its slot returns to the
pool, a stream beside it is served throughout, and the server takes new streams after.

The server's socket buffers are shrunk for these tests (kernel send buffer, asyncio's write
buffer) so that a non-reading client blocks the server's sends after a few results instead of a
few megabytes of them; the drop logic under test is the server's own."""
from __future__ import annotations

import asyncio
import socket

import pytest

from conftest import needs_shared
from transcribe.streaming import protocol as P
from transcribe.streaming.client import stream_audio
from transcribe.streaming.server import ServerConfig, StreamServer
from transcribe.streaming.session import SessionState

from streaming_fixtures import files, model, serve_and_check  # noqa: F401  (fixtures)

pytestmark = needs_shared

HIGH_WATER = 4096  # bytes asyncio buffers per connection before a send (drain) blocks


@pytest.fixture
def small_send_buffers(monkeypatch):
    original = StreamServer._handle_tcp

    async def handle(self, reader, writer):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer.transport.set_write_buffer_limits(high=HIGH_WATER)
        await original(self, reader, writer)

    monkeypatch.setattr(StreamServer, "_handle_tcp", handle)


async def _not_reading(server: StreamServer, host: str, port: int, audio, limit_s: float = 60.0) -> dict:
    """Stream `audio` over and over without ever reading, until the server drops the stream
    (or `limit_s`). Returns when the server's sends to it first blocked, when its session
    failed, the most results ever queued for it, and whether its socket was then reset."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a small window
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, P.encode({"type": "hello", "stream_id": "slow", "sample_rate": 16000,
                                            "format": "pcm16"}))
    piece, sent = 8000, 0
    start = loop.time()
    client = blocked_at = dropped_at = None
    most_queued = 0
    try:
        while loop.time() - start < limit_s:
            client = client or server._clients.get("slow")
            if client is not None:
                if blocked_at is None and client.transport.writer.transport.get_write_buffer_size() > HIGH_WATER:
                    blocked_at = loop.time()
                most_queued = max(most_queued, client.out.qsize())
                if client.session.state == SessionState.FAILED:
                    dropped_at = loop.time()
                    break
            at = sent % audio.shape[0]
            await loop.sock_sendall(sock, P.encode(P.audio_message(audio[at: at + piece])))
            sent += piece
            await asyncio.sleep(0.02)
        reset = False
        for _ in range(100):  # the server aborted the connection: our sends fail soon
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, P.encode(P.audio_message(audio[:piece]))), 1.0)
            except (ConnectionError, asyncio.TimeoutError):
                reset = True
                break
            await asyncio.sleep(0.05)
    finally:
        sock.close()
    return {"blocked_at": blocked_at, "dropped_at": dropped_at, "most_queued": most_queued, "reset": reset,
            "start": start}


@pytest.mark.parametrize("send_queue, send_timeout_s, why", [(256, 1.0, "send timeout"), (4, 60.0, "queue full")])
def test_slow_reader_is_dropped_and_others_are_served(model, files, small_send_buffers, send_queue,
                                                      send_timeout_s, why):
    cfg = ServerConfig(port=0, max_streams=2, max_waiting=2, idle_timeout_s=30.0, send_queue=send_queue,
                       send_timeout_s=send_timeout_s)

    async def scenario(server, tcp):
        host, port = tcp
        good = asyncio.create_task(stream_audio(host, port, "good", files[2]["samples"], piece_s=0.25,
                                                realtime=False))
        slow = await _not_reading(server, host, port, files[0]["samples"])
        beside = await good
        after = await stream_audio(host, port, "after", files[3]["samples"], realtime=False)
        return slow, beside, after

    slow, beside, after = serve_and_check(model, cfg, scenario)
    assert slow["blocked_at"] is not None, "the server's sends to the non-reading client never blocked"
    assert slow["dropped_at"] is not None, f"a client that never reads was not dropped ({why})"
    waited = slow["dropped_at"] - slow["blocked_at"]
    if why == "send timeout":  # the queue had room: the timeout dropped it, about when configured
        assert slow["most_queued"] < send_queue
        assert waited <= send_timeout_s + 1.5, f"dropped {waited:.1f} s after its sends blocked"
    else:
        assert waited <= 5.0, f"dropped {waited:.1f} s after its sends blocked"
    assert slow["dropped_at"] - slow["start"] < cfg.idle_timeout_s  # not the idle timeout
    assert slow["reset"]
    assert beside.error is None and beside.final["text"] == files[2]["offline_text"]
    assert after.messages[0]["type"] == "ready" and after.final["text"] == files[3]["offline_text"]
