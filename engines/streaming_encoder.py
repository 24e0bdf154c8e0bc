"""Cache-aware streaming over an existing `ConformerEncoder` (NeMo's `cache_aware_stream_step`).

For checkpoints trained for streaming (causal subsampling, causal depthwise convs,
`chunked_limited` attention with `att_context_size = [left, right]`), one step encodes one chunk
of log-mel frames per stream and reads/updates two per-layer caches:

- attention cache [L, B, C, D]: the last C = left frames of each layer's attention input
  (the output of `norm_self_att`), which later chunks use as extra keys/values;
- convolution cache [L, B, K-1, D]: the last K-1 frames of each layer's depthwise-conv input
  (after the GLU), which replace the conv's left zero padding.

Chunk geometry follows NeMo's `setup_streaming_params` (see `StreamingConfig.from_encoder`).
Every tensor of a step is batched over streams at arbitrary positions: each row carries its own
valid cache length, valid chunk length and number of leading subsampled frames to drop, and
attends over its own valid frames only. The step reuses the encoder's modules and weights, and
so its compute dtype (`ConformerEncoder.dtype`): the caches hold layer activations in that
dtype, features come in and encodings go out in fp32, as in the offline forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from engines.attention import MASK_VALUE, sinusoids
from engines.conformer import ConformerEncoder, ConformerLayer
from engines.fast_linear import apply_linear


@dataclass(frozen=True)
class StreamingConfig:
    """Chunk geometry in feature frames (10 ms) and encoder frames. Pairs are (first, later).

    chunk_frames: feature frames fed per chunk, e.g. (105, 112) = (1 + 13*8, 14*8)
    pre_encode_cache: feature frames of the previous chunk prepended to a chunk, e.g. (0, 9)
    drop_extra: leading subsampled frames dropped from a non-first chunk (they belong to the
        pre-encode cache), e.g. 2
    valid_out_len: encoder frames per full chunk (right + 1), e.g. 14
    att_cache: attention cache frames C (= left context), e.g. 70
    conv_cache: depthwise-conv cache frames (kernel - 1), e.g. 8
    min_frames: feature frames a chunk needs to give one output (first, later), e.g. (1, 8)
    """

    chunk_frames: tuple[int, int]
    pre_encode_cache: tuple[int, int]
    drop_extra: int
    valid_out_len: int
    att_cache: int
    conv_cache: int
    min_frames: tuple[int, int]

    @classmethod
    def from_encoder(cls, encoder: ConformerEncoder) -> "StreamingConfig":
        """NeMo's defaults for a cache-aware checkpoint; ValueError for any other encoder."""
        cfg = encoder.cfg
        left, right = cfg.att_context_size
        conv_left, conv_right = cfg.conv_padding
        if cfg.att_context_style != "chunked_limited" or right < 0 or left < 0:
            raise ValueError("cache-aware streaming needs encoder.att_context_style=chunked_limited with "
                             f"a finite att_context_size, got {cfg.att_context_style} {list(cfg.att_context_size)}")
        if not cfg.causal_downsampling or conv_right != 0:
            raise ValueError("cache-aware streaming needs encoder.causal_downsampling=true and "
                             "encoder.conv_context_size=causal (this checkpoint was not trained for streaming)")
        factor = cfg.subsampling_factor
        lookahead = right  # chunked_limited: the chunk itself is the lookahead
        pre_cache = factor + 1  # NeMo's causal ConvSubsampling streaming cache
        return cls(
            chunk_frames=(1 + lookahead * factor, (lookahead + 1) * factor),
            pre_encode_cache=(0, pre_cache),
            drop_extra=1 + (pre_cache - 1) // factor,
            valid_out_len=lookahead + 1,
            att_cache=left,
            conv_cache=conv_left,
            min_frames=(1, factor),
        )


@dataclass
class EncoderCaches:
    """Per-row caches of one step. att [L, B, C, D], conv [L, B, K-1, D], att_len [B] int64."""

    att: Tensor
    conv: Tensor
    att_len: Tensor


class CacheAwareEncoder:
    """Runs `ConformerEncoder` chunk by chunk with caches; see the module docstring."""

    def __init__(self, encoder: ConformerEncoder):
        self.encoder = encoder
        self.cfg = StreamingConfig.from_encoder(encoder)
        ecfg = encoder.cfg
        self.n_layers, self.d_model = ecfg.n_layers, ecfg.d_model
        left, right = ecfg.att_context_size
        self.att_chunk = right + 1
        self.left_chunks = left // self.att_chunk

    def initial_caches(self, batch: int, device: torch.device | str = "cpu") -> EncoderCaches:
        """Zero caches (NeMo's `get_initial_cache_state`) in the encoder's compute dtype: nothing
        cached, att_len 0."""
        c, dtype = self.cfg, self.encoder.dtype
        return EncoderCaches(
            att=torch.zeros(self.n_layers, batch, c.att_cache, self.d_model, device=device, dtype=dtype),
            conv=torch.zeros(self.n_layers, batch, c.conv_cache, self.d_model, device=device, dtype=dtype),
            att_len=torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @torch.inference_mode()
    def step(self, features: Tensor, lengths: Tensor, drop: Tensor, caches: EncoderCaches
             ) -> tuple[Tensor, Tensor, EncoderCaches]:
        """One chunk per row.

        features [B, n_mels, F] log-mel (pre-encode cache frames first, then the chunk, zero
        padded on the right), lengths [B] valid feature frames, drop [B] leading subsampled
        frames to discard (0 for a first chunk, `cfg.drop_extra` after). Returns
        (encodings [B, T, D] float32, valid frames [B] int64, updated caches). Caches are not
        modified.
        """
        x, length, pos, att_mask, pad_mask = self._prepare(features, lengths, drop, caches.att_len)
        att_next, conv_next = [], []
        for i, layer in enumerate(self.encoder.layers):
            def attend(h: Tensor, attn=layer.self_attn, cache=caches.att[i]) -> Tensor:
                return _attention_step(attn, h, torch.cat((cache, h), dim=1), pos, att_mask)

            x, h, c = _layer_step(layer, x, attend, pad_mask, caches.conv[i], length)
            att_next.append(_shift_cache(caches.att[i], h, length))
            conv_next.append(c)
        new_len = torch.clamp(caches.att_len + length, max=self.cfg.att_cache)
        return x.float(), length, EncoderCaches(torch.stack(att_next), torch.stack(conv_next), new_len)

    @torch.inference_mode()
    def step_in_pool(self, features: Tensor, lengths: Tensor, drop: Tensor, pool_att: Tensor, pool_conv: Tensor,
                     idx: Tensor, att_len: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`step` on pool rows with the fused Triton attention (`engines.stream_attention_triton`):
        layers read their attention cache from `pool_att` [L, S, C, D] at slots idx [B], no
        gathered copy, and it is updated in place; `pool_conv` [L, S, K-1, D] is gathered and
        scattered back. att_len [B]: the rows' valid attention frames (not modified). Returns
        (encodings, valid frames, the rows' next att_len). All writes come after every kernel
        read, attention caches in one launch: a kernel failing to build (`KernelUnavailable`)
        leaves the pool as it was, and the caller can redo the step with `step`."""
        from engines.stream_attention_triton import fused_cache_attention, shift_cache_by_index_  # imports us

        x, length, pos, att_mask, pad_mask = self._prepare(features, lengths, drop, att_len)
        conv = pool_conv.index_select(1, idx)
        hs, conv_next = [], []
        for i, layer in enumerate(self.encoder.layers):
            def attend(h: Tensor, attn=layer.self_attn, cache=pool_att[i]) -> Tensor:
                return fused_cache_attention(attn, h, cache, idx, att_len, length, pos, att_mask, use_triton=True,
                                             att_chunk=self.att_chunk, left_chunks=self.left_chunks)

            x, h, c = _layer_step(layer, x, attend, pad_mask, conv[i], length)
            hs.append(h)
            conv_next.append(c)
        n_layers, n_slots, c_att, d = pool_att.shape
        # Layer l's slot s is row l * S + s of the flattened pool: one launch shifts every layer.
        rows = (torch.arange(n_layers, device=idx.device)[:, None] * n_slots + idx).flatten()
        shift_cache_by_index_(pool_att.view(n_layers * n_slots, c_att, d), rows, torch.cat(hs),
                              length.repeat(n_layers), use_triton=True)
        pool_conv.index_copy_(1, idx, torch.stack(conv_next))
        return x.float(), length, torch.clamp(att_len + length, max=self.cfg.att_cache)

    def _prepare(self, features: Tensor, lengths: Tensor, drop: Tensor, att_len: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Subsample and right-align the chunk: (x [B, t, D], valid frames [B], pos, att mask, pad mask)."""
        enc = self.encoder
        x, sub_len = enc.pre_encode(features.transpose(1, 2).to(enc.dtype), lengths, masked=True)
        if enc.xscale != 1.0:
            x = x * enc.xscale
        drop = drop.to(torch.int64)
        length = (sub_len - drop).clamp(min=0)
        t = max(int(length.max()), 1) if length.numel() else 1
        # Right-align every row on its own drop: row b keeps frames drop[b] ... drop[b] + t - 1.
        idx = (drop[:, None] + torch.arange(t, device=x.device)).clamp(max=x.size(1) - 1)
        x = x.gather(1, idx[:, :, None].expand(-1, -1, x.size(2)))
        att_mask, pad_mask = self._masks(length, att_len, t, x.dtype)
        return x, length, self._pos_table(t, x.dtype), att_mask, pad_mask

    def _pos_table(self, t: int, dtype: torch.dtype) -> Tensor:
        """Sinusoids of relative positions C+t-1 ... -(t-1) (query i at C+i, key j at j): [C+2t-1, D]."""
        c = self.cfg.att_cache
        pos_enc = self.encoder.pos_enc
        if c + t <= pos_enc.max_len:
            center = pos_enc.max_len - 1  # row of relative position 0
            return pos_enc.pe[0, center - (c + t - 1): center + t]
        positions = torch.arange(c + t - 1, -t, -1, dtype=torch.float32, device=pos_enc.pe.device)
        return sinusoids(positions, self.d_model).to(dtype)

    def _masks(self, length: Tensor, att_len: Tensor, t: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Additive attention mask [B, 1, t, C+t] and conv pad mask [B, t, 1] (True = padded).

        Keys are the C cache slots (the last att_len[b] of them valid) followed by the chunk;
        NeMo's chunked_limited rule is applied on absolute positions 0 ... C+t-1."""
        c = self.cfg.att_cache
        dev = length.device
        key_pos = torch.arange(c + t, device=dev)
        q = torch.arange(t, device=dev)
        valid_q = q[None, :] < length[:, None]  # [B, t]
        valid_k = (key_pos[None, :] >= c - att_len[:, None]) & (key_pos[None, :] < c + length[:, None])
        chunk = torch.div(key_pos, self.att_chunk, rounding_mode="trunc")
        back = chunk[c:, None] - chunk[None, :]  # query chunk - key chunk: [t, C+t]
        visible = (back >= 0) & (back <= self.left_chunks)
        pair = valid_q[:, :, None] & valid_k[:, None, :] & visible[None]
        additive = torch.zeros(pair.shape, dtype=dtype, device=dev).masked_fill(~pair, MASK_VALUE)
        return additive[:, None], ~valid_q[:, :, None]


def _shift_cache(cache: Tensor, new: Tensor, length: Tensor) -> Tensor:
    """Last `cache.size(1)` frames of each row's cat(cache, new[:length]): [B, C, D]."""
    both = torch.cat((cache, new), dim=1)
    size = cache.size(1)
    idx = length[:, None] + torch.arange(size, device=new.device)
    return both.gather(1, idx[:, :, None].expand(-1, -1, both.size(2)))


def _layer_step(layer: ConformerLayer, x: Tensor, attend: Callable[[Tensor], Tensor], pad_mask: Tensor,
                conv_cache: Tensor, length: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`ConformerLayer.forward` with caches: x [B, t, D] -> (x, the attention input h [B, t, D]
    that the attention cache takes next, next conv cache). `attend(h)` is the cache-aware
    self-attention over [cache | h] (`_attention_step`, or the fused kernel on the pool)."""
    x = torch.add(x, layer.feed_forward1(layer.norm_feed_forward1(x)), alpha=0.5)
    h = layer.norm_self_att(x)
    x = x + attend(h)
    conv_out, conv_next = _conv_step(layer.conv, layer.norm_conv(x), conv_cache, pad_mask, length)
    x = x + conv_out
    x = torch.add(x, layer.feed_forward2(layer.norm_feed_forward2(x)), alpha=0.5)
    return layer.norm_out(x), h, conv_next


def _attention_step(attn: nn.Module, x: Tensor, kv: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
    """Relative-position MHSA of t queries over C+t keys (NeMo's attention with `update_cache`).

    x [B, t, D] queries; kv [B, C+t, D] cache then chunk; pos [C+2t-1, D] sinusoids of relative
    positions C+t-1 ... -(t-1); mask additive [B, 1, t, C+t] -> [B, t, D]."""
    b, t, _ = x.shape
    n = kv.size(1)
    h, d_k = attn.h, attn.d_k
    q = attn.linear_q(x).view(b, t, h, d_k)
    k = attn.linear_k(kv).view(b, n, h, d_k).transpose(1, 2)
    v = attn.linear_v(kv).view(b, n, h, d_k).transpose(1, 2)
    p = attn.linear_pos(pos).view(-1, h, d_k)  # [C+2t-1, H, d_k]
    scale = 1.0 / math.sqrt(d_k)
    q_u = (q + attn.pos_bias_u).transpose(1, 2)
    q_v = ((q + attn.pos_bias_v) * scale).transpose(1, 2)  # SDPA scales q.k, not the mask
    bd = torch.matmul(q_v, p.permute(1, 2, 0))  # [B, H, t, C+2t-1]; column m = position C+t-1-m
    # Query i, key j need position C+i-j, at column t-1-i+j: a strided view, no copy.
    s0, s1, s2, _ = bd.stride()
    bd = bd.as_strided((b, h, t, n), (s0, s1, s2 - 1, 1), bd.storage_offset() + t - 1)
    out = nn.functional.scaled_dot_product_attention(q_u, k, v, attn_mask=bd + mask)
    return attn.linear_out(out.transpose(1, 2).reshape(b, t, h * d_k))


def _conv_step(conv: nn.Module, x: Tensor, cache: Tensor, pad_mask: Tensor, length: Tensor
               ) -> tuple[Tensor, Tensor]:
    """`ConformerConvolution.forward` with the causal conv's left padding read from `cache`
    (NeMo's CausalConv1D.update_cache): x [B, t, D], cache [B, K-1, D] -> ([B, t, D], next cache)."""
    x = nn.functional.glu(apply_linear(conv.pointwise_conv1, x), dim=-1)
    x = x.masked_fill(pad_mask, 0.0)  # padded frames must not enter the cache or the kernel
    both = torch.cat((cache, x), dim=1)  # [B, K-1+t, D]
    w = conv.depthwise_conv.weight.unsqueeze(2)  # [D, 1, 1, K]
    y = nn.functional.conv2d(both.transpose(1, 2).unsqueeze(2), w, conv.depthwise_conv.bias, groups=w.size(0))
    y = y.squeeze(2).transpose(1, 2)  # [B, t, D]
    if isinstance(conv.batch_norm, nn.BatchNorm1d):
        y = conv.batch_norm(y.transpose(1, 2)).transpose(1, 2)
    elif isinstance(conv.batch_norm, nn.LayerNorm):
        y = conv.batch_norm(y)
    y = apply_linear(conv.pointwise_conv2, nn.functional.silu(y))
    return y, _shift_cache(cache, x, length)


@dataclass(frozen=True)
class ChunkSpan:
    """Feature frames [start, end) of one chunk, with the pre-encode cache [cache_start, start)."""

    start: int
    end: int
    cache_start: int
    first: bool


def next_chunk(start: int, available: int, final: bool, cfg: StreamingConfig) -> ChunkSpan | None:
    """The chunk starting at feature frame `start` when `available` frames exist (NeMo's
    `CacheAwareStreamingAudioBuffer`, first chunk without dropping pre-encoded frames).

    None while the chunk is incomplete and the stream is not `final`, or when the frames left
    at the end are too few to give one encoder frame (NeMo drops them too)."""
    first = start == 0
    size = cfg.chunk_frames[0 if first else 1]
    end = min(start + size, available)
    if end - start < size and not final:
        return None
    if end - start < cfg.min_frames[0 if first else 1]:
        return None
    cache = cfg.pre_encode_cache[0 if first else 1]
    return ChunkSpan(start, end, max(start - cache, 0), first)


def chunk_plan(n_frames: int, cfg: StreamingConfig) -> list[ChunkSpan]:
    """Every chunk of a complete stream of `n_frames` feature frames."""
    spans: list[ChunkSpan] = []
    start = 0
    while (span := next_chunk(start, n_frames, True, cfg)) is not None:
        spans.append(span)
        start = span.end
    return spans


def chunk_features(features: Tensor, span: ChunkSpan, cfg: StreamingConfig) -> Tensor:
    """features [n_mels, N] -> the chunk with its pre-encode cache [n_mels, cache + chunk]; a
    cache shorter than configured (stream start) is zero-padded on the left, as in NeMo."""
    x = features[:, span.cache_start: span.end]
    want = cfg.pre_encode_cache[0 if span.first else 1]
    missing = want - (span.start - span.cache_start)
    return nn.functional.pad(x, (missing, 0)) if missing > 0 else x
