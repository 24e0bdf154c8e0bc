"""The TCP streaming server: results equal streaming alone, and bad clients (malformed
messages, wrong sample rate, disconnects, silence, too many at once) get a clear error or wait,
while the server stays up and the pool is whole again afterwards."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from conftest import needs_shared
from transcribe.streaming import protocol as P
from transcribe.streaming.client import server_stats, stream_audio
from transcribe.streaming.server import ServerConfig

from streaming_fixtures import files, model, serve_and_check, serve_until_it_stops, updates_of  # noqa: F401  (fixtures)

pytestmark = needs_shared


def _run(model, cfg: ServerConfig, scenario):
    """`scenario(server, host, port)` against a TCP server; the pool must be whole after."""
    return serve_and_check(model, cfg, lambda server, tcp: scenario(server, *tcp))


async def _raw(host, port, lines: list[bytes], read_timeout=5.0, half_close=False) -> list[dict]:
    """Send `lines` as they are (then close the sending side: `half_close`); every message
    back until the server closes."""
    reader, writer = await asyncio.open_connection(host, port)
    for line in lines:
        writer.write(line)
    await writer.drain()
    if half_close:
        writer.write_eof()
    out = []
    try:
        while line := await asyncio.wait_for(reader.readline(), read_timeout):
            out.append(json.loads(line))
    finally:
        writer.close()
    return out


def _hello(sid="x", rate=16000, fmt="pcm16") -> bytes:
    return P.encode({"type": "hello", "stream_id": sid, "sample_rate": rate, "format": fmt})


def test_stream_over_tcp_gives_nemo_partials(model, files):
    f = files[2]

    async def scenario(server, host, port):
        return await stream_audio(host, port, "one", f["samples"], piece_s=0.25, realtime=False)

    run = _run(model, ServerConfig(port=0, max_streams=2), scenario)
    partials = run.transcripts()
    assert run.messages[0]["type"] == "ready"
    assert partials == f["partial_texts"]
    # sent faster than real time, its steps were pipelined: each partial still says the audio
    # its own tokens cover, not the audio of a chunk already taken after it
    covered = [secs for _, secs, *_ in updates_of(model, f["samples"], 4000, pipelined=False)]
    assert [m["audio_seconds"] for m in run.messages if m["type"] == "partial"] == covered
    assert run.final["text"] == f["offline_text"]
    assert all(w["start"] <= w["end"] for w in run.final["words"])


def test_a_stats_request_reports_what_the_steps_cost(model, files):
    """A monitor's `{"type": "stats"}` (instead of hello) gets one "stats" message and the
    connection closes: before any stream no step; after two streams their steps, the chunks
    they ran, step wall-time percentiles, the pool's seconds per stage, and the pool whole."""
    async def scenario(server, host, port):
        before = await server_stats(host, port)
        runs = await asyncio.gather(*(stream_audio(host, port, f"s{k}", files[k]["samples"], piece_s=0.25,
                                                   realtime=False) for k in (1, 2)))
        after = await server_stats(host, port)
        raw = await _raw(host, port, [P.encode({"type": "stats"})])  # then the server closes
        return before, runs, after, raw, server.steps

    before, runs, after, raw, steps = _run(model, ServerConfig(port=0, max_streams=2), scenario)
    assert before["type"] == "stats" and before["steps"] == 0 and before["step_ms"] is None
    assert before["mode"] == "cache-aware" and before["free_slots"] == before["max_streams"] == 2
    assert [r.final["text"] for r in runs] == [files[k]["offline_text"] for k in (1, 2)]
    chunks = sum(len([m for m in r.messages if m["type"] == "partial"]) for r in runs)
    assert after["steps"] == steps >= 2 and after["chunks"] == chunks and after["max_chunks_per_step"] <= 2
    assert 0 < after["step_ms"]["p50"] <= after["step_ms"]["p95"] <= after["step_ms"]["max"]
    assert set(after["stage_seconds"]) == {"batch", "encoder", "decoder"}
    assert all(v > 0 for v in after["stage_seconds"].values()) and after["apply_seconds"] > 0
    assert 0 < after["collect_seconds"] < after["uptime_s"]
    assert sum(after["stage_seconds"].values()) <= after["uptime_s"]
    assert (after["active"], after["waiting"], after["free_slots"]) == (0, 0, 2)
    assert len(raw) == 1 and raw[0]["type"] == "stats"


def test_bad_clients_get_clear_errors_and_server_stays_up(model, files):
    audio = files[2]["samples"]

    async def scenario(server, host, port):
        codes = []
        for lines in ([b"not json\n"], [b'{"no": "type"}\n'], [_hello(rate=8000)],
                      [P.encode({"type": "audio", "data": "AAAA"})],
                      [_hello("b"), b'{"type": "audio", "data": "***"}\n'],
                      [_hello("c"), b'{"type": "audio", "data": "AAAA"}\n'],  # 3 bytes: odd pcm16
                      [_hello("d", fmt="mp3")], [_hello("e"), b'{"type": "pause"}\n'],
                      # a format that is no string, JSON nested deeper than the parser's recursion
                      [P.encode({"type": "hello", "stream_id": "f", "sample_rate": 16000, "format": ["pcm16"]})],
                      [b"[" * 100_000 + b"]" * 100_000 + b"\n"],
                      [_hello("g"), b'{"type": "audio", "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"],
                      # an integer past Python's 4,300 digits (a ValueError, not a JSONDecodeError),
                      # in a hello and after one; ids no reply could carry or a log line should
                      [b'{"type": "hello", "stream_id": "h", "sample_rate": ' + b"9" * 5000 + b"}\n"],
                      [_hello("i"), b'{"type": "audio", "data": "", "n": ' + b"9" * 5000 + b"}\n"],
                      [b'{"type": "hello", "stream_id": "j\\ud800", "sample_rate": 16000}\n'],
                      [b'{"type": "hello", "stream_id": "k\\nl", "sample_rate": 16000}\n'],
                      # interleaved stereo would be read as mono twice as long
                      [P.encode({"type": "hello", "stream_id": "m", "sample_rate": 16000, "channels": 2})]):
            msgs = await _raw(host, port, lines)
            codes.append(msgs[-1].get("code"))
        good = await stream_audio(host, port, "good", audio, realtime=False)
        return codes, good, msgs[-1]

    codes, good, stereo = _run(model, ServerConfig(port=0, max_streams=2), scenario)
    assert "mono" in stereo["message"], stereo
    assert codes == ["bad_message", "bad_message", "sample_rate", "bad_message", "bad_audio", "bad_audio",
                     "bad_message", "bad_message", "bad_message", "bad_message", "bad_message",
                     "bad_message", "bad_message", "bad_message", "bad_message", "bad_message"]
    assert good.final["text"] == files[2]["offline_text"]


def test_abrupt_disconnects_and_silence_free_their_slots(model, files):
    audio = files[0]["samples"]

    async def scenario(server, host, port):
        for i in range(3):  # vanish mid-stream, after a few chunks
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_hello(f"gone{i}"))
            writer.write(P.encode(P.audio_message(audio[: 16000 * (i + 1)])))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.transport.abort()
        silent = await _raw(host, port, [_hello("silent")], read_timeout=5.0)
        good = await stream_audio(host, port, "good", files[2]["samples"], realtime=False)
        return silent, good

    silent, good = _run(model, ServerConfig(port=0, max_streams=2, idle_timeout_s=0.5), scenario)
    assert silent[-1]["code"] == "timeout"
    assert good.final["text"] == files[2]["offline_text"]


def test_idle_means_no_bytes_not_no_whole_message_and_lines_are_bounded(model, files):
    """A client whose one message takes longer than the idle timeout to arrive (a slow uplink)
    is not dropped while its bytes keep coming; a line with no newline within the limit is
    refused; a last message without a newline before the client half-closes still counts."""
    audio = files[2]["samples"]
    message = P.encode(P.audio_message(audio))

    async def scenario(server, host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_hello("slow"))
        step = len(message) // 12 + 1
        for i in range(0, len(message), step):  # ~1.2 s for one message, idle timeout 0.4 s
            writer.write(message[i:i + step])
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(P.encode({"type": "end"}).rstrip(b"\n"))  # no newline: then the client half-closes
        await writer.drain()
        writer.write_eof()
        slow = []
        while line := await asyncio.wait_for(reader.readline(), 10.0):
            slow.append(json.loads(line))
        writer.close()
        endless = await _raw(host, port, [_hello("endless"), b'{"type": "audio", "data": "' + b"A" * (P.MAX_LINE_BYTES + 8)])
        return slow, endless

    slow, endless = _run(model, ServerConfig(port=0, max_streams=2, idle_timeout_s=0.4), scenario)
    assert [m["type"] for m in slow if m["type"] in ("ready", "final", "error")] == ["ready", "final"], slow
    assert slow[-1]["text"] == files[2]["offline_text"]
    assert endless[-1]["code"] == "bad_message" and "message too long" in endless[-1]["message"]


def test_a_client_that_half_closes_without_end_is_told_why_it_gets_no_final(model, files):
    """EOF before "end" (shutdown(SHUT_WR), `nc -N`) drops the stream, as a disconnect does (a
    crashed client's kernel sends the same FIN: its backlog is not decoded for nobody), but a
    client still reading got a silent close; it now gets the reason. EOF before any hello (a
    port probe) stays quiet."""
    audio = files[2]["samples"]

    async def scenario(server, host, port):
        got = [await _raw(host, port, lines, read_timeout=10.0, half_close=True)
               for lines in ([_hello("half"), P.encode(P.audio_message(audio[:64000]))], [])]
        good = await stream_audio(host, port, "good", audio, realtime=False)
        return got, good

    (half, probe), good = _run(model, ServerConfig(port=0, max_streams=1), scenario)
    assert half[0]["type"] == "ready" and half[-1]["type"] == "error", half
    assert half[-1]["code"] == "bad_message" and 'before "end"' in half[-1]["message"]
    assert not any(m["type"] == "final" for m in half) and probe == []
    assert good.final["text"] == files[2]["offline_text"]


def test_twice_max_streams_wait_their_turn_or_are_refused(model, files):
    async def scenario(server, host, port):
        runs = [stream_audio(host, port, f"s{i}", files[i]["samples"], piece_s=0.2, realtime=False)
                for i in range(5)]
        return await asyncio.gather(*runs)

    runs = _run(model, ServerConfig(port=0, max_streams=2, max_waiting=2), scenario)
    busy = [r for r in runs if r.error is not None]
    done = [r for r in runs if r.final is not None]
    assert len(busy) == 1 and busy[0].error["code"] == "busy"
    assert len(done) == 4
    assert any(r.messages[0]["type"] == "waiting" for r in done)
    for r in done:
        assert r.final["text"] == files[int(r.stream_id[1:])]["offline_text"]


def test_a_queued_stream_waits_for_its_slot_without_timing_out(model, files):
    """The server keeps a queued client waiting, so no idle or final timeout runs while it is
    queued: one that waits for "ready" before sending, and one that sent everything and "end"
    at once, both get their final after a stream that holds the only slot for several idle
    timeouts (the first was dropped after idle_timeout_s, the second after final_timeout_s)."""
    async def scenario(server, host, port):
        holder = asyncio.create_task(stream_audio(host, port, "holder", files[0]["samples"][: 16000 * 3],
                                                  piece_s=0.25, realtime=True))
        await asyncio.sleep(0.3)
        reader, writer = await asyncio.open_connection(host, port, limit=P.MAX_LINE_BYTES)
        writer.write(_hello("polite"))
        await writer.drain()
        assert json.loads(await reader.readline())["type"] == "waiting"
        eager = asyncio.create_task(_raw(host, port, [_hello("eager"), P.encode(P.audio_message(files[2]["samples"])),
                                                      P.encode({"type": "end"})], read_timeout=20.0))
        ready = json.loads(await asyncio.wait_for(reader.readline(), 20.0))
        assert ready["type"] == "ready"
        writer.write(P.encode(P.audio_message(files[1]["samples"])) + P.encode({"type": "end"}))
        await writer.drain()
        polite = [json.loads(line) async for line in reader]
        writer.close()
        return await holder, polite, await eager

    holder, polite, eager = _run(model, ServerConfig(port=0, max_streams=1, idle_timeout_s=0.6,
                                                     final_timeout_s=2.0), scenario)
    assert holder.final is not None
    assert polite[-1]["type"] == "final" and polite[-1]["text"] == files[1]["offline_text"]
    assert eager[-1]["type"] == "final" and eager[-1]["text"] == files[2]["offline_text"]


def test_a_long_stream_commits_segments_and_its_partials_stay_short():
    """A minute of speech through a chunked TDT model over TCP: segments arrive numbered in
    order, each partial names the segment it will become and holds only the words after the
    last one (about MAX_OPEN_S at most), and segments + last partial joined are the final,
    which equals streaming the file alone through the scheduler."""
    import soundfile as sf

    from conftest import NEMO_REF, SPEECH
    from streaming_fixtures import stream_alone
    from transcribe.streaming.scheduler import StreamingModel
    from transcribe.streaming.transcript import MAX_OPEN_S

    chunked = StreamingModel.from_nemo(NEMO_REF / "tdt_tiny" / "model.nemo", chunk_ms=1000, left_ms=4000,
                                       right_ms=500)
    audio, sr = sf.read(str(SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"), dtype="float32",
                        frames=60 * 16000)
    assert sr == 16000

    async def scenario(server, host, port):
        return await stream_audio(host, port, "long", audio, piece_s=0.5, realtime=False, timeout_s=120)

    run = _run(chunked, ServerConfig(port=0, max_streams=1), scenario)
    segments = [m for m in run.messages if m["type"] == "segment"]
    partials = [m for m in run.messages if m["type"] == "partial"]
    assert [m["index"] for m in segments] == list(range(len(segments))) and len(segments) >= 5
    seen = 0
    for m in run.messages:
        seen += m["type"] == "segment"
        if m["type"] == "partial":
            assert m["index"] == seen
            if m["words"]:
                assert m["words"][-1]["start"] - m["words"][0]["start"] <= MAX_OPEN_S + 1.5
    assert max(len(m["words"]) for m in partials) < len(run.final["words"]) / 3
    assert run.transcripts()[-1] == run.final["text"]
    assert [w for m in segments for w in m["words"]] == run.final["words"][:sum(len(m["words"]) for m in segments)]
    _, alone = stream_alone(chunked, audio, 8000)
    assert run.final["text"] == alone[-1]


def test_a_backlog_uploaded_at_once_gets_its_final_however_long_it_takes(model, files):
    """A client that sends a recording faster than real time and then "end" leaves the server
    a backlog of steps. While they run, the stream is making progress: its final must come,
    however much longer than final_timeout_s the backlog takes (it was dropped with a
    "timeout" error final_timeout_s after "end", the final lost)."""
    import time

    import numpy as np

    audio = np.concatenate([f["samples"] for f in files] * 2)

    async def scenario(server, host, port):
        step = server.scheduler.pool.step

        def slow_step(chunks):  # a bigger model on a busy CPU: each step takes a while
            time.sleep(0.05)
            return step(chunks)

        server.scheduler.pool.step = slow_step
        lines = [_hello("upload"), *(P.encode(P.audio_message(audio[i: i + 32000]))
                                     for i in range(0, audio.shape[0], 32000)), P.encode({"type": "end"})]
        t0 = time.monotonic()
        out = await _raw(host, port, lines, read_timeout=30.0)
        return out, time.monotonic() - t0

    cfg = ServerConfig(port=0, max_streams=1, final_timeout_s=0.3)
    out, took = _run(model, cfg, scenario)
    assert took > 2 * cfg.final_timeout_s  # the backlog took longer than the timeout
    assert [m["type"] for m in out if m["type"] in ("final", "error")] == ["final"]


def test_a_stream_given_its_slot_late_in_a_timeout_window_gets_the_whole_timeout(model, files):
    """The idle timeout runs only while a client holds a slot: one admitted from the queue
    has the whole idle_timeout_s from its "ready" to send audio, however long it waited
    (it was dropped when the wait's current timeout window ran out, just after "ready")."""
    async def scenario(server, host, port):
        holder_r, holder_w = await asyncio.open_connection(host, port)
        holder_w.write(_hello("holder"))
        await holder_w.drain()
        assert json.loads(await holder_r.readline())["type"] == "ready"
        reader, writer = await asyncio.open_connection(host, port, limit=P.MAX_LINE_BYTES)
        writer.write(_hello("late"))
        await writer.drain()
        assert json.loads(await reader.readline())["type"] == "waiting"
        await asyncio.sleep(0.8)  # most of late's first 1 s window
        holder_w.transport.abort()  # its slot goes to "late"
        assert json.loads(await asyncio.wait_for(reader.readline(), 5.0))["type"] == "ready"
        await asyncio.sleep(0.5)  # a client on the far side of a slow link: well within 1 s
        writer.write(P.encode(P.audio_message(files[2]["samples"])) + P.encode({"type": "end"}))
        await writer.drain()
        out = [json.loads(line) async for line in reader]
        writer.close()
        return out

    out = _run(model, ServerConfig(port=0, max_streams=1, idle_timeout_s=1.0), scenario)
    assert out[-1]["type"] == "final", out[-1]


def test_a_client_uploading_faster_than_the_steps_is_read_only_as_they_catch_up(model, files):
    """A stream's undecoded audio stays within max_backlog_s (plus the message that crossed it):
    past it the server stops reading the connection until the steps catch up, so an upload of
    hours holds that much memory, not all of it. The transcript is the same as unhindered. The
    limit is never below a step's audio plus 1 s (`_caught_up`): 2.12 s for this model's 1.12 s."""
    import time

    import numpy as np

    audio = np.concatenate([f["samples"] for f in files] * 2)
    backlog: list[float] = []

    async def scenario(server, host, port):
        step = server.scheduler.pool.step

        def slow_step(chunks):  # a bigger model on a busy CPU
            backlog.extend(s.audio_seconds - s.decoded_seconds for s in server.scheduler.active.values())
            time.sleep(0.02)
            return step(chunks)

        server.scheduler.pool.step = slow_step
        return await stream_audio(host, port, "upload", audio, piece_s=0.5, realtime=False)

    run = _run(model, ServerConfig(port=0, max_streams=1, max_backlog_s=2.0), scenario)
    assert run.final["text"] == _run(model, ServerConfig(port=0, max_streams=1), lambda s, h, p: stream_audio(
        h, p, "alone", audio, piece_s=0.5, realtime=False)).final["text"]
    limit = max(2.0, model.step_seconds + 1.0)
    assert audio.shape[0] / 16000 > 10 and max(backlog) <= limit + 0.5 + 1e-6, max(backlog)


def test_a_backlog_limit_below_a_chunk_and_its_right_context_cannot_stall_a_stream(files):
    """An offline-trained model steps once a chunk and its right context have arrived (2 s + 2 s):
    a --max-backlog under that would stop reading before any step could run, for good. The
    limit is raised to what a step needs, and the stream ends as it does unhindered."""
    import numpy as np

    from conftest import NEMO_REF
    from transcribe.streaming.scheduler import StreamingModel

    chunked = StreamingModel.from_nemo(NEMO_REF / "tdt_tiny" / "model.nemo")
    assert chunked.step_seconds == 4.0
    audio = np.concatenate([f["samples"] for f in files])

    def run(cfg):
        return _run(chunked, cfg, lambda s, h, p: asyncio.wait_for(
            stream_audio(h, p, "x", audio, piece_s=0.5, realtime=False), 60.0)).final["text"]

    assert run(ServerConfig(port=0, max_streams=1, max_backlog_s=1.0)) == run(ServerConfig(port=0, max_streams=1))


def test_a_backlog_limit_below_a_cache_aware_chunk_cannot_stall_a_stream(model, files):
    """The cache-aware fixture steps 1.05 s, then 1.12 s chunks: 2.15 s and "end" under a 1 s
    limit left 1.1 s undecoded, too little for a step and more than the limit, and the
    handler never read the "end" (found in review)."""
    audio = files[2]["samples"][: int(2.15 * 16000)]

    async def scenario(server, host, port):
        return await _raw(host, port, [_hello("u"), P.encode(P.audio_message(audio)), P.encode({"type": "end"})],
                          read_timeout=15.0)

    out = _run(model, ServerConfig(port=0, max_streams=1, max_backlog_s=1.0), scenario)
    assert out[-1]["type"] == "final", out


def test_a_step_failing_with_any_exception_fails_its_streams_not_the_server(model, files):
    """A bug in a step (here a ValueError, not the RuntimeError a device error is) ends the
    streams in that step with "internal"; the engine goes on serving the next ones."""
    audio = files[2]["samples"]

    async def scenario(server, host, port):
        step, calls = server.scheduler.pool.step, []

        def failing_once(chunks):
            calls.append(len(chunks))
            if len(calls) == 1:
                raise ValueError("a bug in the step")
            return step(chunks)

        server.scheduler.pool.step = failing_once
        failed = await stream_audio(host, port, "failed", audio, realtime=False)
        good = await stream_audio(host, port, "good", audio, realtime=False)
        return failed, good

    failed, good = _run(model, ServerConfig(port=0, max_streams=2, final_timeout_s=3.0), scenario)
    assert failed.error["code"] == "internal" and "ValueError: a bug in the step" in failed.error["message"]
    assert good.error is None and good.final["text"] == files[2]["offline_text"]


def test_an_engine_dying_outside_a_step_stops_the_server_with_1(model, files, monkeypatch):
    """A bug outside a step (finishing idle streams, here) ends the engine loop: serving on
    would leave every stream to its timeout, so the server stops, each client told why, and
    serve_forever returns 1 (the exit status)."""
    from transcribe.streaming.scheduler import Scheduler

    def broken(self):
        raise KeyError("a bug outside the step")

    monkeypatch.setattr(Scheduler, "finish_idle", broken)
    with socket.socket() as s:  # a free port for serve_forever, which binds its own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    msgs, status = serve_until_it_stops(model, ServerConfig(port=port, max_streams=2),
                                        _hello("a") + P.encode(P.audio_message(files[0]["samples"][:32000])))
    assert status == 1
    assert msgs[-1]["code"] == "internal" and "KeyError" in msgs[-1]["message"], msgs


def test_stopping_tells_every_client_and_frees_every_slot(model, files):
    """stop() (SIGINT / SIGTERM) ends each stream with a "shutdown" error, flushed before the
    connection closes; a WebSocket closes with 1001 (going away), not 1006 (abnormal)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed
    from transcribe.streaming.server import StreamServer

    audio = files[0]["samples"][:32000]

    async def main():
        server = StreamServer(model, ServerConfig(port=0, ws_port=0, max_streams=1, max_waiting=2))
        host, port = await server.start()
        reader, writer = await asyncio.open_connection(host, port)
        # No step runs when stop() comes (none is running: the case where freeing tcp's slot
        # could hand it to the queued ws stream): its audio is sent after the ws is queued.
        writer.write(_hello("tcp"))
        await writer.drain()
        assert json.loads(await reader.readline())["type"] == "ready"
        ws = await connect("ws://%s:%d" % server.ws_address)
        await ws.send(_hello("ws").decode())
        assert json.loads(await ws.recv())["type"] == "waiting"  # queued: told too
        writer.write(P.encode(P.audio_message(audio)))
        await writer.drain()
        await server.stop()
        tcp_msgs = [json.loads(line) for line in (await reader.read()).splitlines()]
        ws_msgs = []
        try:
            while True:
                ws_msgs.append(json.loads(await ws.recv()))
        except ConnectionClosed as e:
            close_code = e.rcvd.code if e.rcvd else None
        writer.close()
        return server, tcp_msgs, ws_msgs, close_code

    server, tcp_msgs, ws_msgs, close_code = asyncio.run(main())
    assert tcp_msgs[-1]["code"] == "shutdown", tcp_msgs
    assert [(m["type"], m.get("code")) for m in ws_msgs] == [("error", "shutdown")]  # no slot given while stopping
    assert close_code == 1001
    assert server.scheduler.pool.free_slots == 1
    assert not server.scheduler.active and not server.scheduler.waiting


def test_a_client_vanishing_while_its_backlog_is_decoded_frees_its_slot_at_once(model, files):
    """A client that uploaded far ahead of the steps and sent "end" is not read again: its
    handler waits for the final and cannot see it vanish, but the results sent after each
    step can. Its stream ends at the first failed send, not after its whole backlog (up to
    --max-backlog) has been decoded for nobody."""
    import time

    import numpy as np

    audio = np.concatenate([f["samples"] for f in files] * 3)

    async def scenario(server, host, port):
        step, steps = server.scheduler.pool.step, []

        def slow_step(chunks):  # a bigger model on a busy CPU
            steps.append(time.monotonic())
            time.sleep(0.05)
            return step(chunks)

        server.scheduler.pool.step = slow_step
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_hello("gone"))
        for i in range(0, audio.shape[0], 8000):
            writer.write(P.encode(P.audio_message(audio[i:i + 8000])))
        writer.write(P.encode({"type": "end"}))
        while "gone" not in server.scheduler.active or not server.scheduler.active["gone"].ended:
            await asyncio.sleep(0.01)  # until the server has read the "end"
        gone_at = time.monotonic()
        writer.transport.abort()
        for _ in range(200):
            if server.scheduler.pool.free_slots == 1:
                break
            await asyncio.sleep(0.02)
        after = [t for t in steps if t > gone_at]
        total = sum(1 for _ in range(0, audio.shape[0], 16000))  # about a step a second of audio
        return len(after), total

    after, total = _run(model, ServerConfig(port=0, max_streams=1, max_backlog_s=30.0), scenario)
    assert total > 50 and after <= 3, (after, total)  # before: the 30 s backlog's steps (27)


def test_a_failed_step_does_not_fail_a_new_stream_that_took_a_closed_ones_id(model, files):
    """A client gone while its step runs frees its stream id; one reconnecting under that id
    before the step fails is a new stream that was not in the step: it is not told "internal"
    (the failed step's streams are matched by session, not by id)."""
    import threading

    audio = files[2]["samples"]

    async def scenario(server, host, port):
        step, started, release, calls = server.scheduler.pool.step, threading.Event(), threading.Event(), []

        def failing_first(chunks):
            calls.append(len(chunks))
            if len(calls) == 1:
                started.set()
                release.wait(10.0)
                raise ValueError("a bug in the step")
            return step(chunks)

        server.scheduler.pool.step = failing_first
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_hello("x") + P.encode(P.audio_message(audio[:48000])))
        await writer.drain()
        while not started.is_set():
            await asyncio.sleep(0.01)
        writer.transport.abort()  # gone while its step runs
        while "x" in server.scheduler.active:
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.3, release.set)  # fails once "x" is back
        return await stream_audio(host, port, "x", audio, realtime=False)

    run = _run(model, ServerConfig(port=0, max_streams=2), scenario)
    assert run.error is None, run.messages[-2:]
    assert run.final["text"] == files[2]["offline_text"]


def test_stopping_just_after_a_final_sends_no_shutdown_after_it(model, files):
    """A stream whose final is queued when the server stops ended well: it gets its final and
    its connection closes, with no "shutdown" error after the final (as a failed step sends
    no "internal" after one)."""
    from transcribe.streaming.server import StreamServer

    audio = files[0]["samples"][:32000]

    async def main():
        server = StreamServer(model, ServerConfig(port=0, max_streams=1))
        host, port = await server.start()
        deliver, stopping = server._deliver, []

        def deliver_then_stop(updates):
            updates = list(updates)
            deliver(updates)
            if any(u.final is not None for _, u in updates) and not stopping:
                stopping.append(asyncio.ensure_future(server.stop()))  # SIGINT before the handler ran

        server._deliver = deliver_then_stop
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_hello("a") + P.encode(P.audio_message(audio)) + P.encode({"type": "end"}))
        await writer.drain()
        msgs = [json.loads(line) for line in (await asyncio.wait_for(reader.read(), 10.0)).splitlines()]
        writer.close()
        await stopping[0]
        return server, msgs

    server, msgs = asyncio.run(main())
    assert msgs[-1]["type"] == "final", [m["type"] for m in msgs]
    assert server.scheduler.pool.free_slots == 1


@pytest.mark.parametrize("where", ["next_chunk", "prepare"])
def test_a_stream_whose_own_chunking_raises_fails_alone(model, files, monkeypatch, where):
    """A bug tripped by one stream's audio while its chunk is cut (outside the batched step),
    or while its features are computed ahead as its audio arrives, ends that stream with
    "internal"; it stopped the whole server. The stream beside it ends well, and `run_once`
    (`transcribe stream`) raises the error instead of looping."""
    from transcribe.streaming.scheduler import Scheduler, SchedulerConfig
    from transcribe.streaming.session import SessionState, StreamSession

    original = getattr(StreamSession, where)

    def buggy(self):
        if self.stream_id == "bad" and self.audio_seconds > 1.0:
            raise ZeroDivisionError("a bug on this stream's audio")
        return original(self)

    monkeypatch.setattr(StreamSession, where, buggy)
    audio = files[2]["samples"]

    async def scenario(server, host, port):
        return await asyncio.gather(stream_audio(host, port, "bad", audio, piece_s=0.25, realtime=False),
                                    stream_audio(host, port, "good", audio, piece_s=0.25, realtime=False))

    bad, good = _run(model, ServerConfig(port=0, max_streams=2, final_timeout_s=3.0), scenario)
    assert bad.error["code"] == "internal" and "ZeroDivisionError" in bad.error["message"], bad.messages[-1]
    assert good.error is None and good.final["text"] == files[2]["offline_text"]
    if where == "prepare":  # only the server computes ahead
        return
    sched = Scheduler(model, SchedulerConfig(max_streams=1))
    session = sched.open("bad")
    session.push_audio(audio)
    with pytest.raises(ZeroDivisionError):
        sched.run_once()
    assert session.state == SessionState.FAILED and sched.pool.free_slots == 1


def test_a_message_that_cannot_be_sent_ends_its_stream_in_the_log_not_the_server(model, files, monkeypatch,
                                                                                  caplog):
    """A message the transport fails on with anything but a lost connection or a timeout (here
    a TypeError, as an unserialisable field would give) drops that client with its traceback
    in the log; the stream beside it ends well and every slot is freed."""
    import logging

    from transcribe.streaming import server as S

    send = S._TcpTransport.send

    async def failing_for_bad(self, msg):
        if msg.get("stream_id") == "bad" and msg["type"] == "partial":
            raise TypeError("Object of type set is not JSON serializable")
        await send(self, msg)

    monkeypatch.setattr(S._TcpTransport, "send", failing_for_bad)
    audio = files[2]["samples"]

    async def scenario(server, host, port):
        return await asyncio.gather(stream_audio(host, port, "bad", audio, piece_s=0.25, realtime=False),
                                    stream_audio(host, port, "good", audio, piece_s=0.25, realtime=False))

    with caplog.at_level(logging.INFO, logger=S.log.name):
        bad, good = _run(model, ServerConfig(port=0, max_streams=2, final_timeout_s=3.0), scenario)
    assert bad.final is None and not any(m["type"] == "partial" for m in bad.messages), bad.messages
    assert good.error is None and good.final["text"] == files[2]["offline_text"]
    dropped = [r for r in caplog.records if r.getMessage() == "dropping client bad: a send failed"]
    assert dropped and "TypeError: Object of type set" in caplog.text, caplog.text
