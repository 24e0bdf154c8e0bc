"""`transcribe serve`: an asyncio server over one `Scheduler`, speaking the `protocol` over TCP
(newline-delimited JSON) and, when `ws_port` is set, over WebSocket (JSON text frames, audio
also as binary PCM frames).

Both transports are thin adapters (`_TcpTransport`, `_WsTransport`: receive a message, send a
message, abort, close) around one per-connection handler, so admission, errors, timeouts and
slot release are the same code. One event loop does all socket I/O and scheduling; the
batched pool step is waited for in one worker thread, so reading audio and sending results go
on while the model computes, and steps are pipelined: once a step's tokens are back, the next
step's chunks are sent before this loop builds the last step's transcripts (`_engine_loop`).
Under `transcribe serve` the pool is the engine process's (`engine_process.RemotePool`): the
step's thousands of small torch ops run there, not waiting for this loop's GIL, on one core
fewer than the machine has. Every client has a bounded outgoing queue: a client that does not read
its results (queue full, or one send blocked for `send_timeout_s`) or sends nothing for
`idle_timeout_s` while it holds a slot is dropped, and its slot returns to the pool. A stream
queued for a slot has no timeout: the server is the one keeping it waiting.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from transcribe import heap
from transcribe.signals import STOP_SIGNALS
from transcribe.streaming import protocol as P
from transcribe.streaming.engine_process import EngineDied
from transcribe.streaming.scheduler import Busy, Scheduler, SchedulerConfig, StreamingFront, StreamingModel
from transcribe.streaming.session import SessionBase, SessionState
from transcribe.streaming.stats import StepStats

if TYPE_CHECKING:  # websockets is imported only when a WebSocket port is served
    from websockets.asyncio.server import Server as WsServer, ServerConnection

log = logging.getLogger(__name__)
READ_BYTES = 1 << 16  # one TCP read: a few 100 ms audio messages
WS_QUEUE_FRAMES = 2  # WebSocket frames read ahead of the handler, each up to protocol.MAX_LINE_BYTES


@dataclass(frozen=True)
class ServerConfig:
    """Network and admission settings. Times in seconds."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0 = any free port (tests)
    ws_port: int | None = None  # WebSocket listener on the same host; None = off, 0 = any free port
    max_streams: int = 16
    max_waiting: int = 64
    idle_timeout_s: float = 15.0  # silence from a client before it is dropped
    final_timeout_s: float = 30.0  # wait for the final result after "end"
    send_queue: int = 256  # messages buffered per client before it counts as too slow
    # A send blocked this long (the client stopped reading and the socket buffers are full)
    # drops the client: without it a client that keeps sending audio but never reads holds its
    # slot until `send_queue` results pile up, minutes at one partial per chunk.
    send_timeout_s: float = 10.0
    # Undecoded audio a stream may hold (queued for a slot, or ahead of its steps) before the
    # server stops reading its connection until the steps catch up: the client's sends then
    # block (TCP's flow control), so a client uploading hours at once holds this much, not all
    # of it (four queued clients sending 31 min each took the server from 271 to 791 MB).
    max_backlog_s: float = 120.0


Incoming = dict[str, Any] | bytes  # a parsed JSON message, or a binary frame of raw PCM (WebSocket)


class _Transport(Protocol):
    """One connection's framing. recv/send raise ConnectionError once the peer is gone.
    `received_at`: when the client's last bytes arrived (monotonic), for the idle timeout."""

    received_at: float

    async def recv(self) -> Incoming: ...
    async def send(self, msg: dict) -> None: ...
    def abort(self) -> None: ...  # drop at once, no goodbye (a slow client is not reading)
    async def close(self, going_away: bool) -> None: ...  # going_away: the server is stopping


class _ClientEof(ConnectionResetError):
    """The TCP client closed its side (EOF). It may still be reading (a half-close: shutdown
    SHUT_WR, `nc -N`), so a stream it left without "end" is told why it gets no final."""


class _TcpTransport:
    """Lines are cut from our own buffer, not by `StreamReader.readline`, so that every read
    stamps `received_at`: a client uploading one big message over a slow link is not idle
    (readline gave no sign of life until the line was whole, and the idle timeout dropped it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.buf, self.received_at = bytearray(), time.monotonic()

    async def recv(self) -> Incoming:
        start = 0  # the buffer before it has no newline
        # Read until a newline, or until the buffer holds a whole message's worth without one.
        while (end := self.buf.find(b"\n", start)) < 0 and len(self.buf) < P.MAX_LINE_BYTES:
            start = len(self.buf)
            data = await self.reader.read(READ_BYTES)  # cancelled (idle timeout): nothing lost, all is in buffers
            if not data:  # the client closed its side: a last line without a newline still counts
                if not self.buf:
                    raise _ClientEof("client closed the connection")
                end = len(self.buf) - 1
                break
            self.received_at = time.monotonic()
            self.buf += data
        if not 0 <= end < P.MAX_LINE_BYTES:
            raise P.ProtocolError("bad_message", f"message too long: no newline in {P.MAX_LINE_BYTES} bytes")
        line = bytes(self.buf[: end + 1])
        del self.buf[: end + 1]
        return P.parse_json(line)

    async def send(self, msg: dict) -> None:
        self.writer.write(P.encode(msg))
        await self.writer.drain()

    def abort(self) -> None:
        self.writer.transport.abort()

    async def close(self, going_away: bool) -> None:
        self.writer.close()


class _WsTransport:
    """websockets' ConnectionClosed becomes ConnectionResetError, so the shared handler needs
    no websockets import. A frame over `max_size` makes websockets close with 1009 (no error
    message can follow), which the handler sees as a disconnect."""

    def __init__(self, ws: "ServerConnection"):
        from websockets.exceptions import ConcurrencyError, ConnectionClosed

        self.ws, self._closed, self._concurrent = ws, ConnectionClosed, ConcurrencyError
        self.received_at = time.monotonic()  # per whole message: websockets shows no bytes before (at most 4 MB)

    async def recv(self) -> Incoming:
        try:
            frame = await self.ws.recv()  # cancelling recv (idle timeout) loses no data
        except self._closed as e:
            raise ConnectionResetError(f"client closed the WebSocket: {e}") from None
        self.received_at = time.monotonic()
        return frame if isinstance(frame, bytes) else P.parse_json(frame)

    async def send(self, msg: dict) -> None:
        try:
            await self.ws.send(P.encode(msg).decode())  # str -> a text frame
        except self._closed as e:
            raise ConnectionResetError(f"client closed the WebSocket: {e}") from None

    def abort(self) -> None:
        self.ws.transport.abort()

    async def close(self, going_away: bool) -> None:
        # 1001 tells a client the server is going away (reconnect elsewhere), not that it erred.
        # Frames the client sent that the handler never read (audio after "end", or sent before
        # a "busy" or "shutdown") stay queued, and websockets stops reading the socket past
        # WS_QUEUE_FRAMES: the client's close frame behind them went unseen, and close() waited
        # out its 10 s timeout (a stop took 10.6 s). They are read and dropped while it closes.
        closing = asyncio.ensure_future(self.ws.close(1001 if going_away else 1000))
        try:
            async for _ in self.ws:  # ends when the connection does (handshake done, or timed out)
                pass
        except (self._closed, self._concurrent):  # ConcurrencyError: a cancelled read not yet over
            pass
        except asyncio.CancelledError:  # a stop's handlers still running after 5 s
            closing.cancel()
            raise
        await closing


class _Ended(Exception):
    """The server ended the client's stream (dropped it, or is stopping) while its handler
    waited: the client was told why, or its connection is gone."""


class _Client:
    def __init__(self, transport: _Transport, maxsize: int):
        self.transport = transport
        self.out: asyncio.Queue[dict | None] = asyncio.Queue(maxsize)
        self.session: SessionBase | None = None
        self.final = asyncio.Event()  # its final result is queued
        self.ended = asyncio.Event()  # final queued or dropped: whatever its handler awaits ends
        self.progress = asyncio.Event()  # set after each step of its stream, and when dropped
        self.dropped = False  # the server ended the stream: nothing more is queued for it
        self.aborted = False  # its connection was cut: nothing queued can be flushed


class StreamServer:
    def __init__(self, model: StreamingModel | StreamingFront, cfg: ServerConfig, pool=None):
        """pool: see `Scheduler` (`transcribe serve` passes the engine process's)."""
        self.model, self.cfg = model, cfg
        self.scheduler = Scheduler(model, SchedulerConfig(cfg.max_streams, cfg.max_waiting), pool)
        self._clients: dict[str, _Client] = {}
        self._handlers: dict[asyncio.Task, _Client] = {}  # every connection, hello or not (for stop)
        self._stopping = False
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stream-step")
        self._server: asyncio.base_events.Server | None = None
        self._ws_server: WsServer | None = None
        self.ws_address: tuple[str, int] | None = None  # bound (host, port) when ws_port is set
        self._engine: asyncio.Task | None = None
        self.engine_failure: BaseException | None = None  # the engine loop died of it (a bug)
        self.broken = asyncio.Event()  # set then: serve_forever stops the server
        self.stats = StepStats()

    @property
    def steps(self) -> int:
        return self.stats.steps

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound TCP (host, port) (the WebSocket one is `ws_address`)."""
        self._server = await asyncio.start_server(self._handle_tcp, self.cfg.host, self.cfg.port,
                                                  limit=P.MAX_LINE_BYTES)
        if self.cfg.ws_port is not None:
            await self._start_ws()
        self._engine = asyncio.create_task(self._engine_loop())
        self._engine.add_done_callback(self._engine_ended)
        gc.collect()
        gc.freeze()  # the model and pool live forever: keep them out of every collection
        return self._server.sockets[0].getsockname()[:2]

    async def _start_ws(self) -> None:
        from websockets.asyncio.server import serve as ws_serve

        # compression off: PCM barely deflates and zlib would cost the loop CPU on every frame.
        # max_queue: websockets reads ahead of recv() up to its queue's high-water mark (16
        # frames of up to 4 MB by default): a stream the server stopped reading (over
        # --max-backlog, or queued for a slot) would park 64 MB a connection there; 2 frames
        # keep a client's pipeline full without that.
        self._ws_server = await ws_serve(self._handle_ws, self.cfg.host, self.cfg.ws_port,
                                         max_size=P.MAX_LINE_BYTES, max_queue=WS_QUEUE_FRAMES, compression=None)
        self.ws_address = self._ws_server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        """Stop listening, end every unfinished stream with an error saying why ("shutdown",
        or "internal" when the engine died; none after a final already queued), flush it and
        close each connection cleanly (WebSocket: 1001, going away), freeing the slots; then
        let every handler return. Cancelling the handlers instead makes asyncio's TCP callback
        log a CancelledError traceback (Python 3.11): only one still running after 5 s is."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        if self._ws_server is not None:  # our handlers close their connections, after the goodbye
            self._ws_server.close(close_connections=False)
        if self._engine is not None:
            self._engine.cancel()
        if self.engine_failure is None:
            goodbye = P.error_message("shutdown", "the server is shutting down")
        else:
            goodbye = P.error_message("internal", f"the server's engine failed: {P.describe(self.engine_failure)}")
        for client in list(self._handlers.values()):
            self._drop(client, goodbye)
        if self._handlers:
            _, late = await asyncio.wait(self._handlers, timeout=5.0)
            for task in late:
                task.cancel()
        if self._ws_server is not None:  # its close runs in a task: let it finish on this loop
            await self._ws_server.wait_closed()
        self._executor.shutdown(wait=True)

    # -- per connection -------------------------------------------------------------------
    async def _handle_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._handle(_TcpTransport(reader, writer))

    async def _handle_ws(self, ws: "ServerConnection") -> None:
        await self._handle(_WsTransport(ws))

    async def _handle(self, transport: _Transport) -> None:
        client = _Client(transport, self.cfg.send_queue)
        sender = asyncio.create_task(self._sender(client))
        handler = asyncio.current_task()
        self._handlers[handler] = client
        handler.add_done_callback(self._handlers.pop)
        if self._stopping:
            client.aborted = True
            transport.abort()
        try:
            await self._serve(client)
        except P.ProtocolError as e:
            self._send(client, P.error_message(e.code, str(e)))
        except _Ended:
            pass  # dropped or stopped by the server, which said why
        except _ClientEof:
            if client.session is not None:  # mid-stream: said, in case it still reads
                self._send(client, P.error_message("bad_message", 'the client closed its side before "end": '
                                                   "the stream is dropped without a final"))
            log.info("client disconnected")
        except (ConnectionError, asyncio.IncompleteReadError):
            log.info("client disconnected")
        finally:
            self._close_session(client, failed=not client.final.is_set())
            if not client.aborted:  # an aborted connection is gone: nothing to flush
                if not client.out.full():
                    client.out.put_nowait(None)  # sender: flush what is queued, then stop
                await asyncio.wait([sender], timeout=2.0)
            sender.cancel()
            await transport.close(self._stopping)

    async def _serve(self, client: _Client) -> None:
        first = await self._recv(client)
        if isinstance(first, bytes):
            raise P.ProtocolError("bad_message", 'first message must be "hello", got a binary frame')
        if first["type"] == "stats":  # a monitor, not a stream: the figures, then the connection closes
            self._send(client, self._stats())
            return
        hello = P.parse_hello(first, self.model.sample_rate)
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
            msg = self._stream_message(await self._recv(client), hello.format)
            if isinstance(msg, P.End):
                session.end()
                self._wake.set()
                await self._await_final(client, session)
                return
            session.push_audio(msg.samples)
            self.scheduler.prepare(session)  # its next chunk's features, once its audio is all here
            self._fail_own_errors()
            self._wake.set()
            await self._caught_up(client, session)

    async def _caught_up(self, client: _Client, session: SessionBase) -> None:
        """Return once the stream's undecoded audio is within `max_backlog_s` (at once, for a
        client sending in real time): until then its connection is not read. No timeout runs
        meanwhile: the wait is the server's (a queued stream's lasts as long as the queue)."""
        # Never below what a step needs: a stream waiting for audio it is not read for would
        # wait for good (2 s chunks + 2 s right context with --max-backlog 1).
        limit = max(self.cfg.max_backlog_s, self.model.step_seconds + 1.0)
        while not client.dropped and session.audio_seconds - session.decoded_seconds > limit:
            client.progress.clear()
            await client.progress.wait()

    async def _await_final(self, client: _Client, session: SessionBase) -> None:
        """Wait for the final after "end". A stream that sent its audio faster than real time
        has a backlog of steps to run first (a 15-minute upload is minutes of work for a big
        model): the "timeout" error comes only after `final_timeout_s` in which none of its
        steps ran, not `final_timeout_s` after "end" while it is still being decoded."""
        while True:
            progress = session.steps
            try:  # `ended`: a drop ends the wait too
                await self._unless_late(client, client.ended.wait(), self.cfg.final_timeout_s,
                                        "no final result in time (server overloaded)")
                return
            except P.ProtocolError:
                if session.steps == progress:
                    raise

    @staticmethod
    def _stream_message(incoming: Incoming, fmt: str) -> P.Audio | P.End:
        if isinstance(incoming, bytes):  # a WebSocket binary frame: raw PCM in the hello's format
            return P.Audio(P.decode_pcm(incoming, fmt))
        return P.parse_stream_message(incoming, fmt)

    async def _recv(self, client: _Client) -> Incoming:
        return await self._unless_late(client, client.transport.recv(), self.cfg.idle_timeout_s,
                                       f"nothing received for {self.cfg.idle_timeout_s} s", reading=True)

    @staticmethod
    async def _unless_late(client: _Client, awaitable, timeout_s: float, message: str, reading: bool = False):
        """`awaitable`'s result, or a "timeout" error after `timeout_s` during which the client
        held a slot (or had not said hello): a stream queued for a slot waits as long as the
        queue takes, as the server is the one keeping it (a disconnect still ends a read), and
        has the whole `timeout_s` from the moment it got its slot. `reading`: the timeout counts
        from the last bytes received, part of a message or not. _Ended once the server ends
        the stream (a read would otherwise wait for a client that was told to go)."""
        task, ended = asyncio.ensure_future(awaitable), asyncio.ensure_future(client.ended.wait())
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                done, _ = await asyncio.wait([task, ended], timeout=max(deadline - time.monotonic(), 0.0),
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if ended in done:
                    raise _Ended()
                session, now = client.session, time.monotonic()
                if session is not None and session.state == SessionState.WAITING:
                    deadline = now + timeout_s
                elif session is not None and session.admitted_at is not None and session.admitted_at + timeout_s > now:
                    deadline = session.admitted_at + timeout_s  # admitted during this window
                elif reading and client.transport.received_at + timeout_s > now:
                    deadline = client.transport.received_at + timeout_s  # a message still arriving
                else:
                    raise P.ProtocolError("timeout", message)
        finally:
            task.cancel()  # cancelling a read loses no data (see the transports)
            ended.cancel()

    async def _sender(self, client: _Client) -> None:
        try:
            while (msg := await client.out.get()) is not None:
                await asyncio.wait_for(client.transport.send(msg), self.cfg.send_timeout_s)
        except ConnectionError:  # the client is gone: its stream ends now, its slot is freed
            # (its handler may not read again for a while: it waits while a backlog is decoded)
            log.info("client gone: a send failed")
            self._drop(client)
        except asyncio.TimeoutError:
            log.warning("dropping slow client %s: a send blocked for %s s",
                        client.session and client.session.stream_id, self.cfg.send_timeout_s)
            self._drop(client)
        except Exception:  # a message that cannot be sent: the stream ends, said in the log, not silently
            log.exception("dropping client %s: a send failed", client.session and client.session.stream_id)
            self._drop(client)

    def _send(self, client: _Client, msg: dict) -> None:
        if client.dropped:
            return
        try:
            client.out.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("dropping slow client %s", client.session and client.session.stream_id)
            self._drop(client)

    def _drop(self, client: _Client, goodbye: dict | None = None) -> None:
        """End the client's stream now and free its slot: its connection aborted (a slow or
        vanished client), or, given `goodbye`, that message queued for the handler to flush
        before it closes the connection (not after a final already queued: that stream ended
        well). Whatever the handler awaits ends."""
        if not client.dropped:
            # A stream whose final is queued is over: the goodbye would follow its final
            if goodbye is not None and not client.final.is_set():
                self._send(client, goodbye)  # a full queue aborts the client here instead
            client.dropped = True
            client.ended.set()
            client.progress.set()  # a handler waiting for its backlog returns
            self._close_session(client, failed=True)
        if goodbye is None and not client.aborted:  # also a goodbye whose flush blocked
            client.aborted = True
            client.transport.abort()

    def _stats(self) -> dict:
        sched = self.scheduler
        return self.stats.snapshot(mode=self.model.mode, device=self.model.device,
                                   max_streams=self.cfg.max_streams, active=len(sched.active),
                                   waiting=len(sched.waiting), free_slots=sched.pool.free_slots)

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
        if self._stopping:  # a queued stream given the slot of one stop() just ended: "shutdown" is its news
            return
        for s in sessions:
            client = self._client_of(s)
            if client is not None:
                self._send(client, {"type": "ready", "stream_id": s.stream_id})
        if sessions:
            self._wake.set()

    # -- engine ---------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        """Steps, one at a time, pipelined: once a step's tokens are back, the next step's
        chunks are taken and sent to the pool before this step's transcripts are built and sent,
        so the engine computes while this loop does its own work (a stream can have a chunk in
        the next step before its last one's tokens are added: `SessionBase.complete`)."""
        sched = self.scheduler
        done = None  # the last step's results, applied while the next one runs
        while True:
            if done is None:
                await self._wake.wait()
                self._wake.clear()
            t0 = time.perf_counter()
            sessions, chunks = sched.collect()
            self._fail_own_errors()
            t1 = time.perf_counter()
            self.stats.record_collect(t1 - t0)
            step = self._start_step(chunks) if chunks else None
            if done is not None:
                self._apply(*done)
                done = None
            if step is None:
                self._deliver(sched.finish_idle())
                self._fail_own_errors()
                continue
            try:
                hyps = await step
                done = sessions, len(chunks), time.perf_counter() - t1, hyps
            except EngineDied:  # no engine, no more steps: the server stops (_engine_ended)
                raise
            except Exception as e:  # a failed step fails its streams, not the server
                log.exception("stream step failed")
                self._fail(sessions, P.describe(e))
                self._wake.set()  # and the others' chunks are looked for at once, as after a step
            finally:
                sched.end_step()
                self._notify_admitted()
            heap.trim()  # at most once a second: shapes vary with every step (transcribe/heap.py)

    def _start_step(self, chunks: list) -> asyncio.Future:
        """One batched pool step, run in the worker thread (the engine process's, under serve)."""
        self.scheduler.begin_step()  # slots closed from now on are released after the step
        return asyncio.get_running_loop().run_in_executor(self._executor, self.scheduler.pool.step, chunks)

    def _apply(self, sessions: list[SessionBase], n_chunks: int, step_s: float, hyps) -> None:
        """A step's tokens into transcripts, their messages sent."""
        sched = self.scheduler
        t0 = time.perf_counter()
        self._deliver(sched.apply(sessions, hyps))
        self.stats.record(n_chunks, step_s, time.perf_counter() - t0, sched.pool.stage_seconds)
        for s in sessions:  # their handlers may be waiting for the backlog to shrink
            client = self._client_of(s)
            if client is not None:
                client.progress.set()

    def _fail_own_errors(self) -> None:
        """Streams whose own chunking or final update raised (the scheduler closed them)."""
        for session, e in self.scheduler.take_failed():
            log.error("stream %s failed: %s", session.stream_id, P.describe(e), exc_info=e)
            self._fail([session], P.describe(e))

    def _engine_ended(self, task: asyncio.Task) -> None:
        """The engine loop ends only when cancelled (stop); anything else is a bug outside a
        step and outside any one stream's own work (which fails that stream alone). Serving on
        without it would leave every stream waiting for its timeout, so the server stops,
        saying why."""
        if task.cancelled():
            return
        self.engine_failure = task.exception()
        log.critical("the streaming engine stopped: %s", P.describe(self.engine_failure),
                     exc_info=self.engine_failure)
        self.broken.set()

    def _deliver(self, updates) -> None:
        for session, update in updates:
            client = self._client_of(session)
            if client is None:
                continue
            for msg in P.update_messages(session.stream_id, update, session.covered_seconds):
                self._send(client, msg)
            if update.final is not None:
                client.final.set()
                client.ended.set()
        self._notify_admitted()

    def _fail(self, sessions: list[SessionBase], message: str) -> None:
        """The step's streams end with an "internal" error, but not one whose final was
        already sent (a step can fail after delivering some of its results), nor a new stream
        that took the id of one closed while the step ran (a client reconnecting)."""
        for s in sessions:
            client = self._client_of(s)
            if client is not None and not client.final.is_set():
                self._drop(client, P.error_message("internal", message))

    def _client_of(self, session: SessionBase) -> _Client | None:
        """The client streaming `session`: not one that took its id after it closed (a
        client reconnecting while a step of the old stream ran)."""
        client = self._clients.get(session.stream_id)
        return client if client is not None and client.session is session else None


async def serve_forever(model: StreamingModel | StreamingFront, cfg: ServerConfig, pool=None) -> int:
    """Serve until a stop signal (SIGINT, SIGTERM, and the others of `signals.STOP_SIGNALS`: a
    terminal's SIGHUP, Slurm's SIGUSR1), or until the engine dies of a bug; returns the exit
    status (128 + the signal, or 1) once every connection is closed (their streams' slots
    freed) and every handler has finished, so a stop prints no cancellation tracebacks."""
    server = StreamServer(model, cfg, pool)
    host, port = await server.start()
    loop, stop, got = asyncio.get_running_loop(), asyncio.Event(), []
    for sig in STOP_SIGNALS:  # before "listening": a signal on that line stops cleanly
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue  # ignored from the start (`nohup`, `&` in a script): kept so, as programs do
        loop.add_signal_handler(sig, lambda sig=sig: (got.append(sig), stop.set()))
    log.info("listening on %s:%d (max_streams=%d)", _hostport(host), port, cfg.max_streams)
    if server.ws_address is not None:
        log.info("WebSocket on ws://%s:%d", _hostport(server.ws_address[0]), server.ws_address[1])
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.broken.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await server.stop()
    # the engine's failure wins over a signal that came while the server was stopping for it
    return 1 if server.engine_failure is not None else 128 + int(got[0])


def _hostport(host: str) -> str:
    """An IPv6 address in brackets, as URLs write it."""
    return f"[{host}]" if ":" in host else host
