"""Transformer-XL relative-position self-attention, as in NeMo's `RelPositionMultiHeadAttention`
and `RelPositionalEncoding`, computed with `scaled_dot_product_attention`.

Score of query i on key j, per head (Transformer-XL, arXiv:1901.02860 section 3.3):

    s[i, j] = ((q_i + u) . k_j + (q_i + v) . p(i - j)) / sqrt(d_k)

where p(r) is the projected sinusoidal embedding of relative position r. The content term is
SDPA's own q.k; the position term ("bd") is computed once per layer against all 2T-1 relative
positions and folded, together with any padding / context mask, into SDPA's additive mask.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# NeMo fills masked scores with -10000 (not -inf): a fully masked (padded) query row then stays
# finite, so no NaN can leak from padded frames into valid ones.
MASK_VALUE = -10000.0


def sinusoids(positions: Tensor, d_model: int) -> Tensor:
    """NeMo's sinusoidal table: positions [N] (float32) -> [N, d_model], sin on even channels."""
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=positions.device) * -(math.log(10000.0) / d_model)
    )
    angles = positions.to(torch.float32)[:, None] * div_term
    pe = torch.zeros(positions.numel(), d_model, device=positions.device)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe


class RelPositionalEncoding(nn.Module):
    """Relative positions max_len-1 ... -(max_len-1) as a [1, 2*max_len-1, d_model] table.

    The table is a non-persistent buffer (never in checkpoints): `materialise` fills it after
    the module was built on the meta device. Longer inputs get their slice computed on the fly.
    """

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.register_buffer("pe", torch.empty(1, 2 * max_len - 1, d_model), persistent=False)

    def materialise(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        positions = torch.arange(self.max_len - 1, -self.max_len, -1, dtype=torch.float32, device=device)
        self.pe = sinusoids(positions, self.d_model).unsqueeze(0).to(dtype)

    def forward(self, frames: int) -> Tensor:
        """Embeddings of relative positions frames-1 ... -(frames-1): [1, 2*frames-1, d_model]."""
        if frames > self.max_len:
            positions = torch.arange(frames - 1, -frames, -1, dtype=torch.float32, device=self.pe.device)
            return sinusoids(positions, self.d_model).unsqueeze(0).to(self.pe.dtype)
        center = self.max_len - 1  # row of relative position 0
        return self.pe[:, center - frames + 1 : center + frames]


def rel_shift(bd: Tensor) -> Tensor:
    """[B, H, T, 2T-1] scores against positions T-1 ... -(T-1) -> [B, H, T, T] against i - j.

    Row i, column j needs relative position i - j, stored at column (T-1) - (i - j). A strided
    view reads exactly those: with row stride s, offset(i, j) = i*s + T-1 - i + j
    = i*(s-1) + j + (T-1), so no copy is made (NeMo's pad-and-reshape trick costs one).
    """
    b, h, t, n = bd.shape
    if bd.stride(-1) != 1:
        bd = bd.contiguous()
    s0, s1, s2, _ = bd.stride()
    return bd.as_strided((b, h, t, t), (s0, s1, s2 - 1, 1), bd.storage_offset() + n // 2)


def position_scores(q_v: Tensor, p: Tensor) -> Tensor:
    """(q_i + v) . p(r) for every query and relative position: q_v [B, T, H, d_k], p [2T-1, H, d_k]
    -> [B, H, T, 2T-1] (a permuted view). One GEMM over all B*T rows per head: no broadcast copy
    of p per batch row. (The CPU's oneDNN path is `shifted_position_scores`.)"""
    b, t, h, d_k = q_v.shape
    q = q_v.permute(2, 0, 1, 3).reshape(h, b * t, d_k)
    s = torch.bmm(q, p.permute(1, 2, 0))
    return s.view(h, b, t, -1).transpose(0, 1)


def shifted_position_scores(q_v: Tensor, p: Tensor, mask: Tensor | None) -> Tensor:
    """`rel_shift(position_scores(q_v, p)) + mask` on the CPU with oneDNN's GEMM (~1.5x MKL's
    here), one head at a time: each head's [B*T, 2T-1] scores are shifted (a view) and added to
    the mask straight into that head's slice of the [B, H, T, T] result, so the [B, H, T, 2T-1]
    scores are never stacked (that copy, and the mask's add over the whole, cost ~10 % of the
    bf16 encoder)."""
    b, t, h, d_k = q_v.shape
    q = q_v.permute(2, 0, 1, 3).reshape(h, b * t, d_k)
    pc = p.transpose(0, 1).contiguous()  # oneDNN is fast only on a contiguous [N, K] weight
    out = q_v.new_empty(b, h, t, t)
    for i in range(h):
        s = torch.ops.mkldnn._linear_pointwise(q[i], pc[i], None, "none", [], "")
        shifted = rel_shift(s.view(b, 1, t, 2 * t - 1))[:, 0]
        if mask is None:
            out[:, i].copy_(shifted)
        else:
            torch.add(shifted, mask[:, 0], out=out[:, i])
    return out


def rel_shift_export(bd: Tensor) -> Tensor:
    """`rel_shift` by NeMo's pad-and-reshape trick: only views and a pad, which ONNX expresses."""
    b, h, t, n = bd.shape
    bd = nn.functional.pad(bd, (1, 0)).view(b, h, n + 1, t)
    return bd[:, :, 1:].reshape(b, h, t, n)[..., :t]


class RelPositionMultiHeadAttention(nn.Module):
    """Self-attention with relative positions. Parameter names are NeMo's.

    pos_bias_u / pos_bias_v [H, d_k] are per layer (untie_biases) or one pair shared by all
    layers; either way NeMo's checkpoint stores them under every layer's name.
    """

    def __init__(self, n_heads: int, d_model: int, use_bias: bool):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"encoder.d_model={d_model} is not a multiple of encoder.n_heads={n_heads}")
        self.h = n_heads
        self.d_k = d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_k = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_v = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_out = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.export_mode = False  # True: ONNX-friendly rel_shift
        self.onednn = False  # True: position scores by oneDNN GEMMs (set with packed linears)

    def forward(self, x: Tensor, pos_emb: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, T, D]; pos_emb: [1, 2T-1, D] from RelPositionalEncoding; mask: additive
        [B or 1, 1, T, T] (0 = visible, MASK_VALUE = hidden) or None -> [B, T, D]."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb)  # [1, 2T-1, D]
        scale = 1.0 / math.sqrt(self.d_k)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        # SDPA scales q.k itself; the mask is added unscaled, so scale the position term here
        # (on q: T*d_k multiplies instead of T*T).
        q_v = (q + self.pos_bias_v) * scale
        bd = self.position_term(q_v, p, mask)
        out = nn.functional.scaled_dot_product_attention(q_u, k, v, attn_mask=bd)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k))

    def position_term(self, q_v: Tensor, p: Tensor, mask: Tensor | None) -> Tensor:
        """q_v [B, T, H, d_k], p [1, 2T-1, D] -> SDPA's additive mask [B, H, T, T]: the scaled
        position scores by relative position i - j, plus `mask`."""
        if self.export_mode:
            p = p.view(1, -1, self.h, self.d_k).permute(0, 2, 3, 1)  # [1, H, d_k, 2T-1]
            bd = rel_shift_export(torch.matmul(q_v.transpose(1, 2), p))
        elif self.onednn:
            return shifted_position_scores(q_v, p.view(-1, self.h, self.d_k), mask)
        else:
            bd = rel_shift(position_scores(q_v, p.view(-1, self.h, self.d_k)))
        if mask is None:
            # rel_shift's view starts T-1 elements in with row stride 2T-2: SDPA's CUDA kernels
            # read the mask with vector loads, which fault on such an address in bf16/fp16
            # ("misaligned address"). A padding mask's add makes a fresh tensor anyway.
            return bd.contiguous()
        return bd + mask
