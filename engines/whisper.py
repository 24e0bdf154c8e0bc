"""Whisper in lean PyTorch: audio encoder, text decoder with a preallocated key/value cache.

Standard Whisper: conv1d stem (k=3, GELU, the second conv with stride 2), sinusoidal encoder
positions, learned decoder positions, pre-LN transformer blocks with GELU MLPs, logits tied to
the token embedding. Attention uses fused projections (one [3d, d] qkv matrix for
self-attention, [2d, d] kv for cross-attention) and `scaled_dot_product_attention`, or for the
encoder on the CPU a per-head oneDNN loop where that times faster (`full_attention`).

Precision is data, not a second copy of the layers: `build_whisper(..., dtype=, decoder_dtype=)`
stores each half's weights in its compute dtype and activations follow them; LayerNorm
parameters and arithmetic stay fp32 (`conformer.LayerNorm`), the encoder takes mel in any
float dtype, the decoder takes audio states in any float dtype and returns fp32 logits. On
the CPU every linear (the tied logits projection included) is a oneDNN-packed GEMM in its
weight's dtype (`fast_linear.PackedLinear`, GELU fused into the first MLP linear).

Internal state-dict names (every loader in `whisper_weights` maps to these):
  encoder.conv1.{weight,bias} encoder.conv2.* encoder.pos [n_audio_ctx, d] encoder.ln.*
  encoder.layers.N.{attn_ln,attn.qkv,attn.out,mlp_ln,mlp.fc1,mlp.fc2}.{weight,bias}
  decoder.embed.weight [n_vocab, d] decoder.pos [n_text_ctx, d] decoder.ln.*
  decoder.layers.N.{attn_ln,attn.qkv,attn.out,cross_ln,cross.q,cross.kv,cross.out,mlp_ln,
                    mlp.fc1,mlp.fc2}.{weight,bias}
  (decoder.head.weight, the logits projection, is decoder.embed.weight: build_whisper ties it)
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.conformer import LayerNorm
from engines.cpu_threads import DECODER_THREADS, best_seconds, decoder_threads
from engines.fast_linear import PackedLinear, onednn_linear_available, pack
from engines.precision import check_cache_dtype, check_dtype

log = logging.getLogger("transcribe")


@dataclass(frozen=True)
class WhisperDims:
    """Model shape; names follow OpenAI's `ModelDimensions`."""

    n_mels: int = 80
    n_vocab: int = 51865
    n_audio_ctx: int = 1500
    n_audio_state: int = 512
    n_audio_head: int = 8
    n_audio_layer: int = 6
    n_text_ctx: int = 448
    n_text_state: int = 512
    n_text_head: int = 8
    n_text_layer: int = 6

    def __post_init__(self) -> None:
        for key, value in vars(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"WhisperDims.{key} must be a positive int, got {value!r}")
        for state, head in (("n_audio_state", "n_audio_head"), ("n_text_state", "n_text_head")):
            if getattr(self, state) % getattr(self, head):
                raise ValueError(f"WhisperDims.{state}={getattr(self, state)} is not divisible by "
                                 f"{head}={getattr(self, head)}")


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """Whisper's encoder positions: [length, channels] = [sin(t * w_i) | cos(t * w_i)]."""
    inc = torch.log(torch.tensor(max_timescale)) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class Linear(nn.Linear):
    """nn.Linear (same parameter names), then exact GELU when activation="gelu". On the CPU
    `build_whisper` swaps each for a oneDNN-packed GEMM with the activation fused
    (`pack_linears`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "none"):
        super().__init__(in_features, out_features, bias)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return F.gelu(y) if self.activation == "gelu" else y


def _heads(x: Tensor, n_head: int) -> Tensor:
    """[B, T, d] -> [B, H, T, d/H] as a view (no copy)."""
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    """[B, H, T, dh] -> [B, T, H*dh]."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = Linear(d, 4 * d, activation="gelu"), Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x))


def full_attention(q: Tensor, k: Tensor, v: Tensor, n_head: int, kernel: str = "sdpa") -> Tensor:
    """Unmasked multi-head attention of q, k, v [B, T, d] -> [B, T, d], by `kernel` (one of
    ATTENTION_KERNELS): "sdpa" is torch's scaled_dot_product_attention (flash attention on the
    CPU); "loop" runs each (item, head) as two oneDNN GEMMs around a softmax over its [T, T]
    scores, rounded to the compute dtype first (fp32 statistics inside it), and needs oneDNN to
    compute the dtype on the CPU. Which is faster depends on the CPU (`encoder_attention_kernel`).
    """
    if kernel == "sdpa":
        h = n_head
        return _merge(F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h)))
    if kernel != "loop":
        raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")
    out = torch.empty_like(q)
    dh = q.shape[-1] // n_head
    gemm = torch.ops.mkldnn._linear_pointwise  # (x, weight [N, K]) -> x @ weight.T
    for i in range(q.shape[0]):
        for head in range(n_head):
            cols = slice(head * dh, (head + 1) * dh)
            qh, kh = (q[i, :, cols] * dh ** -0.5).contiguous(), k[i, :, cols].contiguous()
            probs = gemm(qh, kh, None, "none", [], "").softmax(-1)
            out[i, :, cols] = gemm(probs, v[i, :, cols].t().contiguous(), None, "none", [], "")
    return out


ATTENTION_KERNELS = ("sdpa", "loop")
# Inside the whole encoder the kernels differ by less than they do alone: the loop ran the base
# encoder 1.13x faster than SDPA in fp32 and 1.57x in bf16 on the AMD EPYC we measure on (SDPA
# was 60 % of the bf16 encoder's time there), while on a 2-core Intel Xeon (AVX-512, no AMX) SDPA
# ran one window-layer's attention in 23-28 ms against the loop's 37-57 and the fp32 encoder
# 1.1-1.2x faster (8.1-9.8 s against 7.4-8.1 s for 16 windows, interleaved; in `transcribe
# bench` over test-other, encoder 44.0-45.8 s against 47.9-49.7 s, the same WER). SDPA is taken only
# when it needs under this fraction of the loop's time alone; near a tie the loop, whose
# in-encoder advantage on the EPYC was measured, stays.
SDPA_MARGIN = 0.8


@functools.cache
def encoder_attention_kernel(dtype: torch.dtype, d: int, n_head: int, frames: int) -> str:
    """The faster of ATTENTION_KERNELS for the CPU encoder's self-attention over `frames` frames
    of width d in `dtype`, timed once per process and shape on one window (a warm-up, then both
    interleaved, best of 2: cpu_threads.best_seconds; ~0.25 s for base's 1500 x 512): "sdpa" if
    it needs under SDPA_MARGIN of the loop's time, else "loop". "sdpa" without timing where
    oneDNN cannot compute `dtype` (the loop needs it)."""
    if not onednn_linear_available(dtype):
        return "sdpa"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, frames, d, generator=gen).to(dtype) for _ in range(3))
    runs = {kernel: functools.partial(full_attention, q, k, v, n_head, kernel) for kernel in ATTENTION_KERNELS}
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up: oneDNN primitive creation, first touch of the score buffers
        best = best_seconds(runs, 2)
    kernel = "sdpa" if best["sdpa"] < SDPA_MARGIN * best["loop"] else "loop"
    log.debug("encoder attention (%s, %d frames x %d): sdpa %.1f ms, loop %.1f ms: %s", dtype, frames, d,
              1e3 * best["sdpa"], 1e3 * best["loop"], kernel)
    return kernel


# The decoder's cross-attention cache (every layer's K/V of the audio, projected once per window)
# is read whole at every token step for one query per row: memory traffic more than arithmetic.
# Over a bf16 cache, torch's SDPA (the query cast to bf16 and the output back to fp32) took 0.51-0.59
# of the fp32 cache's time on a 2-core Intel Xeon with AVX512_BF16 (2-16 rows; 2.0 against 4.3 ms
# for 16 rows on one thread), where torch's bf16 attention had run 3.4x slower than fp32 on the AMD
# EPYC we measure on. So the store's dtype is timed, as the encoder's attention kernel is, and bf16
# is taken only when it needs under this fraction of fp32's time.
CROSS_BF16_MARGIN = 0.8


@functools.cache
def cross_cache_dtype(d: int, n_head: int, frames: int, n_layer: int) -> torch.dtype:
    """The dtype the fp32 CPU decoder's cross-attention K/V cache is stored in: bfloat16 if one
    token step's attention over it (4 rows, one query each over `frames` audio frames of width
    d, `n_layer` times) needs under CROSS_BF16_MARGIN of an fp32 cache's time, timed once per
    process and shape (a warm-up, then both interleaved, best of 5: cpu_threads.best_seconds;
    ~0.1 s for base), else float32. Small enough to stay in the CPU's caches, which favours
    fp32: a real step's cache (16 windows x 6 layers x 2 x 3 MB for base) is read from memory,
    where halving the bytes gains more. Timed on one thread (DECODER_THREADS, the token loop's
    until it measures its own): with two, a core taken by anything else (the preprocessing
    workers start beside the model load) made the bf16/fp32 ratio jump between 0.25 and 1.81
    over 15 probes, where one thread kept it at 0.53-0.75 (0.52-0.57 idle)."""
    gen = torch.Generator().manual_seed(0)
    dh = d // n_head
    q = torch.randn(4, n_head, 1, dh, generator=gen)
    k, v = (torch.randn(4, n_head, frames, dh, generator=gen) for _ in range(2))
    caches = {dtype: (k.to(dtype), v.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}

    def step(dtype: torch.dtype) -> None:
        for _ in range(n_layer):
            F.scaled_dot_product_attention(q.to(dtype), *caches[dtype]).float()

    runs = {dtype: functools.partial(step, dtype) for dtype in caches}
    with torch.inference_mode(), decoder_threads("cpu", DECODER_THREADS):
        try:
            for run in runs.values():
                run()  # warm-up
        except RuntimeError as e:  # a torch build or CPU without bf16 attention: fp32, untimed
            log.debug("decoder cross-attention cache: float32 (bf16 attention failed: %s)", e)
            return torch.float32
        best = best_seconds(runs, 5)
    dtype = torch.bfloat16 if best[torch.bfloat16] < CROSS_BF16_MARGIN * best[torch.float32] else torch.float32
    log.debug("decoder cross-attention cache: bf16 %.2f ms, fp32 %.2f ms a step: %s", 1e3 * best[torch.bfloat16],
              1e3 * best[torch.float32], dtype)
    return dtype


class SelfAttention(nn.Module):
    """Fused-qkv self-attention (the encoder's; the decoder's cached self-attention is in
    DecoderLayer). Whisper's key projection has no bias: its slot here is zero."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv, self.out = Linear(d, 3 * d), Linear(d, d)
        self.kernel = "sdpa"  # build_whisper picks the CPU's (encoder_attention_kernel)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(full_attention(q, k, v, self.n_head, self.kernel))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.attn_ln, self.attn = LayerNorm(d), SelfAttention(d, n_head)
        self.mlp_ln, self.mlp = LayerNorm(d), MLP(d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_ln(x))
        return x + self.mlp(self.mlp_ln(x))


# On the CPU, the batch-wide work each window does on its own (the encoder, the decoder's cross
# K/V projection) runs BLOCK_WINDOWS windows at a time: a block's activations (base: the MLP's
# [2, 1500, 2048] fp32, 25 MB) stay under glibc's mmap threshold (at most 32 MB) and are reused
# from the heap, where a whole batch's were mapped fresh and faulted in page by page for every
# layer. 16 windows of base on a 2-core Intel Xeon VM: the encoder took 1.16 M page faults and
# 6.3 s against 15,000 and 5.3-5.5 s in blocks, the projection 0.72 s against 0.59 s. Elsewhere
# (CUDA's caching allocator reuses memory already) the batch is one block.
BLOCK_WINDOWS = 2


def window_blocks(n: int, device: torch.device) -> list[slice]:
    """Rows 0..n-1 of a batch of windows as the blocks it is computed in (BLOCK_WINDOWS)."""
    step = BLOCK_WINDOWS if device.type == "cpu" else max(n, 1)
    return [slice(r, r + step) for r in range(0, n, step)]


class AudioEncoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        d = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.register_buffer("pos", torch.empty(dims.n_audio_ctx, d))
        self.layers = nn.ModuleList(EncoderLayer(d, dims.n_audio_head) for _ in range(dims.n_audio_layer))
        self.ln = LayerNorm(d)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the positional table is stored in it)."""
        return self.pos.dtype

    def forward(self, mel: Tensor) -> Tensor:
        """mel: [B, n_mels, 2 * n_audio_ctx] -> audio states [B, n_audio_ctx, d] in self.dtype,
        in `window_blocks` (every window is encoded on its own anyway)."""
        blocks = window_blocks(mel.shape[0], mel.device)
        if len(blocks) <= 1:
            return self._encode(mel)
        return torch.cat([self._encode(mel[rows]) for rows in blocks])

    def _encode(self, mel: Tensor) -> Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel.to(self.dtype)))))  # [B, d, T]
        b, d, t = x.shape
        # The positions are added into a [B, T, d] buffer, transposing in the same pass: `x.mT +
        # pos` would keep the conv's channel-first strides, every residual add after it would
        # too, and each LayerNorm would copy its input to contiguous first (8 % of the encoder).
        x = torch.add(x.transpose(1, 2), self.pos[:t], out=x.new_empty(b, t, d))
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class KVCache:
    """Preallocated decoder caches for one batch of windows, filled by position count.

    self_k / self_v: [layers, slots, max_len, d], written in place at [layer, :n, length:...].
    cross_k / cross_v: [layers, slots, heads, n_audio_ctx, d / heads], computed once from the
    audio states; head-major and contiguous because every step streams all of them (the
    memory-bound part of a decoder step) and strided views made attention ~1.5x slower; in
    the decoder's `cache_dtype`, which may be bf16 under an fp32 decoder (`cross_cache_dtype`).
    Rows 0..n-1 are the live items; `keep` compacts finished ones away so every step works on
    contiguous views instead of gathering. (`whisper_static.StaticCache` is the fixed-shape
    variant the CUDA-graph modes use: written by a position tensor, attended through a mask.)
    """

    def __init__(self, self_k: Tensor, self_v: Tensor, cross_k: Tensor, cross_v: Tensor, group: int = 1):
        """group: consecutive rows that share one cross K/V row (the fallback's samples of one
        window): their queries attend together, so the audio is stored and read once."""
        self.self_k, self.self_v, self.cross_k, self.cross_v = self_k, self_v, cross_k, cross_v
        self.group = group
        self.length = 0  # positions filled so far, shared by all live rows

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write layer i's new K/V [n, T, d] at positions length..+T; return the keys and values
        to attend over and the mask (bool, True = may attend; None = all)."""
        n, t, _ = k.shape
        start = self.length
        self.self_k[i, :n, start:start + t] = k
        self.self_v[i, :n, start:start + t] = v
        # One new token may see every cached position; several need a causal mask offset by
        # what is already cached.
        mask = None if t == 1 else torch.ones(t, start + t, dtype=torch.bool, device=k.device).tril(start)
        return self.self_k[i, :n, :start + t], self.self_v[i, :n, :start + t], mask

    def cross(self, i: int, n: int) -> tuple[Tensor, Tensor]:
        rows = n // self.group
        return self.cross_k[i, :rows], self.cross_v[i, :rows]

    def keep(self, perm: list[int], n: int) -> None:
        """Rows perm[:n] (the live ones) continue as rows 0..n-1. The cross K/V rows are
        permuted whole (new row i = old row perm[i]) so finished windows' audio stays for the word
        alignment; self K/V only need the live rows. Rows already in place are not copied."""
        if self.group != 1:
            raise ValueError("rows that share cross K/V (group > 1) cannot be compacted")
        permute_rows(self.cross_k, perm, 1)
        permute_rows(self.cross_v, perm, 1)
        permute_rows(self.self_k[:, :, :self.length], perm[:n], 1)
        permute_rows(self.self_v[:, :, :self.length], perm[:n], 1)


def permute_rows(buf: Tensor, perm: list[int], dim: int) -> None:
    """buf's rows 0..len(perm)-1 along dim become its rows perm[0], perm[1], ... (in place; only
    rows that move are copied, through one gather)."""
    moved = [i for i, r in enumerate(perm) if i != r]
    if moved:
        dst = torch.tensor(moved, device=buf.device)
        src = torch.tensor([perm[i] for i in moved], device=buf.device)
        buf.index_copy_(dim, dst, buf.index_select(dim, src))  # same as: buf[dst] = buf[src] (a copy first)


class CrossAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q, self.kv, self.out = Linear(d, d), Linear(d, 2 * d), Linear(d, d)

    def forward(self, x: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """x: [n, T, d]; k, v: [n / g, H, T_audio, d/H] (see KVCache): each g consecutive rows of
        x share one row of k, v, and attend as one row of g * T queries (each query attends on
        its own, so this is exact)."""
        n, t, d = x.shape
        q = self.q(x).reshape(k.shape[0], -1, d)  # a view; with g = 1 the same shape
        # k, v may be stored in another dtype than x's (TextDecoder.cache_dtype): the query meets
        # them in theirs and the result comes back in x's.
        y = _merge(F.scaled_dot_product_attention(_heads(q, self.n_head).to(k.dtype), k, v).to(x.dtype))
        return self.out(y.reshape(n, t, d))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.attn_ln, self.attn = LayerNorm(d), SelfAttention(d, n_head)
        self.cross_ln, self.cross = LayerNorm(d), CrossAttention(d, n_head)
        self.mlp_ln, self.mlp = LayerNorm(d), MLP(d)

    def forward(self, x: Tensor, cache: KVCache, i: int) -> Tensor:
        """x: [n, T, d] new positions; `cache` (KVCache or StaticCache) stores their K/V."""
        h = self.n_head
        q, k, v = self.attn.qkv(self.attn_ln(x)).chunk(3, dim=-1)
        keys, vals, mask = cache.update(i, k, v)
        y = F.scaled_dot_product_attention(_heads(q, h), _heads(keys, h), _heads(vals, h), attn_mask=mask)
        x = x + self.attn.out(_merge(y))
        x = x + self.cross(self.cross_ln(x), *cache.cross(i, x.shape[0]))
        return x + self.mlp(self.mlp_ln(x))


class TextDecoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        d = dims.n_text_state
        # from_pretrained: no normal_ init, which on the meta device imports torch._dynamo (~1.5 s)
        self.embed = nn.Embedding.from_pretrained(torch.empty(dims.n_vocab, d), freeze=False)
        self.register_buffer("pos", torch.empty(dims.n_text_ctx, d))
        self.layers = nn.ModuleList(DecoderLayer(d, dims.n_text_head) for _ in range(dims.n_text_layer))
        self.ln = LayerNorm(d)
        self.head = Linear(d, dims.n_vocab, bias=False)  # tied: build_whisper gives it embed's weight
        # The dtype the cross-attention K/V cache is stored in: build_whisper sets it (the
        # compute dtype, or bf16 under an fp32 CPU decoder where that is faster).
        self.cache_dtype = torch.float32
        self.kept: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # batch_cache's buffers

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype, that of the self-attention cache (the token embedding is stored in
        it); the cross-attention cache's is `cache_dtype`."""
        return self.embed.weight.dtype

    @property
    def audio_dtype(self) -> torch.dtype:
        """The dtype the cross K/V are projected in: the encoder's (see build_whisper)."""
        kv = self.layers[0].cross.kv
        return kv.dtype if isinstance(kv, PackedLinear) else kv.weight.dtype

    def new_cache(self, audio: Tensor, max_len: int) -> KVCache:
        """Allocate the self-attention cache and project audio [B, T_a, d] to cross K/V once."""
        cache = KVCache(*self._cache_buffers(audio.shape[0], max_len, audio.shape[1], audio.device))
        self.project_audio(audio, cache.cross_k, cache.cross_v)
        return cache

    def batch_cache(self, audio: Tensor, max_len: int) -> KVCache:
        """`new_cache` in buffers kept from the call before (grown when a batch has more windows):
        the cache is valid until the next call. A fresh cache faults its pages in one at a time as
        the projection writes them (16 windows of base: 295 MB of cross K/V in bf16); on a 2-core
        Intel Xeon VM a 16-window greedy decode took 4.1-4.6 s with fresh caches and 3.2-3.3 s with
        kept ones, and the decoder stage of `transcribe bench` over test-other 13.7-14.4 s against
        15.1-15.6 s, for 90-160 MB more peak memory (the cache now outlives its batch, beside the
        next batch's encoder). The greedy pass's cache lives until its batch's fallback and word
        alignment are done, and batches run one after another. On CUDA the caching allocator already
        reuses memory without faults, and kept buffers would only hold memory the next batch's
        encoder could use: a fresh cache there."""
        if audio.device.type != "cpu":
            return self.new_cache(audio, max_len)
        b, t_audio = audio.shape[:2]
        kept = self.kept
        if (kept is None or kept[0].shape[1] < b or kept[0].shape[2] != max_len or kept[2].shape[3] != t_audio
                or (kept[0].dtype, kept[2].dtype) != (self.dtype, self.cache_dtype)):
            rows = b if kept is None else max(b, kept[0].shape[1])
            self.kept = None  # the old buffers go before the new ones are allocated
            self.kept = kept = self._cache_buffers(rows, max_len, t_audio, audio.device)
        cache = KVCache(*(buf[:, :b] for buf in kept))
        self.project_audio(audio, cache.cross_k, cache.cross_v)
        return cache

    def _cache_buffers(self, b: int, max_len: int, t_audio: int, device: torch.device
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Empty self K/V [layers, b, max_len, d] (compute dtype) and cross K/V
        [layers, b, heads, t_audio, d / heads] (`cache_dtype`)."""
        n, h, d = len(self.layers), self.layers[0].n_head, self.pos.shape[1]
        new = {"dtype": self.dtype, "device": device}
        cross = {"dtype": self.cache_dtype, "device": device}
        return (torch.empty(n, b, max_len, d, **new), torch.empty(n, b, max_len, d, **new),
                torch.empty(n, b, h, t_audio, d // h, **cross), torch.empty(n, b, h, t_audio, d // h, **cross))

    def project_audio(self, audio: Tensor, cross_k: Tensor, cross_v: Tensor) -> None:
        """audio [n, T_a, d] (the encoder's dtype) -> every layer's cross K/V, written into
        cross_k / cross_v [layers, n, heads, T_a, d / heads] (views of a larger buffer are fine),
        in `window_blocks`: the projection's [rows, T_a, 2d] output, copied into the head-major
        cache, is then a block the allocator reuses (16 windows of base: 98 MB a layer whole)."""
        h = self.layers[0].n_head
        audio = audio.to(self.audio_dtype)
        blocks = window_blocks(audio.shape[0], audio.device)
        for i, layer in enumerate(self.layers):
            for rows in blocks:
                k, v = layer.cross.kv(audio[rows]).chunk(2, dim=-1)
                cross_k[i, rows].copy_(_heads(k, h))
                cross_v[i, rows].copy_(_heads(v, h))

    def forward(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """tokens: [n, T] ids for positions cache.length..+T -> logits [n, T, n_vocab] (fp32)."""
        t = tokens.shape[1]
        if cache.length + t > self.pos.shape[0]:
            raise ValueError(f"decoder length {cache.length + t} exceeds n_text_ctx={self.pos.shape[0]}")
        logits = self.logits(self.embed(tokens) + self.pos[cache.length:cache.length + t], cache)
        cache.length += t
        return logits

    def logits(self, x: Tensor, cache) -> Tensor:
        """Embedded tokens with positions [n, T, d] through every layer (their K/V into `cache`,
        a KVCache or a whisper_static.StaticCache) -> logits [n, T, n_vocab] in fp32."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i)
        return self.head(self.ln(x)).float()


class Whisper(nn.Module):
    """Encoder + decoder. Build with `build_whisper` (meta device, weights assigned)."""

    def __init__(self, dims: WhisperDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)


def build_whisper(dims: WhisperDims, state: dict[str, Tensor], device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, decoder_dtype: torch.dtype | None = None,
                  cross_dtype: torch.dtype | None = None) -> Whisper:
    """Construct on the meta device (no init cost) and assign `state` on `device`, the audio
    side's weights in `dtype` (the encoder and the decoder's cross K/V projection, which reads
    the encoder's states), the rest of the decoder's in `decoder_dtype` (None: `dtype`),
    LayerNorms' in fp32, each converted from the checkpoint's own dtype; the decoder's
    cross-attention cache is stored in `cross_dtype` (None: `decoder_dtype`). Each dtype is
    checked against the device first (engines.precision.check_dtype, check_cache_dtype for the
    cache: ValueError). On the CPU the linears are then packed (`pack_linears`): the model is for
    inference only; and the encoder's attention kernel is the one timed faster on this CPU
    (`encoder_attention_kernel`)."""
    device = torch.device(device)
    decoder_dtype = decoder_dtype or dtype
    cross_dtype = cross_dtype or decoder_dtype
    for dt in {dtype, decoder_dtype}:
        check_dtype(dt, device)
    check_cache_dtype(cross_dtype, device)  # stored and attended over, never a GEMM's operand
    state = dict(state)
    if "encoder.pos" not in state:  # sinusoidal, so checkpoints may leave it out
        state["encoder.pos"] = sinusoids(dims.n_audio_ctx, dims.n_audio_state)
    with torch.device("meta"):
        model = Whisper(dims)
    norms = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)
             for p in ("weight", "bias")}

    def dtype_of(key: str) -> torch.dtype:
        if key in norms:
            return torch.float32
        audio_side = key.startswith("encoder.") or ".cross.kv." in key
        return dtype if audio_side else decoder_dtype

    state = {k: v.to(device=device, dtype=dtype_of(k)) for k, v in state.items()}
    state["decoder.head.weight"] = state["decoder.embed.weight"]  # one tensor, until packing copies it
    model.load_state_dict(state, strict=True, assign=True)
    model.decoder.cache_dtype = cross_dtype
    if device.type == "cpu":
        pack_linears(model)
        kernel = encoder_attention_kernel(dtype, dims.n_audio_state, dims.n_audio_head, dims.n_audio_ctx)
        for layer in model.encoder.layers:
            layer.attn.kernel = kernel
    return model.eval().requires_grad_(False)


def pack_linears(model: nn.Module) -> None:
    """Every `Linear` as a `fast_linear.PackedLinear` (weights reordered once for oneDNN, its
    activation fused) where oneDNN computes its weight's dtype on this CPU, else left as is.
    Packed GEMMs ran 1.5-2.2x faster than unpacked oneDNN on the AMD EPYC we measure on for the
    decoder step's [n <= 16, 512] rows and the [n, 512] x [512, 51865] logits, and 3-18 % faster
    on the encoder's [1500 B, 512] rows, in fp32 and bf16 alike; packed bf16 ran the encoder's
    GEMMs 2-2.3x faster than packed fp32."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, Linear)]
    for parent, name, child in found:
        setattr(parent, name, pack(child, child.activation))
