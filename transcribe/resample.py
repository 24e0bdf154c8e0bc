"""Resampling as NeMo's `transcribe()` does it, block by block: float32 samples at one rate ->
float32 samples at another.

NeMo 3's `transcribe()` reads audio through lhotse. Where torchaudio is not installed (NeMo
3.0.0 from PyPI does not pull it in: the environment of ../shared/fixtures), lhotse resamples
with `scipy.signal.resample_poly(x, up, down)`: a Kaiser-windowed (beta 5) low-pass FIR of
20 * max(up, down) + 1 taps at the upsampled rate, float32, then keeps round-half-up(n *
target / source) samples (`Recording.resample`). That is what this module computes, within
float32 rounding (tests/test_resample.py: lhotse's samples, and NeMo's transcripts of 8 to
48 kHz files). soxr HQ, librosa's resampler, which we used before, gave an 8 kHz file features
up to 16.7 off after per-feature normalisation and another transcript on every fixture model.
(With torchaudio installed, lhotse uses torchaudio's windowed sinc instead, which differs from
both by up to ~0.03 in a sample.)

The filter is applied polyphase: the rates divided by their gcd are `orig` inputs to `new`
outputs (a group), and output p of group g is sum_c kernel[p, c] * x[g * orig - width + c].
That is a few matrix products per chunk of groups: 1.0-2.5 s an hour of audio at 8 to 48 kHz
on one core (soxr HQ: 0.3-1.0 s). Where the rates share a small gcd (44101 or 11127 Hz to 16 kHz) the [new, span] kernel
would take gigabytes, though each phase has only ~21 non-zero taps: there each phase keeps its
band. Groups are computed in chunks of a fixed size counted from the stream's start, so any
sizes of the blocks fed give the same samples, bit for bit (a product's sums depend on its shape).
"""
from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

import numpy as np

KAISER_BETA = 5.0  # resample_poly's default window=('kaiser', 5.0)
HALF_LEN_PER_RATE = 10  # resample_poly: half_len = 10 * max(up, down)
DENSE_MAX = 1 << 21  # kernel entries (8 MB) up to which the whole kernel is used
CHUNK_OUTPUTS = 1 << 14  # output samples one product computes (about 1 s at 16 kHz)


def output_length(n: int, source_rate: int, target_rate: int) -> int:
    """Samples at target_rate for n at source_rate: lhotse's `compute_num_samples(duration,
    rate, ROUND_HALF_UP)` (the product rounded to 8 digits first, as lhotse does)."""
    exact = round(n / source_rate * target_rate, ndigits=8)
    return int(Decimal(exact).quantize(0, rounding=ROUND_HALF_UP))


def _filter(up: int, down: int) -> tuple[np.ndarray, int]:
    """resample_poly's filter as it applies it: (h float32, zero-padded in front, the
    upsampled-output index of output 0). `firwin(2 * half + 1, 1 / max(up, down),
    window=('kaiser', 5.0))`, scaled to unit sum, cast to x's float32, times `up`."""
    half = HALF_LEN_PER_RATE * max(up, down)
    cutoff = 1.0 / max(up, down)
    m = np.arange(2 * half + 1) - half
    h = cutoff * np.sinc(cutoff * m) * np.kaiser(2 * half + 1, KAISER_BETA)
    h = (h / h.sum()).astype(np.float32)
    h *= np.float32(up)
    pre = down - half % down  # resample_poly's n_pre_pad: output samples land on the filter's centre
    return np.concatenate([np.zeros(pre, np.float32), h]), (half + pre) // down


class Resampler:
    """NeMo's (lhotse's) resampling of one stream, fed in blocks of any size.
    `resample_chunk(x, last)` has soxr.ResampleStream's signature; all it returns comes to
    `output_length` of what was fed."""

    def __init__(self, source_rate: int, target_rate: int):
        self.source_rate, self.target_rate = source_rate, target_rate
        g = math.gcd(source_rate, target_rate)
        self.orig, self.new = orig, new = source_rate // g, target_rate // g
        h, skip = _filter(new, orig)
        # Output p of a group reads input j (from the group's first) through tap (p + skip) * orig - j * new.
        centre = (np.arange(new) + skip) * orig
        first = -((h.shape[0] - 1 - centre) // new)  # the lowest j whose tap is inside h (ceil division)
        last = centre // new
        self.width = int(max(0, -first.min()))  # inputs before the group's first that it reads
        self.span = self.width + int(last.max()) + 1
        if new * self.span <= DENSE_MAX:
            # Input c of a group is row g + q, column r of the input seen as [rows, orig]
            # (c = q * orig + r), so the kernel is `shifts` products with [orig, new] slices.
            self.cols = None
            self.shifts = -(-self.span // orig)
            cols = np.arange(self.shifts * orig)[None, :]
            kernel = self._taps(h, centre, cols)
            self.kernel_t = [np.ascontiguousarray(kernel[:, q * orig:(q + 1) * orig].T) for q in range(self.shifts)]
        else:  # each phase's own band of taps
            band = int((last - first).max()) + 1
            start = np.minimum(first + self.width, self.span - band)
            self.cols = start[:, None] + np.arange(band)[None, :]
            self.taps = self._taps(h, centre, self.cols)
        self.chunk = max(CHUNK_OUTPUTS // new, 1)  # groups a product computes
        self._buf = np.zeros(self.width, np.float32)  # the zeros before the input, then the input
        self._offset = 0  # index in the padded stream of _buf[0]
        self._group = 0  # next group to compute
        self._fed = 0
        self._emitted = 0

    def _taps(self, h: np.ndarray, centre: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """kernel[p, c] for columns `cols` ([new, k] or [1, k]): h's tap, 0 outside h."""
        at = centre[:, None] - (cols - self.width) * self.new
        inside = (at >= 0) & (at < h.shape[0])
        return np.where(inside, h[np.clip(at, 0, h.shape[0] - 1)], np.float32(0))

    def resample_chunk(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        """Outputs of each whole chunk of groups whose inputs are all in; with `last`, of every
        group up to resample_poly's ceil(n * new / orig) outputs (the end zero-padded), of which
        lhotse keeps `output_length`. A group is computed once all it reads is in, so before
        `last` the outputs stay short of that length, and only the last call is cut."""
        self._fed += x.shape[0]
        self._buf = np.concatenate([self._buf, np.asarray(x, np.float32)])
        if last:
            outputs = -(-self._fed * self.new // self.orig)  # ceil: resample_poly's n_out
            end = -(-outputs // self.new)
            short = (end - 1) * self.orig + self.span - (self._offset + self._buf.shape[0])
            if short > 0:
                self._buf = np.concatenate([self._buf, np.zeros(short, np.float32)])
        else:  # groups whose last input has arrived, in whole chunks
            ready = max((self._offset + self._buf.shape[0] - self.span) // self.orig + 1, 0)
            end = self._group + (ready - self._group) // self.chunk * self.chunk
        outs = [self._groups(a, min(a + self.chunk, end)) for a in range(self._group, end, self.chunk)]
        self._group = max(self._group, end)
        drop = self._group * self.orig - self._offset  # inputs no later group reads
        if drop > 0:
            self._buf = self._buf[drop:]
            self._offset += drop
        out = np.concatenate(outs) if outs else np.zeros(0, np.float32)
        if last:
            out = out[:max(output_length(self._fed, self.source_rate, self.target_rate) - self._emitted, 0)]
        self._emitted += out.shape[0]
        return out

    def _groups(self, first: int, end: int) -> np.ndarray:
        """Outputs of groups [first, end) as [n * new] float32."""
        at = first * self.orig - self._offset
        n = end - first
        if self.cols is None:
            size = (n + self.shifts - 1) * self.orig
            flat = self._buf[at:at + size]
            if flat.shape[0] < size:  # inputs that only zero taps read
                flat = np.pad(flat, (0, size - flat.shape[0]))
            rows = flat.reshape(-1, self.orig)
            out = rows[:n] @ self.kernel_t[0]
            for q in range(1, self.shifts):  # in this order always: the same sums for any blocks
                out += rows[q:q + n] @ self.kernel_t[q]
            return out.reshape(-1)
        rows = at + np.arange(n)[:, None, None] * self.orig
        return np.einsum("gpl,pl->gp", self._buf[rows + self.cols[None]], self.taps).reshape(-1)


def resample(x: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """[n] float32 at source_rate -> [output_length(n)] float32 at target_rate, in one call."""
    if source_rate == target_rate:
        return x
    return np.ascontiguousarray(Resampler(source_rate, target_rate).resample_chunk(x, last=True))
