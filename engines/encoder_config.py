"""`EncoderConfig`: the `encoder:` section of a NeMo FastConformer config, validated.

Every key that changes the computation is either implemented by `engines.conformer` or
rejected here with a ValueError naming the key and its value; training-only keys (dropout,
stochastic depth, chunking factors) are accepted and ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engines.subsampling import SUPPORTED as SUBSAMPLINGS

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
        if self.subsampling_factor not in (4, 8, 16):  # the factors checked against NeMo (README)
            raise _unsupported("subsampling_factor", self.subsampling_factor, "4, 8, 16")
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
