"""`transcribe serve`: an asyncio TCP server (newline-delimited JSON, see `protocol`) over one
`Scheduler`.

One event loop does all socket I/O and scheduling; the batched pool step runs in one worker
thread (torch releases the GIL), so reading audio and sending results go on while the model
computes. Every client has a bounded outgoing queue: a client that does not read its results
(queue full) or sends nothing for `idle_timeout_s` is dropped, and its slot returns to the pool.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
from dataclasses import dataclass

from transcribe.streaming import protocol as P
from transcribe.streaming.scheduler import Busy, Scheduler, SchedulerConfig, StreamingModel
from transcribe.streaming.session import SessionState, StreamSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Network and admission settings. Times in seconds."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0 = any free port (tests)
    max_streams: int = 16
    max_waiting: int = 64
    idle_timeout_s: float = 15.0  # silence from a client before it is dropped
    final_timeout_s: float = 30.0  # wait for the final result after "end"
    send_queue: int = 256  # messages buffered per client before it counts as too slow


class _Client:
    def __init__(self, writer: asyncio.StreamWriter, maxsize: int):
        self.writer = writer
        self.out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)
        self.session: StreamSession | None = None
        self.final = asyncio.Event()
        self.dropped = False


class StreamServer:
    def __init__(self, model: StreamingModel, cfg: ServerConfig):
        self.model, self.cfg = model, cfg
        self.scheduler = Scheduler(model, SchedulerConfig(cfg.max_streams, cfg.max_waiting))
        self._clients: dict[str, _Client] = {}
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stream-step")
        self._server: asyncio.base_events.Server | None = None
        self._engine: asyncio.Task | None = None
        self.steps = 0

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound (host, port)."""
        self._server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port, limit=P.MAX_LINE_BYTES)
        self._engine = asyncio.create_task(self._engine_loop())
        gc.collect()
        gc.freeze()  # the model and pool live forever: keep them out of every collection
        return self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._engine is not None:
            self._engine.cancel()
        for client in list(self._clients.values()):
            self._drop(client)
        self._executor.shutdown(wait=True)

    # -- per connection -------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = _Client(writer, self.cfg.send_queue)
        sender = asyncio.create_task(self._sender(client))
        try:
            await self._serve(client, reader)
        except P.ProtocolError as e:
            self._send(client, P.error_message(e.code, str(e)))
        except (ConnectionError, asyncio.IncompleteReadError):
            log.info("client disconnected")
        finally:
            self._close_session(client, failed=not client.final.is_set())
            if not client.dropped and not client.out.full():
                client.out.put_nowait(None)  # sender: flush what is queued, then stop
            await asyncio.wait([sender], timeout=2.0)
            sender.cancel()
            writer.close()

    async def _serve(self, client: _Client, reader: asyncio.StreamReader) -> None:
        hello = P.parse_hello(P.parse_json(await self._readline(reader)), self.model.sample_rate)
        try:
            session = self.scheduler.open(hello.stream_id)
        except Busy as e:
            raise P.ProtocolError("busy", str(e)) from None
        except ValueError as e:
            raise P.ProtocolError("stream_id", str(e)) from None
        client.session = session
        self._clients[hello.stream_id] = client
        if session.state == SessionState.ACTIVE:
            self._send(client, {"type": "ready", "stream_id": hello.stream_id})
        else:
            self._send(client, {"type": "waiting", "stream_id": hello.stream_id,
                                "position": len(self.scheduler.waiting)})
        while not client.dropped:
            msg = P.parse_stream_message(P.parse_json(await self._readline(reader)), hello.format)
            if isinstance(msg, P.End):
                session.end()
                self._wake.set()
                try:
                    await asyncio.wait_for(client.final.wait(), self.cfg.final_timeout_s)
                except asyncio.TimeoutError:
                    raise P.ProtocolError("timeout", "no final result in time (server overloaded)") from None
                return
            session.push_audio(msg.samples)
            self._wake.set()

    async def _readline(self, reader: asyncio.StreamReader) -> bytes:
        try:
            line = await asyncio.wait_for(reader.readline(), self.cfg.idle_timeout_s)
        except asyncio.TimeoutError:
            raise P.ProtocolError("timeout", f"nothing received for {self.cfg.idle_timeout_s} s") from None
        except ValueError as e:  # StreamReader: line over the limit
            raise P.ProtocolError("bad_message", f"message too long: {e}") from None
        if not line:
            raise ConnectionResetError("client closed the connection")
        return line

    async def _sender(self, client: _Client) -> None:
        while (data := await client.out.get()) is not None:
            client.writer.write(data)
            await client.writer.drain()

    def _send(self, client: _Client, msg: dict) -> None:
        if client.dropped:
            return
        try:
            client.out.put_nowait(P.encode(msg))
        except asyncio.QueueFull:
            log.warning("dropping slow client %s", client.session and client.session.stream_id)
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        client.dropped = True
        self._close_session(client, failed=True)
        client.writer.transport.abort()

    def _close_session(self, client: _Client, failed: bool) -> None:
        session = client.session
        if session is None:
            return
        if self._clients.get(session.stream_id) is client:
            del self._clients[session.stream_id]
        self.scheduler.close(session, failed=failed)
        self._notify_admitted()

    def _notify_admitted(self) -> None:
        sessions = self.scheduler.take_admitted()
        for s in sessions:
            client = self._clients.get(s.stream_id)
            if client is not None:
                self._send(client, {"type": "ready", "stream_id": s.stream_id})
        if sessions:
            self._wake.set()

    # -- engine ---------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                sessions, chunks = sched.collect()
                if not chunks:
                    break
                sched.begin_step()
                try:
                    hyps = await loop.run_in_executor(self._executor, sched.pool.step, chunks)
                except RuntimeError as e:  # a failed step fails its streams, not the server
                    log.exception("stream step failed")
                    self._fail(sessions, str(e))
                    continue
                finally:
                    sched.end_step()
                    self._notify_admitted()
                self.steps += 1
                self._deliver(sched.apply(sessions, hyps))
            self._deliver(sched.finish_idle())

    def _deliver(self, results) -> None:
        for session, result, final in results:
            client = self._clients.get(session.stream_id)
            if client is None or client.session is not session:
                continue
            msg = P.result_message(session.stream_id, result, final, session.decoded_seconds)
            self._send(client, msg)
            if final:
                client.final.set()
        self._notify_admitted()

    def _fail(self, sessions: list[StreamSession], message: str) -> None:
        for s in sessions:
            client = self._clients.get(s.stream_id)
            if client is not None:
                self._send(client, P.error_message("internal", message))
                self._drop(client)


async def serve_forever(model: StreamingModel, cfg: ServerConfig) -> None:
    server = StreamServer(model, cfg)
    host, port = await server.start()
    log.warning("listening on %s:%d (max_streams=%d)", host, port, cfg.max_streams)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
