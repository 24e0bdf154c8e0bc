"""Fused streaming attention over the pool's caches, read by slot index (Triton, CUDA).

`StreamPool.step` gathers the active slots' attention caches with `index_select`, runs
`_attention_step` over [cache | chunk] with an additive mask, then scatters the next caches back
with `index_copy_`. Profiles of this pattern (Deepgram's Flux write-up) show the gather costing
about as much as the attention, and SDPA computing every masked (invalid) cache row anyway.
The kernel here instead, per (stream row b, head h, block of queries):

- reads stream b's cache rows straight from the pool's layer cache [S, C, D] at slot idx[b],
  and only rows C - att_len[b] ... C - 1 (the valid ones) plus the chunk's valid frames;
- projects those rows to keys and values in registers (the cache holds the layer's normalised
  input, NeMo's layout, not keys/values), so no [B, C+t, D] copy or K/V tensor is written;
- applies NeMo's `chunked_limited` visibility rule (as `CacheAwareEncoder._masks`) in the
  kernel, skipping key blocks no query of the block can see, with an online softmax.

The relative-position term q_v . p is one batched matmul [B, H, t, C+2t-1] before the kernel
(it does not touch the cache); the kernel reads it skewed (query i, key j -> column t-1-i+j), as
`_attention_step` does with `as_strided`.

`shift_cache_by_index_` writes the new frames into the pool by slot index and length in place
(the pool's cache is a right-aligned sliding window, so Deepgram's `cache[idx, len-1] = new`
becomes "shift left by length, append the valid new frames").

Both have torch fallbacks; `fused_cache_attention(..., use_triton=None)` picks the kernel on
CUDA when `triton` imports and logs why it falls back otherwise. Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported) runs the same kernels on CPU tensors,
which is how the tests check them without a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os

import torch
from torch import Tensor, nn

from engines.streaming_encoder import _attention_step, _shift_cache

log = logging.getLogger(__name__)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernels():
    """(triton, attention kernel, shift kernel), imported on first use so that importing this
    module needs no triton."""
    try:
        import triton

        from engines import stream_attention_kernels as k
    except ImportError as e:
        raise ImportError("the fused streaming attention kernel needs the `triton` package "
                          "(pip install triton; it ships with CUDA builds of torch)") from e
    return triton, k.attn_kernel, k.shift_kernel


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


@functools.cache
def triton_available() -> bool:
    """Whether `triton` is installed, found without importing it (an import costs ~1 s, and
    the kernels themselves are built on first use anyway, where a broken install raises)."""
    return importlib.util.find_spec("triton") is not None


def _kernel_unusable(attn: nn.Module, x: Tensor, cache: Tensor) -> str | None:
    """Why the kernel cannot run these inputs (None = it can)."""
    if not (x.is_cuda or _interpreting()):
        return f"tensors are on {x.device}, the kernel needs CUDA (or TRITON_INTERPRET=1)"
    if not triton_available():
        return "the triton package is not installed"
    linears = (attn.linear_q, attn.linear_k, attn.linear_v, attn.linear_pos, attn.linear_out)
    if not all(type(m) is nn.Linear for m in linears):  # e.g. oneDNN-packed (CPU) linears
        return "the attention's linears are not plain nn.Linear"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or cache.dtype != x.dtype:
        return f"dtype {x.dtype} (cache {cache.dtype}) is not supported"
    return None


def kernel_unusable(attns: list[nn.Module], device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run these attentions on `device` / `dtype` (None = it can)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    return next((r for a in attns if (r := _kernel_unusable(a, probe, probe)) is not None), None)


class KernelUnavailable(RuntimeError):
    """A fused kernel failed to build or launch (a Triton compile, resource or launcher error);
    raised before the kernel wrote anything."""


def _launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    from triton.errors import TritonError  # CompilationError, OutOfResources, PTXASError, InterpreterError

    try:
        kernel[grid](*args, **meta)
    except (TritonError, RuntimeError) as e:  # RuntimeError: launcher build / driver failures
        raise KernelUnavailable(f"{getattr(kernel, '__name__', 'kernel')}: {type(e).__name__}: {e}") from e


_warned: set[str] = set()


def fused_cache_attention(attn: nn.Module, x: Tensor, cache: Tensor, idx: Tensor, att_len: Tensor,
                          length: Tensor, pos: Tensor, mask: Tensor | None, *, att_chunk: int,
                          left_chunks: int, use_triton: bool | None = None) -> Tensor:
    """One layer's cache-aware attention, reading the pool's cache by slot index.

    Same result as `_attention_step(attn, x, cat(cache[idx], x), pos, mask)` for valid query
    rows (rows t >= length[b] are padding: zeros from the kernel, don't-care from torch).

    attn: the layer's `RelPositionMultiHeadAttention`
    x [B, t, D]: the layer's normalised input for this chunk (queries, and the chunk's keys)
    cache [S, C, D]: the pool's attention cache of this layer (`pool.att[layer]`), any slot
        order; row b reads slot idx[b], whose last att_len[b] frames are valid
    idx [B] int64 slots (distinct); att_len [B] valid cache frames; length [B] valid chunk frames
    pos [C+2t-1, D]: `CacheAwareEncoder._pos_table(t)` (relative positions C+t-1 ... -(t-1))
    mask: the additive [B, 1, t, C+t] mask of `CacheAwareEncoder._masks`; used by the torch path
        only (the kernel applies the same rule from att_len, length, att_chunk, left_chunks)
    att_chunk, left_chunks: `CacheAwareEncoder.att_chunk` / `.left_chunks`
    use_triton: True = the kernel (errors if it cannot run), False = torch, None = the kernel
        on CUDA when triton imports, else torch (the reason logged once)
    -> [B, t, D] (after linear_out)
    """
    reason = _kernel_unusable(attn, x, cache)
    if use_triton is None:
        use_triton = reason is None
        if reason is not None and x.is_cuda and reason not in _warned:
            _warned.add(reason)
            log.warning("fused streaming attention off, using torch: %s", reason)
    elif use_triton and reason is not None:
        raise RuntimeError(f"use_triton=True but the fused streaming attention cannot run: {reason}")
    if not use_triton:
        if mask is None:
            raise ValueError("the torch path of fused_cache_attention needs the additive mask")
        kv = torch.cat((cache.index_select(0, idx), x), dim=1)
        return _attention_step(attn, x, kv, pos, mask)
    return _triton_attention(attn, x, cache, idx, att_len, length, pos, att_chunk, left_chunks)


def _triton_attention(attn: nn.Module, x: Tensor, cache: Tensor, idx: Tensor, att_len: Tensor,
                      length: Tensor, pos: Tensor, att_chunk: int, left_chunks: int) -> Tensor:
    triton, attn_kernel, _ = _kernels()
    b, t, d = x.shape
    h, d_k = attn.h, attn.d_k
    c = cache.size(1)
    if cache.size(2) != d or pos.size(0) != c + 2 * t - 1:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, cache {tuple(cache.shape)}, pos {tuple(pos.shape)}")
    scale = 1.0 / math.sqrt(d_k)
    q = attn.linear_q(x).view(b, t, h, d_k)
    # Both score terms carry the 1/sqrt(d_k) of SDPA: fold it into the queries.
    q_u = ((q + attn.pos_bias_u) * scale).transpose(1, 2).contiguous()  # [B, H, t, d_k]
    q_v = ((q + attn.pos_bias_v) * scale).transpose(1, 2)
    p = attn.linear_pos(pos).view(-1, h, d_k)  # [C+2t-1, H, d_k]
    bd = torch.matmul(q_v, p.permute(1, 2, 0)).contiguous()  # [B, H, t, C+2t-1]
    x = x.contiguous()
    if cache.stride(2) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    w_k, w_v = attn.linear_k.weight.contiguous(), attn.linear_v.weight.contiguous()
    b_k, b_v = attn.linear_k.bias, attn.linear_v.bias
    has_bias = b_k is not None
    out = torch.empty(b, t, h * d_k, device=x.device, dtype=x.dtype)
    block_m = 16  # t is one chunk (e.g. 14): one query block; the least tl.dot takes
    grid = (b, h, triton.cdiv(t, block_m))
    _launch(
        attn_kernel, grid, q_u, bd, cache, idx, att_len, x, length, w_k, b_k if has_bias else w_k, w_v, b_v if has_bias else w_v, out,
        q_u.stride(0), q_u.stride(1), q_u.stride(2), bd.stride(0), bd.stride(1), bd.stride(2),
        cache.stride(0), cache.stride(1), x.stride(0), x.stride(1), w_k.stride(0), out.stride(0), out.stride(1),
        t, c, d, d_k, att_chunk, left_chunks,
        HAS_BIAS=has_bias, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=32, BLOCK_K=_pow2(d_k),
    )
    return attn.linear_out(out)


def shift_cache_by_index_(cache: Tensor, idx: Tensor, new: Tensor, length: Tensor,
                          use_triton: bool | None = None) -> None:
    """In place: cache[idx[b]] = the last C frames of cat(cache[idx[b]], new[b, :length[b]]).

    cache [S, C, D] one layer of the pool (att or conv cache), idx [B] distinct int64 slots,
    new [B, t, D], length [B] with length <= t. The same update as `_shift_cache` followed by
    `index_copy_`, without the gathered copy. use_triton as in `fused_cache_attention` (no log).
    """
    if use_triton is None:
        use_triton = (new.is_cuda or _interpreting()) and triton_available()
    if not use_triton:
        cache.index_copy_(0, idx, _shift_cache(cache.index_select(0, idx), new, length))
        return
    triton, _, shift_kernel = _kernels()
    if cache.stride(2) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    new = new.contiguous()
    b, _, d = new.shape
    c = cache.size(1)
    block_d = 32
    _launch(
        shift_kernel, (b, triton.cdiv(d, block_d)), cache, idx, new, length, cache.stride(0), cache.stride(1), new.stride(0), new.stride(1), c, d,
        BLOCK_C=_pow2(c), BLOCK_D=block_d)
