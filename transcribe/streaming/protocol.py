"""The streaming wire protocol: JSON messages, one per line over TCP, or one per text frame
over WebSocket (`transcribe serve --ws-port`), where audio may also travel as binary frames.

Client -> server
    {"type": "hello", "stream_id": "abc", "sample_rate": 16000, "format": "pcm16"}
        format: "pcm16" (little-endian int16) or "float32" (little-endian); must come first;
        mono (a "channels" other than 1 is refused)
    {"type": "audio", "data": "<base64 of PCM in the hello's format>"}
    <binary frame>                         WebSocket only: the same PCM, raw (no base64);
                                           may be mixed with "audio" messages
    {"type": "end"}                        no more audio: the server sends the final result
                                           (closing the sending side instead, TCP's EOF, drops
                                           the stream: a "bad_message" error, no final)
    {"type": "stats"}                      instead of hello: a monitor's request; the server
                                           answers with one "stats" message and closes
Server -> client (over WebSocket: text frames)
    {"type": "ready", "stream_id": ...}    a slot is assigned: audio is decoded as it arrives
    {"type": "waiting", "stream_id": ..., "position": n}   queued for a slot (audio is kept;
                                           no idle or final timeout runs while queued)
    {"type": "segment", "stream_id": ..., "index": i, "text": ..., "words": [{"word", "start",
        "end"}], "audio_seconds": s}       committed words (0, 1, 2, ...): they never change;
        a segment ends at a sentence end, a pause, or after about 8 s (streaming/transcript.py)
    {"type": "partial", "stream_id": ..., "index": i, "text": ..., "words": [...],
        "audio_seconds": s}                after every step: the words after the last segment,
        which may still change (segment i, once committed); the transcript so far is the
        segments' texts and this text joined with spaces (empty ones skipped)
    {"type": "final", "stream_id": ..., "text": ..., "words": [...], "audio_seconds": s}
                                           after "end": the whole transcript, equal to the
        segments and the last partial joined, and sent once (it grows with the stream: the
        line limit below holds ~15 h of speech)
    Times are seconds from the stream start; audio_seconds: audio decoded so far.
    {"type": "stats", "uptime_s", "steps", "chunks", "chunks_per_step", "max_chunks_per_step",
        "step_ms": {"p50", "p95", "p99", "max"} (null before the first step), "step_window",
        "stage_seconds": {stage: s}, "apply_seconds", "collect_seconds", "mode", "device",
        "max_streams", "active", "waiting", "free_slots"}   what the steps cost so far
        (streaming/stats.py)
    {"type": "error", "code": ..., "message": ...}   codes in ERROR_CODES; the server closes
        the connection after an error (the stream is over, its slot returned). "shutdown":
        the server is stopping (a stop signal: SIGINT, SIGTERM, SIGHUP ...; over WebSocket the close code is 1001, going
        away); "internal": a step failed (or the engine, and the server stops)
A message (line or frame) is at most MAX_LINE_BYTES. Over TCP a longer line gets a
"bad_message" error; over WebSocket a longer frame makes the server close with code 1009
(message too big), as the WebSocket library enforces the limit before the message is read.
Both transports share the error codes, idle timeout and slot pool; any URL path is accepted.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from transcribe.results import Result
from transcribe.streaming.transcript import Update

MAX_LINE_BYTES = 4 * 1024 * 1024  # one message; ~65 s of base64 PCM16 at 16 kHz
FORMATS = {"pcm16": np.dtype("<i2"), "float32": np.dtype("<f4")}
ERROR_CODES = ("bad_message", "bad_audio", "sample_rate", "busy", "timeout", "stream_id", "internal", "shutdown")


class ProtocolError(ValueError):
    """A client message the server refuses; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Hello:
    stream_id: str
    sample_rate: int
    format: str


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray  # float32 mono at the hello's rate


@dataclass(frozen=True)
class End:
    pass


def parse_json(line: bytes | str) -> dict[str, Any]:
    """One message -> its JSON object; ProtocolError(bad_message) for anything else."""
    try:
        msg = json.loads(line)
    except ValueError as e:  # not JSON, not UTF-8, or an integer over Python's 4,300 digits
        raise ProtocolError("bad_message", f"message is not JSON the server reads: {e}") from None
    except RecursionError:  # "[[[[...": a 4 MB line nests far deeper than the parser recurses
        raise ProtocolError("bad_message", "message is not JSON the server reads: nested too deeply") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("bad_message", 'message must be a JSON object with a string "type"')
    return msg


def parse_hello(msg: dict[str, Any], expected_rate: int) -> Hello:
    if msg["type"] != "hello":
        raise ProtocolError("bad_message", f'first message must be "hello", got {msg["type"]!r}')
    sid, rate, fmt = msg.get("stream_id"), msg.get("sample_rate"), msg.get("format", "pcm16")
    if not isinstance(sid, str) or not 0 < len(sid) <= 128:
        raise ProtocolError("bad_message", "hello needs a stream_id string of 1-128 characters")
    if not sid.isprintable():
        # Every reply names the stream: an id no UTF-8 reply can carry (a lone surrogate,
        # "\ud800", which is not printable) left the stream without a word, and a control
        # character would garble the server's log.
        raise ProtocolError("bad_message", "stream_id must be printable Unicode text")
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError("bad_message", "hello needs an integer sample_rate")
    if rate != expected_rate:
        raise ProtocolError("sample_rate", f"sample_rate {rate} is not supported: send {expected_rate} Hz mono")
    if msg.get("channels", 1) != 1:  # interleaved stereo read as mono would be twice as long, and garbled
        raise ProtocolError("bad_message", "audio must be mono (channels 1): mix the channels down before sending")
    if not isinstance(fmt, str) or fmt not in FORMATS:  # a list or object is unhashable: no `in` on it
        raise ProtocolError("bad_message", f"format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    return Hello(sid, rate, fmt)


def decode_pcm(raw: bytes, fmt: str) -> np.ndarray:
    """Little-endian PCM bytes -> float32 samples (int16 / 32768, as libsndfile reads them)."""
    dtype = FORMATS[fmt]
    if len(raw) % dtype.itemsize:
        raise ProtocolError("bad_audio", f"{fmt} audio must be a multiple of {dtype.itemsize} bytes, got {len(raw)}")
    x = np.frombuffer(raw, dtype=dtype)
    if fmt == "pcm16":
        return x.astype(np.float32) / 32768.0
    if not np.isfinite(x).all():
        raise ProtocolError("bad_audio", "float32 audio contains NaN or infinity")
    return x.astype(np.float32)


def parse_stream_message(msg: dict[str, Any], fmt: str) -> Audio | End:
    """A message after hello -> Audio or End; ProtocolError otherwise."""
    kind = msg["type"]
    if kind == "end":
        return End()
    if kind != "audio":
        raise ProtocolError("bad_message", f'expected "audio" or "end", got {kind!r}')
    data = msg.get("data")
    if not isinstance(data, str):
        raise ProtocolError("bad_message", 'audio needs base64 PCM in "data"')
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ProtocolError("bad_audio", f"audio data is not base64: {e}") from None
    return Audio(decode_pcm(raw, fmt))


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def result_message(kind: str, stream_id: str, result: Result, audio_seconds: float,
                   index: int | None = None) -> dict[str, Any]:
    """A "segment", "partial" (both with their segment `index`) or "final" message."""
    msg: dict[str, Any] = {"type": kind, "stream_id": stream_id}
    if index is not None:
        msg["index"] = index
    msg.update(text=result.text, words=[w.to_json() for w in result.words], audio_seconds=round(audio_seconds, 3))
    return msg


def update_messages(stream_id: str, update: Update, audio_seconds: float) -> list[dict[str, Any]]:
    """One step's messages for a stream: its new segments, then the open tail as a partial,
    then, once the stream has ended, the final. The last step's partial too is sent, so the
    segments and the last partial always join to the final, whichever a client reads."""
    out = [result_message("segment", stream_id, seg, audio_seconds, update.first_index + k)
           for k, seg in enumerate(update.segments)]
    out.append(result_message("partial", stream_id, update.open, audio_seconds, update.open_index))
    if update.final is not None:
        out.append(result_message("final", stream_id, update.final, audio_seconds))
    return out


def describe(e: BaseException) -> str:
    """An exception as an error message says it: its type, and its text when it has one."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def error_message(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}


def encode_pcm(samples: np.ndarray, fmt: str = "pcm16") -> bytes:
    """Client side: float32 samples -> little-endian PCM bytes (a WebSocket binary frame)."""
    if fmt == "pcm16":
        return (np.clip(samples, -1.0, 32767 / 32768) * 32768.0).round().astype("<i2").tobytes()
    return samples.astype("<f4").tobytes()


def audio_message(samples: np.ndarray, fmt: str = "pcm16") -> dict[str, Any]:
    """Client side: float32 samples -> an audio message."""
    return {"type": "audio", "data": base64.b64encode(encode_pcm(samples, fmt)).decode()}
