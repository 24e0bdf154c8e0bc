"""The WebSocket transport of the streaming server: the same protocol as TCP (JSON text frames,
audio also as binary PCM frames), the same results, error codes and slot release."""
from __future__ import annotations

import asyncio
import json


from conftest import needs_shared
from transcribe.streaming import protocol as P
from transcribe.streaming.client import server_stats, stream_audio, stream_audio_ws
from transcribe.streaming.server import ServerConfig

import websockets  # noqa: E402,F401  (a dependency of the package: must import)
from websockets.asyncio.client import connect  # noqa: E402

from streaming_fixtures import files, model, serve_and_check  # noqa: F401  (fixtures)

pytestmark = needs_shared


def _run(model, cfg: ServerConfig, scenario):
    """`scenario(server, ws url, tcp address)` with both transports; the pool must be whole after."""
    return serve_and_check(model, cfg, lambda server, tcp: scenario(server, "ws://%s:%d" % server.ws_address, tcp))


async def _raw(url, frames: list[str | bytes], read_timeout=5.0) -> list[dict]:
    """Send frames as they are; every text frame back until the server closes."""
    out = []
    async with connect(url) as ws:
        for frame in frames:
            await ws.send(frame)
        while True:
            try:
                out.append(json.loads(await asyncio.wait_for(ws.recv(), read_timeout)))
            except websockets.exceptions.ConnectionClosed:
                return out


def _hello(sid="x", rate=16000, fmt="pcm16") -> str:
    return P.encode({"type": "hello", "stream_id": sid, "sample_rate": rate, "format": fmt}).decode()


def test_ws_binary_audio_gives_nemo_partials_alongside_tcp(model, files):
    f = files[2]

    async def scenario(server, url, tcp):
        return await asyncio.gather(  # both transports share one scheduler and pool
            stream_audio_ws(url, "ws", f["samples"], piece_s=0.25, realtime=False),
            stream_audio(*tcp, "tcp", f["samples"], piece_s=0.25, realtime=False))

    ws_run, tcp_run = _run(model, ServerConfig(port=0, ws_port=0, max_streams=2), scenario)
    assert ws_run.messages[0]["type"] == "ready"
    assert ws_run.transcripts() == f["partial_texts"]
    assert ws_run.final["text"] == tcp_run.final["text"] == f["offline_text"]
    assert ws_run.final["words"] == tcp_run.final["words"]


def test_ws_bad_clients_get_the_tcp_error_codes(model, files):
    audio = files[2]["samples"]

    async def scenario(server, url, tcp):
        codes = []
        for frames in (["not json"], [_hello(rate=8000)], [b"\x00\x00"],  # binary before hello
                       [_hello("b"), b"\x00\x00\x00"],  # 3 bytes: odd pcm16
                       [_hello("c"), '{"type": "pause"}']):
            msgs = await _raw(url, frames)
            codes.append(msgs[-1].get("code"))
        good = await stream_audio_ws(url, "good", audio, realtime=False, binary=False)  # base64 text frames
        return codes, good

    codes, good = _run(model, ServerConfig(port=0, ws_port=0, max_streams=2), scenario)
    assert codes == ["bad_message", "sample_rate", "bad_message", "bad_audio", "bad_message"]
    assert good.final["text"] == files[2]["offline_text"]


def test_ws_abrupt_close_and_silence_free_their_slots(model, files):
    audio = files[0]["samples"]

    async def scenario(server, url, tcp):
        for i in range(2):  # vanish mid-stream without a close frame
            ws = await connect(url)
            await ws.send(_hello(f"gone{i}"))
            await ws.send(P.encode_pcm(audio[: 16000 * (i + 1)]))
            await asyncio.sleep(0.1)
            ws.transport.abort()
        silent = await _raw(url, [_hello("silent")])
        good = await stream_audio_ws(url, "good", files[2]["samples"], realtime=False)
        return silent, good

    silent, good = _run(model, ServerConfig(port=0, ws_port=0, max_streams=2, idle_timeout_s=0.5), scenario)
    assert silent[-1]["code"] == "timeout"
    assert good.final["text"] == files[2]["offline_text"]


def test_a_client_the_server_stops_reading_cannot_park_its_uploads_in_websockets_queue(model):
    """The server stops reading a stream whose backlog is over --max-backlog (a queued one's at
    once), but websockets read ahead on its own: up to 16 frames of up to 4 MB a connection
    (64 MB; 5 GB over the default 16 streams and 64 waiting), 19 frames taken from a queued
    client before its sends blocked. Its queue is now 2 frames: a few more sit in the kernel's buffers."""
    frame = bytes(P.MAX_LINE_BYTES - 64)  # the largest binary frame the server takes: ~131 s PCM16

    async def scenario(server, url, tcp):
        reader, holder = await asyncio.open_connection(*tcp)  # holds the one slot
        holder.write(P.encode({"type": "hello", "stream_id": "holder", "sample_rate": 16000}))
        await holder.drain()
        ws = await connect(url, max_size=None)
        await ws.send(_hello("queued"))
        assert json.loads(await ws.recv())["type"] == "waiting"
        taken = 0
        try:
            while taken < 40:
                await asyncio.wait_for(ws.send(frame), 2.0)
                taken += 1
        except asyncio.TimeoutError:
            pass
        ws.transport.abort()
        holder.transport.abort()
        return taken

    taken = _run(model, ServerConfig(port=0, ws_port=0, max_streams=1, idle_timeout_s=30.0), scenario)
    assert 1 <= taken <= 10, taken  # 6 on the dev VM; 20 with websockets' default queue


def test_ws_frames_left_unread_do_not_hold_up_the_close(model, files):
    """websockets stops reading past its 2-frame queue: frames the handler never read (audio
    sent before a "busy" came back, or after "end") hid the client's close frame, and the
    server's close waited out websockets' 10 s timeout (a stop took 10.6 s). Unread frames are
    dropped while the connection closes, which now takes well under a second."""
    pcm = P.encode_pcm(files[2]["samples"][:1600])  # 0.1 s

    async def closed_after(url, frames) -> tuple[list[dict], float]:
        async with connect(url) as ws:
            for frame in frames:
                await ws.send(frame)
            msgs, t0 = [], asyncio.get_running_loop().time()
            async for m in ws:  # until the server's close frame
                msgs.append(json.loads(m))
            return msgs, asyncio.get_running_loop().time() - t0

    async def scenario(server, url, tcp):
        reader, holder = await asyncio.open_connection(*tcp)  # holds the one slot
        holder.write(P.encode({"type": "hello", "stream_id": "holder", "sample_rate": 16000}))
        await holder.drain()
        await reader.readline()
        busy = await closed_after(url, [_hello("busy")] + [pcm] * 5)
        holder.transport.abort()
        while (await server_stats(*tcp))["active"]:  # until the holder's slot is freed
            await asyncio.sleep(0.05)
        after_end = await closed_after(url, [_hello("late"), pcm, P.encode({"type": "end"}).decode()] + [pcm] * 5)
        return busy, after_end

    (busy, t_busy), (after_end, t_end) = _run(
        model, ServerConfig(port=0, ws_port=0, max_streams=1, max_waiting=0), scenario)
    assert busy[-1]["code"] == "busy" and t_busy < 3.0, (busy, t_busy)
    assert after_end[-1]["type"] == "final" and t_end < 3.0, (after_end, t_end)


def test_a_close_right_after_a_cancelled_read_does_not_raise():
    """The close reads what the client still sends: a read cancelled just before (an idle
    timeout's) and not yet over made websockets raise ConcurrencyError out of the close."""
    from websockets.asyncio.server import serve

    from transcribe.streaming.server import _WsTransport

    async def main():
        outcome = []

        async def handler(ws):
            t = _WsTransport(ws)
            reading = asyncio.ensure_future(t.recv())
            await asyncio.sleep(0.1)
            reading.cancel()  # as `_unless_late` does; no await before the close
            try:
                await t.close(False)
                outcome.append("closed")
            except BaseException as e:  # noqa: BLE001 (what escaped is the finding)
                outcome.append(repr(e))

        async with serve(handler, "127.0.0.1", 0) as server:
            async with connect("ws://127.0.0.1:%d" % server.sockets[0].getsockname()[1]) as ws:
                async for _ in ws:
                    pass
            await asyncio.sleep(0.3)
        return outcome

    assert asyncio.run(main()) == ["closed"]
