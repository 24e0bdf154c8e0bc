"""`transcribe stream FILE` and `transcribe serve`, as plain functions for `transcribe/cli.py`."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from transcribe.cli_options import LOG_LEVELS
from transcribe.streaming import protocol as P
from transcribe.streaming.scheduler import Scheduler, SchedulerConfig, StreamingModel
from transcribe.streaming.server import ServerConfig, serve_forever
from transcribe.streaming.session import SessionState


def log_to_stderr(level: int, fmt: str) -> None:
    """Log lines on stderr: ours (the `transcribe` and `engines` loggers: the address served,
    the chunking, the attention kernel, clients dropped) from `level` up, other libraries'
    from WARNING up, so "listening on" is an INFO line, not a warning."""
    logging.basicConfig(level=logging.WARNING, format=fmt)
    for name in ("transcribe", "engines"):
        logging.getLogger(name).setLevel(level)


def load_streaming_model(model: str, chunk_ms: float | None = None, left_ms: float | None = None,
                         right_ms: float | None = None, device: str = "cpu", dtype: str = "auto",
                         encoder_backend: str = "auto") -> StreamingModel:
    """A registry name or a `.nemo` path -> StreamingModel: cache-aware checkpoints stream with
    their trained chunking, offline-trained TDT / RNN-T ones in chunks with left and right
    context (None = NeMo's 2 s chunk, 10 s left, 2 s right), their encoder through
    `encoder_backend` (see StreamingModel). OptionError (a usage error) for a Whisper model,
    before it loads; ValueError for anything else."""
    from engines.loader import load_engine, check_streamable
    from engines.parakeet import ParakeetEngine

    check_streamable(model)
    # The offline engine's own backend and decoder graphs are bucketed for whole pieces, which
    # streaming never runs: eager here, and the streaming pool builds what its steps need.
    engine = load_engine(model, device=device, encoder_backend="torch", decoder_mode="eager", dtype=dtype)
    if not isinstance(engine, ParakeetEngine):
        raise ValueError(f"model {model!r} is not a FastConformer transducer checkpoint")
    sm = StreamingModel(engine, chunk_ms=chunk_ms, left_ms=left_ms, right_ms=right_ms, encoder_backend=encoder_backend)
    if sm.context is not None:
        fs = sm.frame_samples / sm.sample_rate
        c = sm.context
        logging.getLogger(__name__).info(
            "chunked streaming: chunk %.2f s, left %.2f s, right %.2f s (theoretical latency %.2f s)",
            c.chunk * fs, c.left * fs, c.right * fs, (c.chunk + c.right) * fs)
    return sm


def stream_file(path: str | Path, model: str, realtime: bool = False, piece_ms: int = 100,
                as_json: bool = False, echo: Callable[[str], None] = print, chunk_ms: float | None = None,
                left_ms: float | None = None, right_ms: float | None = None) -> dict:
    """Stream one audio file through the streaming engine (cache-aware, or chunked with
    chunk_ms / left_ms / right_ms for offline-trained models), printing the transcript as it grows.

    realtime: feed audio at the pace it was recorded (else as fast as possible). Prints what
    the server would send, one line each: `segment` (committed words), `partial` (the words
    after them, after every chunk) and `final` (the whole transcript); JSON lines with word
    times when `as_json`. Returns a summary: text, words, audio_seconds, wall_seconds, rtfx, steps, step latency (ms)."""
    from transcribe.audio import _check_path
    from transcribe.decode import AudioStream

    _check_path(path)  # a missing or empty file is said before a big model's minute of loading
    sm = load_streaming_model(model, chunk_ms, left_ms, right_ms)
    sched = Scheduler(sm, SchedulerConfig(max_streams=1))
    session = sched.open(Path(path).name)
    piece = max(int(piece_ms * sm.sample_rate / 1000), 1)
    step_ms: list[float] = []
    pos = 0
    final = None
    # Read as it is fed (the offline decoder: same checks, PyAV for m4a): a long file was
    # decoded whole first, two float32 copies of it in memory, before its first partial.
    with AudioStream(path, sm.sample_rate) as source:
        pieces = _pieces(source.blocks(), piece)
        t0 = time.perf_counter()
        ahead = next(pieces, None)
        while session.state == SessionState.ACTIVE:
            if ahead is not None:
                if realtime:
                    time.sleep(max(t0 + (pos + len(ahead)) / sm.sample_rate - time.perf_counter(), 0.0))
                session.push_audio(ahead)
                pos += len(ahead)
                ahead = next(pieces, None)
                if ahead is None:
                    session.end()
            elif not session.ended:
                session.end()
            ts, steps = time.perf_counter(), sched.steps
            out = sched.run_once()
            if sched.steps > steps:
                step_ms.append(1000 * (time.perf_counter() - ts))
            for _, update in out:
                for msg in P.update_messages(session.stream_id, update, session.covered_seconds):
                    _print_message(echo, msg, as_json)
                final = update.final or final
    wall = time.perf_counter() - t0
    seconds = pos / sm.sample_rate
    return {
        "text": final.text, "words": [w.__dict__ for w in final.words], "audio_seconds": seconds,
        "wall_seconds": wall, "rtfx": seconds / wall if wall > 0 else None, "steps": len(step_ms),
        "step_ms_p50": float(np.percentile(step_ms, 50)) if step_ms else None,
        "step_ms_max": max(step_ms) if step_ms else None,
    }


def _pieces(blocks: Iterator[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The decoder's blocks of samples as pieces of `size` samples (the last one shorter)."""
    held: list[np.ndarray] = []
    n = 0
    for block in blocks:
        held.append(block)
        n += len(block)
        if n >= size:
            joined = np.concatenate(held)
            cut = len(joined) - len(joined) % size
            yield from (joined[i:i + size] for i in range(0, cut, size))
            held, n = [joined[cut:]], len(joined) - cut
    if n:
        yield np.concatenate(held)


def _print_message(echo, msg: dict, as_json: bool) -> None:
    """A JSON line as the server would send it (without the stream id), or one line of text:
    segments as they are committed, the open tail after each step, the final."""
    if as_json:
        echo(json.dumps({k: v for k, v in msg.items() if k != "stream_id"}, ensure_ascii=False))
    else:
        echo(f"[{msg['audio_seconds']:7.2f}s {msg['type']}] {msg['text']}")


def serve(model: str, host: str = "127.0.0.1", port: int = 8765, max_streams: int = 16, max_waiting: int = 64,
          idle_timeout_s: float = 15.0, ws_port: int | None = None, chunk_ms: float | None = None,
          left_ms: float | None = None, right_ms: float | None = None, device: str = "cpu", dtype: str = "auto",
          max_backlog_s: float = 120.0, log_level: str = "info", encoder_backend: str = "auto") -> int:
    """Run the streaming server until a stop signal (see transcribe/streaming/protocol.py):
    TCP on `port`, and the same protocol over WebSocket on `ws_port` when given (None = no
    WebSocket). chunk_ms / left_ms / right_ms: chunking of an offline-trained model (None =
    defaults); encoder_backend: the chunked pool's (auto: CUDA graphs on CUDA). Returns the exit status: 128 + the signal that stopped it, or 1 when the engine
    died of a bug (the server stops rather than leave every stream waiting). log_level: ours
    (`log_to_stderr`)."""
    from transcribe.streaming.engine_process import RemotePool

    log_to_stderr(LOG_LEVELS[log_level], "%(asctime)s %(levelname)s %(message)s")
    cfg = ServerConfig(host=host, port=port, ws_port=ws_port, max_streams=max_streams,
                       max_waiting=max_waiting, idle_timeout_s=idle_timeout_s, max_backlog_s=max_backlog_s)
    # The model and its pool in a process of their own, the event loop here (engine_process.py:
    # beside the event loop a step ran at a third of its speed, waiting for the GIL).
    load_args = dict(model=model, chunk_ms=chunk_ms, left_ms=left_ms, right_ms=right_ms, device=device, dtype=dtype,
                     encoder_backend=encoder_backend)
    with RemotePool(load_args, max_streams, LOG_LEVELS[log_level]) as pool:
        # This process computes one chunk's log-mel at a time, mostly while the engine steps:
        # a second OpenMP thread only contends with the engine's (on the 2-core VM computing
        # features as audio arrived, with two threads, made steps and finals several times slower).
        torch.set_num_threads(1)
        return asyncio.run(serve_forever(pool.front, cfg, pool))
