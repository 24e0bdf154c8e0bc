"""FastConformer encoder (NeMo's `ConformerEncoder`) for inference, in plain PyTorch.

features [B, n_mels, T] (10 ms frames) -> ConvSubsampling (T' = T / factor) -> x * sqrt(d_model)
-> n_layers x ConformerLayer -> [B, d_model, T']. Module and parameter names are NeMo's, so the
`encoder.*` entries of a `.nemo` state dict load directly (`ConformerEncoder.from_state`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from engines.fast_linear import apply_linear, pack
from engines.attention import MASK_VALUE, RelPositionalEncoding, RelPositionMultiHeadAttention
from engines.subsampling import SUPPORTED as SUBSAMPLINGS
from engines.subsampling import ConvSubsampling, subsampled_lengths

CONV_NORMS = ("batch_norm", "layer_norm")
ATT_STYLES = ("regular", "chunked_limited")


def _unsupported(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"encoder.{key}={value!r} is not supported (supported: {supported})")


@dataclass(frozen=True)
class EncoderConfig:
    """The `encoder:` section of a NeMo FastConformer config (inference-relevant keys only;
    dropout and stochastic-depth keys are accepted and ignored)."""

    feat_in: int
    n_layers: int
    d_model: int
    n_heads: int = 4
    feat_out: int = -1
    ff_expansion_factor: int = 4
    subsampling: str = "striding"
    subsampling_factor: int = 4
    subsampling_conv_channels: int = -1
    causal_downsampling: bool = False
    self_attention_model: str = "rel_pos"
    att_context_size: tuple[int, int] = (-1, -1)
    att_context_style: str = "regular"
    xscaling: bool = True
    untie_biases: bool = True
    pos_emb_max_len: int = 5000
    conv_kernel_size: int = 31
    conv_norm_type: str = "batch_norm"
    conv_context_size: tuple[int, int] | None = None  # (left, right); None = symmetric
    use_bias: bool = True

    def __post_init__(self) -> None:
        for key in ("feat_in", "n_layers", "d_model", "n_heads", "ff_expansion_factor", "pos_emb_max_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _unsupported(key, value, "a positive integer")
        if self.d_model % self.n_heads:
            raise _unsupported("n_heads", self.n_heads, f"a divisor of d_model={self.d_model}")
        if self.subsampling not in SUBSAMPLINGS:
            raise _unsupported("subsampling", self.subsampling, ", ".join(SUBSAMPLINGS))
        if self.subsampling_factor not in (2, 4, 8, 16):
            raise _unsupported("subsampling_factor", self.subsampling_factor, "2, 4, 8, 16")
        if self.self_attention_model != "rel_pos":
            raise _unsupported("self_attention_model", self.self_attention_model, "rel_pos")
        if self.att_context_style not in ATT_STYLES:
            raise _unsupported("att_context_style", self.att_context_style, ", ".join(ATT_STYLES))
        left, right = self.att_context_size
        if self.att_context_style == "chunked_limited" and (right < 0 or (left > 0 and left % (right + 1))):
            raise _unsupported("att_context_size", list(self.att_context_size),
                               "chunked_limited needs right >= 0 and left a multiple of right + 1")
        if self.conv_norm_type not in CONV_NORMS:
            raise _unsupported("conv_norm_type", self.conv_norm_type, ", ".join(CONV_NORMS))
        k = self.conv_kernel_size
        if not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise _unsupported("conv_kernel_size", k, "a positive odd integer")
        if self.conv_context_size is not None and sum(self.conv_context_size) + 1 != k:
            raise _unsupported("conv_context_size", list(self.conv_context_size),
                               f"null, 'causal' or [left, right] with left + right + 1 = {k}")
        if self.feat_out not in (-1, self.d_model):
            raise _unsupported("feat_out", self.feat_out, f"-1 or d_model={self.d_model}")

    @property
    def conv_channels(self) -> int:
        return self.d_model if self.subsampling_conv_channels == -1 else self.subsampling_conv_channels

    @property
    def conv_padding(self) -> tuple[int, int]:
        """(left, right) context of the depthwise conv, in frames."""
        half = (self.conv_kernel_size - 1) // 2
        return self.conv_context_size if self.conv_context_size is not None else (half, half)

    @classmethod
    def from_nemo(cls, enc: dict[str, Any]) -> "EncoderConfig":
        """Build from a NeMo `encoder:` mapping; raises ValueError naming an unsupported key."""
        target = enc.get("_target_", "")
        if target and not target.endswith("ConformerEncoder"):
            raise _unsupported("_target_", target, "nemo.collections.asr.modules.ConformerEncoder")
        _reject_features(enc)
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in enc.items() if k in names}
        att = kwargs.get("att_context_size")
        if att is not None:
            # A list of [left, right] pairs is multi-lookahead training; inference uses the first.
            pair = att[0] if att and isinstance(att[0], (list, tuple)) else att
            if len(pair) != 2:
                raise _unsupported("att_context_size", att, "[left, right]")
            kwargs["att_context_size"] = (int(pair[0]), int(pair[1]))
        ctx = kwargs.get("conv_context_size")
        if ctx == "causal":
            kwargs["conv_context_size"] = (enc.get("conv_kernel_size", 31) - 1, 0)
        elif ctx is not None:
            if isinstance(ctx, str) or len(ctx) != 2:
                raise _unsupported("conv_context_size", ctx, "null, 'causal' or [left, right]")
            kwargs["conv_context_size"] = (int(ctx[0]), int(ctx[1]))
        return cls(**kwargs)


def _reject_features(enc: dict[str, Any]) -> None:
    """Config keys that change the computation in ways this encoder does not implement."""
    if enc.get("reduction") and enc.get("reduction_factor", 1) > 1:
        raise _unsupported("reduction", enc["reduction"], "null (no intermediate reduction)")
    if enc.get("conv_context_style", "regular") != "regular":
        raise _unsupported("conv_context_style", enc["conv_context_style"], "regular")
    if enc.get("att_chunk_context_size") is not None:
        raise _unsupported("att_chunk_context_size", enc["att_chunk_context_size"], "null")


class ConformerFeedForward(nn.Module):
    """Linear(D, D*e) -> SiLU -> Linear(D*e, D) on [B, T, D]."""

    def __init__(self, d_model: int, d_ff: int, use_bias: bool):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=use_bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=use_bias)
        self.silu_fused = False  # True once linear1 is a packed GEMM with SiLU as post-op

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        return self.linear2(h if self.silu_fused else nn.functional.silu(h))

    def pack(self) -> None:
        """oneDNN-packed GEMMs (see engines.fast_linear), SiLU fused into the first."""
        if isinstance(self.linear1, nn.Linear):
            self.linear1 = pack(self.linear1, "swish")
            self.silu_fused = not isinstance(self.linear1, nn.Linear)
        self.linear2 = pack(self.linear2)


class ConformerConvolution(nn.Module):
    """Pointwise conv (D -> 2D) + GLU -> depthwise conv over time -> norm -> SiLU -> pointwise.

    Input and output [B, T, D]. The norm is NeMo's `batch_norm` attribute (a BatchNorm1d or a
    LayerNorm over channels); `fuse_batch_norm` folds an eval BatchNorm into the depthwise conv.
    """

    def __init__(self, d_model: int, kernel_size: int, norm_type: str, padding: tuple[int, int], use_bias: bool):
        super().__init__()
        self.norm_type = norm_type
        self.padding = padding
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=use_bias)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model, bias=use_bias)
        self.batch_norm = nn.BatchNorm1d(d_model) if norm_type == "batch_norm" else nn.LayerNorm(d_model)
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=use_bias)

    def forward(self, x: Tensor, pad_mask: Tensor | None) -> Tensor:
        """x: [B, T, D]; pad_mask: [B, T, 1] True on padded frames, or None -> [B, T, D]."""
        # kernel-1 convs are linears (apply_linear): run on [B, T, D], no transposes.
        x = apply_linear(self.pointwise_conv1, x)
        x = nn.functional.glu(x, dim=-1)
        if pad_mask is not None:
            # Padded frames must not leak into valid ones through the kernel's context.
            x = x.masked_fill(pad_mask, 0.0)
        left, right = self.padding
        if left != right:
            x = nn.functional.pad(x, (0, 0, left, right))
        # The depthwise conv runs as a conv2d over a [B, D, 1, T] view of [B, T, D] memory:
        # channels-last, which oneDNN's depthwise kernel takes without any transpose (20-40x
        # faster on CPU than conv1d on a transposed copy); its output is [B, T, D] memory again.
        w = self.depthwise_conv.weight.unsqueeze(2)  # [D, 1, 1, K]
        x = nn.functional.conv2d(x.transpose(1, 2).unsqueeze(2), w, self.depthwise_conv.bias,
                                 padding=(0, left if left == right else 0), groups=w.size(0))
        x = x.squeeze(2).transpose(1, 2)  # [B, T, D]
        if isinstance(self.batch_norm, nn.BatchNorm1d):
            x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2)
        elif isinstance(self.batch_norm, nn.LayerNorm):
            x = self.batch_norm(x)
        # else: a BatchNorm folded into the depthwise conv (Identity)
        x = nn.functional.silu(x)
        return apply_linear(self.pointwise_conv2, x)

    @torch.no_grad()
    def fuse_batch_norm(self) -> None:
        """Fold an eval-mode BatchNorm into the depthwise conv: w' = w*s, b' = (b - mean)*s + beta
        with s = gamma / sqrt(var + eps). Drops the `batch_norm.*` state dict entries."""
        bn = self.batch_norm
        if not isinstance(bn, nn.BatchNorm1d):
            return
        conv = self.depthwise_conv
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        conv.weight = nn.Parameter(conv.weight * s[:, None, None], requires_grad=False)
        conv.bias = nn.Parameter((bias - bn.running_mean) * s + bn.bias, requires_grad=False)
        self.batch_norm = nn.Identity()


class ConformerLayer(nn.Module):
    """Macaron block: x + FF/2 -> + MHSA -> + Conv -> + FF/2 -> LayerNorm. [B, T, D] in and out."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, d_ff = cfg.d_model, cfg.d_model * cfg.ff_expansion_factor
        self.norm_feed_forward1 = nn.LayerNorm(d)
        self.feed_forward1 = ConformerFeedForward(d, d_ff, cfg.use_bias)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConformerConvolution(d, cfg.conv_kernel_size, cfg.conv_norm_type, cfg.conv_padding, cfg.use_bias)
        self.norm_self_att = nn.LayerNorm(d)
        self.self_attn = RelPositionMultiHeadAttention(cfg.n_heads, d, cfg.use_bias)
        self.norm_feed_forward2 = nn.LayerNorm(d)
        self.feed_forward2 = ConformerFeedForward(d, d_ff, cfg.use_bias)
        self.norm_out = nn.LayerNorm(d)

    def forward(self, x: Tensor, pos_emb: Tensor, att_mask: Tensor | None, pad_mask: Tensor | None) -> Tensor:
        """x: [B, T, D]; pos_emb [1, 2T-1, D]; att_mask additive [B|1, 1, T, T] or None;
        pad_mask [B, T, 1] bool (True = padded) or None."""
        # torch.add(alpha=0.5): the half-step residual in one pass over memory.
        x = torch.add(x, self.feed_forward1(self.norm_feed_forward1(x)), alpha=0.5)
        x = x + self.self_attn(self.norm_self_att(x), pos_emb, att_mask)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = torch.add(x, self.feed_forward2(self.norm_feed_forward2(x)), alpha=0.5)
        return self.norm_out(x)


class ConformerEncoder(nn.Module):
    """NeMo's ConformerEncoder, inference only: see the module docstring."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.pre_encode = ConvSubsampling(cfg.subsampling, cfg.subsampling_factor, cfg.feat_in, cfg.d_model,
                                          cfg.conv_channels, cfg.causal_downsampling)
        self.pos_enc = RelPositionalEncoding(cfg.d_model, cfg.pos_emb_max_len)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.n_layers))
        if not cfg.untie_biases:
            # NeMo shares one (u, v) pair across layers (and saves it under every layer's name).
            for layer in self.layers[1:]:
                layer.self_attn.pos_bias_u = self.layers[0].self_attn.pos_bias_u
                layer.self_attn.pos_bias_v = self.layers[0].self_attn.pos_bias_v
        # sqrt(d_model) input scaling; 1.0 once folded into pre_encode.out (fuse_for_inference).
        self.xscale = math.sqrt(cfg.d_model) if cfg.xscaling else 1.0

    @classmethod
    def from_state(cls, cfg: EncoderConfig, state: dict[str, Tensor], *, pack_linears: bool = True) -> "ConformerEncoder":
        """Build on the meta device (no init cost), take the tensors of `state` (NeMo's `encoder.*`
        keys without the prefix) as parameters, fill the positional table, eval mode, then
        `fuse_for_inference(pack_linears)` (pass False for a model to export or train)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        ref = next(iter(state.values()))
        model.pos_enc.materialise(ref.device, ref.dtype if ref.is_floating_point() else torch.float32)
        model.eval()
        model.requires_grad_(False)
        model.fuse_for_inference(pack_linears=pack_linears)
        return model

    @torch.no_grad()
    def fuse_for_inference(self, pack_linears: bool = True) -> None:
        """Fold eval BatchNorms into the depthwise convs and xscale into the subsampling's output
        linear, store the subsampling convs channels-last and, with `pack_linears` on a CPU
        whose torch has oneDNN, swap every linear for a packed one (engines.fast_linear).
        Idempotent. Afterwards the state dict no longer matches NeMo's (no `batch_norm`
        entries; packed linears hold no parameters): inference only."""
        self.eval()
        for layer in self.layers:
            layer.conv.fuse_batch_norm()
        # oneDNN runs the subsampling's 2-D convs ~1.5x faster in channels-last (NHWC) layout.
        self.pre_encode.to(memory_format=torch.channels_last)
        out = self.pre_encode.out
        if self.xscale != 1.0 and isinstance(out, nn.Linear):
            out.weight = nn.Parameter(out.weight * self.xscale, requires_grad=False)
            out.bias = nn.Parameter(out.bias * self.xscale, requires_grad=False)
            self.xscale = 1.0
        if pack_linears:
            self._pack_linears()

    def _pack_linears(self) -> None:
        for layer in self.layers:
            layer.feed_forward1.pack()
            layer.feed_forward2.pack()
            attn, conv = layer.self_attn, layer.conv
            for name in ("linear_q", "linear_k", "linear_v", "linear_out", "linear_pos"):
                setattr(attn, name, pack(getattr(attn, name)))
            conv.pointwise_conv1 = pack(conv.pointwise_conv1)
            conv.pointwise_conv2 = pack(conv.pointwise_conv2)
        self.pre_encode.out = pack(self.pre_encode.out)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Encoder frames for `lengths` feature frames ([B] -> [B] int64)."""
        return subsampled_lengths(lengths, self.cfg.subsampling_factor, self.cfg.causal_downsampling)

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features: [B, feat_in, T] normalised log-mel; lengths: [B] valid frames.
        Returns ([B, d_model, T'] encodings, [B] int64 valid encoder frames). Frames past a
        row's length hold unspecified values."""
        if features.dim() != 3 or features.size(1) != self.cfg.feat_in:
            raise ValueError(f"features must be [B, {self.cfg.feat_in}, T], got {list(features.shape)}")
        exporting = torch.onnx.is_in_onnx_export()
        # Masks cost time: build them only when some row is shorter than the batch.
        padded = exporting or bool((lengths < features.size(2)).any())
        x, lengths = self.pre_encode(features.transpose(1, 2), lengths, masked=padded)
        if self.xscale != 1.0:
            x = x * self.xscale
        t = x.size(1)
        pos_emb = self.pos_enc(t)
        pad_mask, att_mask = self._masks(lengths, t, padded, x.dtype)
        for layer in self.layers:
            x = layer(x, pos_emb, att_mask, pad_mask)
        return x.transpose(1, 2), lengths

    def _masks(self, lengths: Tensor, t: int, padded: bool, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
        """pad_mask [B, T, 1] (True = padded) and additive attention mask [B|1, 1, T, T]."""
        idx = torch.arange(t, device=lengths.device)
        visible = self._context_mask(idx)  # [T, T] or None
        if not padded:
            return None, None if visible is None else _additive(visible[None, None], dtype)
        valid = idx[None, :] < lengths[:, None]  # [B, T]
        # Keys past the length are hidden; padded query rows are hidden too, as in NeMo.
        pair = valid[:, None, :, None] & valid[:, None, None, :]  # [B, 1, T, T]
        if visible is not None:
            pair = pair & visible
        return ~valid[:, :, None], _additive(pair, dtype)

    def _context_mask(self, idx: Tensor) -> Tensor | None:
        """[T, T] bool: may query i see key j under the limited attention context (None = all)."""
        left, right = self.cfg.att_context_size
        diff = idx[None, :] - idx[:, None]  # j - i
        if self.cfg.att_context_style == "chunked_limited":
            chunk = right + 1
            chunks_left = left // chunk if left >= 0 else 10000
            c = torch.div(idx, chunk, rounding_mode="trunc")
            back = c[:, None] - c[None, :]
            return (back >= 0) & (back <= chunks_left)
        if left < 0 and right < 0:
            return None
        ok = torch.ones_like(diff, dtype=torch.bool)
        if left >= 0:
            ok = ok & (diff >= -left)
        if right >= 0:
            ok = ok & (diff <= right)
        return ok


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility -> additive mask (0 visible, MASK_VALUE hidden)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, MASK_VALUE)
