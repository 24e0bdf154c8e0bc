"""Decoder modes and what every graph-captured decoder shares: which mode runs, the fallback
full-graph -> unrolled -> eager (logged once), the first-batch check against eager, and the
CUDA capture helpers. Used by the transducer's graphs (`decode_graphs.py`, `slot_decode.py`),
Whisper's (`whisper_graph.py`) and the encoder's (`encoder_cudagraph.py`).
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable, Iterator, TypeVar

import torch

from engines import cuda_conditional
from engines.choices import DecodeMode
from engines.cuda_conditional import CudaPythonError

log = logging.getLogger("transcribe")
Built = TypeVar("Built")

# A new capture's first batch is decoded eagerly too; the mode falls back when more than this
# share of its rows (any row, below 4 rows) differ. Same stage functions, but the static buffers
# give other shapes, for which cuBLAS may pick other kernels: a last-bit difference can flip a
# near-tie argmax in a rare row, and that row then goes its own way. A broken capture garbles
# most rows.
MAX_DIFFERING_ROWS = 0.25
GRAPH_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, CudaPythonError)


_NEXT = {DecodeMode.FULL_GRAPH: DecodeMode.UNROLLED, DecodeMode.UNROLLED: DecodeMode.EAGER}

# What "auto" runs on CUDA: full-graph where conditional nodes are supported, else unrolled.
# The first H100 session (2026-11-22) saw the full-graph capture segfault; the second
# (2026-11-23) found why: cuDNN's LSTM fails inside a conditional body's capture
# (CUDNN_STATUS_INTERNAL_ERROR, reported by `cuda_conditional` before the driver crashed), so the
# prediction network now steps through torch's own LSTM cell (transducer.lstm_step_native).
# Since then every fixture decodes to eager's tokens in full-graph, which was the fastest mode
# there: decoder-only 3.98x eager against unrolled's (54 vs 70 ms a pass), RTFx 1036.7 vs 935.5.
AUTO_ON_CUDA = DecodeMode.FULL_GRAPH


def full_graph_unsupported() -> str | None:
    """Why the full-graph mode cannot run on this CUDA setup, or None."""
    try:
        api = cuda_conditional.import_cuda_python()
    except ImportError as e:
        return str(e)
    return cuda_conditional.unsupported_reason(api)


def select_mode(requested: str | DecodeMode, device: torch.device | str) -> tuple[DecodeMode, str]:
    """(mode to use, why). "auto" = eager on the CPU, AUTO_ON_CUDA on CUDA; a graph mode that
    cannot run here degrades to the best one that can. Raises ValueError for an unknown mode
    name."""
    req = DecodeMode(requested)
    if torch.device(device).type != "cuda":
        return DecodeMode.EAGER, f"device is {torch.device(device).type}"
    why = "auto" if req is DecodeMode.AUTO else "requested"
    if req is DecodeMode.AUTO:
        req = AUTO_ON_CUDA
    if req in (DecodeMode.EAGER, DecodeMode.UNROLLED):
        return req, why
    reason = full_graph_unsupported()
    if reason is None:
        return DecodeMode.FULL_GRAPH, why
    return DecodeMode.UNROLLED, reason


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream ordered after the current one: warm-up and capture never run on the default
    stream."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def fresh_graph_pool(device: torch.device) -> tuple | None:
    """A new CUDA graph memory pool for one capture attempt's graphs (None off CUDA). Never one
    reused across attempts: a pool whose graphs were all dropped (regrow, failed attempt) can
    still hold blocks (cuBLAS keeps a workspace per capture stream in it), so it lingers with
    use_count 0 and capturing into it again trips torch's allocator assert "use_count > 0"
    (create_or_incref_pool). The old pool's free blocks are released by the empty_cache() each
    capture starts with."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kwargs) -> Iterator[None]:
    """`torch.cuda.graph(graph, **kwargs)` with Python's garbage collector off until the capture
    ends. torch collects once as the capture begins, but a collection that the capture's own
    allocations trigger can free an object whose CUDA teardown (an old graph, an event) is not
    allowed while a stream captures: on the H100 (2026-11-23) that aborted a Whisper full-graph
    capture ("Fatal Python error: Aborted" while "Garbage-collecting" in the body)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if was_enabled:
            gc.enable()


def warm_up(device: torch.device, run: Callable[[], None]) -> None:
    """`run` eagerly on a side stream, then wait for it, so kernels, cuBLAS and attention set up
    their state (and allocator blocks) before a capture records them."""
    side = side_stream(device)
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


class ModeSelection:
    """Requested decoder mode -> the mode in use, each fallback logged once on the `transcribe`
    logger; shared by the transducer (`GraphDecoder`) and Whisper (`whisper_graph`) decoders.
    `capture=False` drives the static pieces directly (CPU tests of what graphs would run)."""

    def __init__(self, mode: DecodeMode = DecodeMode.EAGER, capture: bool = True):
        self.mode, self.capture = mode, capture
        self._logged: set[str] = set()
        self.unverified = False  # a capture whose first batch is still to be checked against eager

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning(message)

    def set_mode(self, requested: str | DecodeMode, device: torch.device | str) -> DecodeMode:
        mode, reason = select_mode(requested, device)
        req = DecodeMode(requested)
        best = req if req is not DecodeMode.AUTO else AUTO_ON_CUDA
        cpu_auto = req is DecodeMode.AUTO and torch.device(device).type != "cuda"  # eager IS the best there
        if mode is not best and not cpu_auto:
            self._log_once(f"decoder mode {mode.value} (requested {req.value}): {reason}")
        if mode is not self.mode:
            self._drop()
        self.mode = mode
        return mode

    def _drop(self) -> None:
        """Forget the static state and graphs built for the previous mode."""
        raise NotImplementedError

    def _capture_with_fallback(self, capture: Callable[[DecodeMode], Built]) -> Built | None:
        """capture(mode) for the mode in use; a capture error moves to the next mode (logged
        once) and tries again. None once that reached eager."""
        while True:
            try:
                built = capture(self.mode)
                self.unverified = True
                return built
            except GRAPH_ERRORS as e:
                if self.fall_back(f"capture failed ({e})") is DecodeMode.EAGER:
                    return None

    def fall_back(self, why: str) -> DecodeMode:
        """Move to the next mode (logged once) and forget what the failed one built."""
        nxt = _NEXT[self.mode]
        self._log_once(f"decoder mode {self.mode.value} {why}; falling back to {nxt.value}")
        self._drop()
        self.mode, self.unverified = nxt, False
        return nxt

    def replay_failed(self, error: BaseException) -> None:
        """A replay raised: fall back, unless it ran out of memory, which is the batch's size, not
        the mode's fault (the pipeline runs the batch again in halves)."""
        if isinstance(error, torch.OutOfMemoryError):
            raise error
        self.fall_back(f"replay failed ({error})")

    def agrees_with_eager(self, graph: list, eager: list) -> bool:
        """A new capture's first batch: per-row results of the graph mode against eager's. Too
        many differing rows (`MAX_DIFFERING_ROWS`) fall back to the next mode, logged with the
        count; the caller then keeps eager's results. Later batches are not checked."""
        self.unverified = False
        differ = sum(g != e for g, e in zip(graph, eager, strict=True))
        if differ > (MAX_DIFFERING_ROWS * len(eager) if len(eager) >= 4 else 0):
            self.fall_back(f"gave other tokens than eager in {differ} of {len(eager)} rows of its first batch")
            return False
        return True
