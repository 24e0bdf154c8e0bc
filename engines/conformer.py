"""FastConformer encoder (NeMo's `ConformerEncoder`) for inference, in plain PyTorch.

features [B, n_mels, T] (10 ms frames) -> ConvSubsampling (T' = T / factor) -> x * sqrt(d_model)
-> n_layers x ConformerLayer -> [B, d_model, T']. Module and parameter names are NeMo's, so the
`encoder.*` entries of a `.nemo` state dict load directly (`ConformerEncoder.from_state`).

Precision is data: `from_state(..., dtype=)` stores the weights and the positional table in the
compute dtype (fp32, or bf16 / fp16 where `engines.precision` allows), and activations follow
the weights; the one forward serves every dtype. Kept in fp32: LayerNorm parameters and
arithmetic (`LayerNorm`), the BatchNorm folding and the sinusoid table before they are cast, and
the encoder's interface: features in, encodings out are fp32, so callers never see the dtype.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from engines.attention import MASK_VALUE, RelPositionalEncoding, RelPositionMultiHeadAttention
from engines.checkpoint import load_strict
from engines.encoder_config import EncoderConfig
from engines.fast_linear import PackedLinear, apply_linear, onednn_linear_available, pack, packing_pays
from engines.precision import check_dtype
from engines.subsampling import ConvSubsampling, pack_pointwise, subsampled_lengths

__all__ = ["ConformerEncoder", "ConformerLayer", "EncoderConfig", "LayerNorm"]


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computing in its parameters' dtype and returning the input's: a reduced-
    precision encoder keeps these parameters fp32, so the normalisation (a mean and variance over
    d_model and a per-channel scale) is not rounded to bf16/fp16. Whisper's layers use it too."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype or x.device.type == "cpu":
            # The CPU kernel takes bf16 input with fp32 parameters as they are (fp32 statistics,
            # bf16 out): 10x cheaper than two cast passes over the activations.
            return super().forward(x)
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


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
        self.batch_norm = nn.BatchNorm1d(d_model) if norm_type == "batch_norm" else LayerNorm(d_model)
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
        self.norm_feed_forward1 = LayerNorm(d)
        self.feed_forward1 = ConformerFeedForward(d, d_ff, cfg.use_bias)
        self.norm_conv = LayerNorm(d)
        self.conv = ConformerConvolution(d, cfg.conv_kernel_size, cfg.conv_norm_type, cfg.conv_padding, cfg.use_bias)
        self.norm_self_att = LayerNorm(d)
        self.self_attn = RelPositionMultiHeadAttention(cfg.n_heads, d, cfg.use_bias)
        self.norm_feed_forward2 = LayerNorm(d)
        self.feed_forward2 = ConformerFeedForward(d, d_ff, cfg.use_bias)
        self.norm_out = LayerNorm(d)

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
        self.export_mode = False  # set_export_mode(): graph-friendly ops, masks always built

    def set_export_mode(self, on: bool = True) -> None:
        """For ONNX export / tracing: no data-dependent branches, no as_strided views."""
        self.export_mode = on
        for layer in self.layers:
            layer.self_attn.export_mode = on

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the positional table, materialised in it (see from_state)."""
        return self.pos_enc.pe.dtype

    @classmethod
    def from_state(cls, cfg: EncoderConfig, state: dict[str, Tensor], *, pack_linears: bool = True,
                   consume: bool = False, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> "ConformerEncoder":
        """Build on the meta device (no init cost), take the tensors of `state` (NeMo's `encoder.*`
        keys without the prefix, fp32) as parameters, fill the positional table, eval mode, move
        to `device` (default: where `state` is), then `fuse_for_inference(pack_linears, dtype)`
        (pass pack_linears=False for a model to export or train). `dtype`: the compute dtype,
        checked against `device` first (engines.precision.check_dtype: ValueError when
        unsupported). `consume=True` empties `state` once loaded, so each weight that fusing
        replaces (a packed or cast copy) is freed at once instead of both living to the end."""
        with torch.device("meta"):
            model = cls(cfg)
        load_strict(model, state, "encoder")  # ValueError, one line, for weights another config made
        ref = model.pre_encode.out.weight  # present in every supported layout
        device = ref.device if device is None else torch.device(device)
        check_dtype(dtype, device)
        if consume:
            state.clear()
        model.pos_enc.materialise(ref.device, ref.dtype)
        model.eval()
        model.requires_grad_(False)
        model.to(device)
        model.fuse_for_inference(pack_linears=pack_linears, dtype=dtype)
        return model

    @torch.no_grad()
    def fuse_for_inference(self, pack_linears: bool = True, dtype: torch.dtype | None = None) -> None:
        """Fold eval BatchNorms into the depthwise convs and xscale into the subsampling's output
        linear (in the weights' dtype: fp32 from a checkpoint), cast to `dtype` (None: keep) all
        but the LayerNorms, store the subsampling convs channels-last and, with `pack_linears` on
        a CPU whose torch has oneDNN for that dtype, swap every linear for a packed one
        (engines.fast_linear). Idempotent. Afterwards the state dict no longer matches NeMo's
        (no `batch_norm` entries; packed linears hold no parameters): inference only."""
        self.eval()
        for layer in self.layers:
            layer.conv.fuse_batch_norm()
        out = self.pre_encode.out
        if self.xscale != 1.0 and isinstance(out, nn.Linear):
            out.weight = nn.Parameter(out.weight * self.xscale, requires_grad=False)
            out.bias = nn.Parameter(out.bias * self.xscale, requires_grad=False)
            self.xscale = 1.0
        if dtype is not None and dtype != self.dtype:
            self._cast(dtype)
        # oneDNN runs the subsampling's 2-D convs ~1.5x faster in channels-last (NHWC) layout.
        self.pre_encode.to(memory_format=torch.channels_last)
        if pack_linears:
            self._pack_linears()

    def _cast(self, dtype: torch.dtype) -> None:
        """Every floating tensor but the LayerNorms' parameters to `dtype`, in place (`_apply`
        keeps parameter identity, so the (u, v) biases tied across layers stay one pair)."""
        if any(isinstance(m, PackedLinear) for m in self.modules()):
            raise ValueError("the linears are packed already: build the encoder with from_state(..., dtype=) instead")
        keep = {id(p) for m in self.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        self._apply(lambda t: t if id(t) in keep or not t.is_floating_point() else t.to(dtype))

    def _pack_linears(self) -> None:
        """The subsampling's GEMMs packed; the layers' too where that is faster here: always in
        bf16 (oneDNN's packed GEMM is its fast path), in fp32 where `packing_pays` times packed
        GEMMs of a feed-forward pair over an offline batch's rows faster than F.linear (not on
        an AVX2-only Zen 3 EPYC: the 618M encoder stage ran 1.1x faster unpacked there).
        Off the CPU there is nothing to pack, so nothing is timed (the probe costs ~0.65 s)."""
        on_cpu = self.pos_enc.pe.device.type == "cpu"
        for layer in self.layers:
            layer.self_attn.onednn = on_cpu and onednn_linear_available(self.dtype)
        if not on_cpu:
            return
        ff = self.layers[0].feed_forward1.linear1 if len(self.layers) else None
        if ff is not None and (self.dtype != torch.float32 or packing_pays(ff.in_features, ff.out_features, "swish")):
            self.pack_layers()
        pack_pointwise(self.pre_encode)

    def pack_layers(self) -> None:
        """Every layer's linears as oneDNN-packed GEMMs where oneDNN computes their dtype
        (fast_linear.pack), SiLU fused into each feed-forward's first. Streaming calls this
        whatever `packing_pays` said: its steps run tens of rows, where packed wins (2x at 8
        rows on the Zen 3 EPYC that runs a batch faster unpacked)."""
        for layer in self.layers:
            layer.feed_forward1.pack()
            layer.feed_forward2.pack()
            attn, conv = layer.self_attn, layer.conv
            for name in ("linear_q", "linear_k", "linear_v", "linear_out", "linear_pos"):
                setattr(attn, name, pack(getattr(attn, name)))
            conv.pointwise_conv1 = pack(conv.pointwise_conv1)
            conv.pointwise_conv2 = pack(conv.pointwise_conv2)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Encoder frames for `lengths` feature frames ([B] -> [B] int64)."""
        return subsampled_lengths(lengths, self.cfg.subsampling_factor, self.cfg.causal_downsampling)

    def forward(self, features: Tensor, lengths: Tensor, static: bool = False) -> tuple[Tensor, Tensor]:
        """features: [B, feat_in, T] normalised log-mel (any float dtype: cast to the compute
        dtype here); lengths: [B] valid frames. Returns ([B, d_model, T'] float32 encodings,
        [B] int64 valid encoder frames). Frames past a row's length hold unspecified values.

        static=True: no host syncs and no data-dependent branches (lengths are trusted, masks
        always built), for CUDA-graph capture and torch.compile; the results are the same."""
        if features.dim() != 3 or features.size(1) != self.cfg.feat_in:
            raise ValueError(f"features must be [B, {self.cfg.feat_in}, T], got {list(features.shape)}")
        static = static or self.export_mode
        if not static:
            _check_lengths(lengths, features.size(0), features.size(2))
        # Masks cost time: build them only when some row is shorter than the batch. Deciding
        # that reads `lengths` on the host, which a captured graph cannot: static builds them.
        padded = static or bool((lengths < features.size(2)).any())
        x, lengths = self.pre_encode(features.transpose(1, 2).to(self.dtype), lengths, masked=padded)
        if self.xscale != 1.0:
            x = x * self.xscale
        t = x.size(1)
        pos_emb = self.pos_enc(t)
        pad_mask, att_mask = self._masks(lengths, t, padded, x.dtype)
        for layer in self.layers:
            x = layer(x, pos_emb, att_mask, pad_mask)
        # The decoder and joint run in fp32: the reduced-precision part ends here.
        return x.transpose(1, 2).float(), lengths

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
        if self.cfg.att_context_style == "chunked_limited":
            # Chunks of right+1 frames; a query sees its own chunk and left/(right+1) before it.
            chunk = right + 1
            c = torch.div(idx, chunk, rounding_mode="trunc")
            back = c[:, None] - c[None, :]  # query chunk - key chunk
            return (back >= 0) & (back <= (left // chunk if left >= 0 else idx.numel()))
        if left < 0 and right < 0:
            return None
        diff = idx[None, :] - idx[:, None]  # key - query
        ok = torch.ones_like(diff, dtype=torch.bool)
        if left >= 0:
            ok = ok & (diff >= -left)
        if right >= 0:
            ok = ok & (diff <= right)
        return ok


def _check_lengths(lengths: Tensor, batch: int, frames: int) -> None:
    if lengths.shape != (batch,) or lengths.is_floating_point():
        raise ValueError(f"lengths must be an integer tensor of shape [{batch}], got {lengths.dtype} {list(lengths.shape)}")
    if batch and (int(lengths.min()) < 0 or int(lengths.max()) > frames):
        raise ValueError(f"lengths must lie in [0, {frames}] (the features' frames), got {lengths.tolist()}")


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility -> additive mask (0 visible, MASK_VALUE hidden)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, MASK_VALUE)
