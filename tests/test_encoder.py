"""FastConformer encoder: NeMo's reference outputs, batching, config validation, architectures."""
from __future__ import annotations

import json
import numpy as np
import pytest
import torch
import yaml
from conftest import SHARED, Reference, needs_shared

from engines.attention import rel_shift, rel_shift_export
from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig

SHAPE_DIR = SHARED / "fixtures" / "parakeet_tdt_0.6b_v2_shape"


def load_encoder(variant: str) -> ConformerEncoder:
    with NemoArchive(Reference(variant).nemo) as archive:
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        return ConformerEncoder.from_state(cfg, sub_state_dict(archive.state_dict(), "encoder"))


@pytest.fixture(scope="module")
def encoders() -> dict[str, ConformerEncoder]:
    return {}


def encoder_for(encoders: dict, variant: str) -> ConformerEncoder:
    if variant not in encoders:
        encoders[variant] = load_encoder(variant)
    return encoders[variant]


def run_padded(enc: ConformerEncoder, feats: list[torch.Tensor], garbage: float = 10.0):
    """Encode [n_mels, T_i] features as one batch; padding is noise, which masking must hide."""
    t_max = max(f.shape[1] for f in feats)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(len(feats), feats[0].shape[0], t_max, generator=gen) * garbage
    for i, f in enumerate(feats):
        batch[i, :, : f.shape[1]] = f
    lengths = torch.tensor([f.shape[1] for f in feats])
    with torch.inference_mode():
        return enc(batch, lengths)


# --- NeMo reference -----------------------------------------------------------------------


def test_matches_nemo_per_file(reference: Reference, encoders):
    enc = encoder_for(encoders, reference.dir.name)
    for i, meta in enumerate(reference.files):
        feats = torch.from_numpy(reference.array("features", i))
        want = reference.array("encoder", i)
        with torch.inference_mode():
            out, lengths = enc(feats[None], torch.tensor([feats.shape[1]]))
        assert lengths.tolist() == [meta["encoder_frames"]]
        assert out.shape == (1, enc.cfg.d_model, meta["encoder_frames"])
        err = np.abs(out[0].numpy() - want).max()
        assert err < 1e-3, f"{reference.dir.name} file {i}: max abs error {err}"


def test_batch_equals_single_files(reference: Reference, encoders):
    enc = encoder_for(encoders, reference.dir.name)
    feats = [torch.from_numpy(reference.array("features", i)) for i in range(len(reference.files))]
    out, lengths = run_padded(enc, feats)
    assert lengths.tolist() == [m["encoder_frames"] for m in reference.files]
    for i, f in enumerate(feats):
        with torch.inference_mode():
            single, _ = enc(f[None], torch.tensor([f.shape[1]]))
        n = int(lengths[i])
        torch.testing.assert_close(out[i, :, :n], single[0], atol=1e-4, rtol=0)


# --- configuration ------------------------------------------------------------------------

TINY = dict(feat_in=80, n_layers=2, d_model=64, n_heads=2, subsampling="dw_striding", subsampling_factor=8,
            subsampling_conv_channels=16, conv_kernel_size=9, use_bias=False)


@pytest.mark.parametrize(
    "key, value",
    [
        ("subsampling", "vggnet"),
        ("subsampling_factor", 3),
        ("subsampling_factor", 2),  # NeMo has it; no checkpoint, so no reference, uses it
        ("self_attention_model", "abs_pos"),
        ("att_context_style", "chunked_limited_with_rc"),
        ("conv_norm_type", "instance_norm"),
        ("conv_kernel_size", 8),
        ("conv_context_style", "dcc"),
        ("reduction", "pooling"),
        ("feat_out", 128),
        ("n_heads", 5),
        ("_target_", "nemo.collections.asr.modules.SqueezeformerEncoder"),
    ],
)
def test_unsupported_config_names_key_and_value(key, value):
    cfg = dict(TINY, **{key: value})
    if key == "reduction":
        cfg["reduction_factor"] = 2
    with pytest.raises(ValueError) as err:
        EncoderConfig.from_nemo(cfg)
    assert f"encoder.{key}={value!r}" in str(err.value)


def test_config_parses_nemo_forms():
    cfg = EncoderConfig.from_nemo(dict(TINY, att_context_size=[[70, 13], [70, 0]], att_context_style="chunked_limited",
                                       conv_context_size="causal", subsampling_conv_channels=-1, dropout=0.3))
    assert cfg.att_context_size == (70, 13)  # multi-lookahead: inference uses the first
    assert cfg.conv_padding == (8, 0)
    assert cfg.conv_channels == 64


@needs_shared
def test_streaming_fixture_config_runs_offline():
    enc = load_encoder("rnnt_streaming_tiny")
    assert enc.cfg.causal_downsampling and enc.cfg.att_context_style == "chunked_limited"
    x = torch.randn(1, 80, 400)
    with torch.inference_mode():
        base, lengths = enc(x, torch.tensor([400]))
        # Causal everywhere: encoder chunk 0 (frames 0..13) sees features up to 8 * 13 only.
        x2 = x.clone()
        x2[:, :, 8 * 13 + 1 :] = torch.randn(1, 80, 400 - 8 * 13 - 1)
        moved, _ = enc(x2, torch.tensor([400]))
    assert lengths.tolist() == [51]  # causal: 400 -> 201 -> 101 -> 51
    torch.testing.assert_close(moved[..., :14], base[..., :14], atol=1e-5, rtol=0)
    assert (moved[..., 14:] - base[..., 14:]).abs().max() > 1e-2


# --- other architectures from random weights -----------------------------------------------


def nemo_calc_length(length: int, all_paddings: int, repeat: int) -> int:
    """NeMo's calc_length, in its float arithmetic: floor((L + pads - 3) / 2 + 1) per stage."""
    x = torch.tensor(float(length))
    for _ in range(repeat):
        x = torch.floor((x + all_paddings - 3) / 2 + 1)
    return int(x)


def random_encoder(cfg: EncoderConfig, seed: int = 0) -> ConformerEncoder:
    """Unfused eval-mode encoder with non-trivial weights, biases and BatchNorm statistics."""
    torch.manual_seed(seed)
    enc = ConformerEncoder(cfg)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            p.normal_(0.0, 0.1 if p.dim() > 1 else 0.5)
            if "norm" in name and name.endswith("weight"):  # LayerNorm / BatchNorm scales
                p.uniform_(0.5, 1.5)
        for name, b in enc.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0.0, 0.3)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 2.0)
    enc.pos_enc.materialise()
    return enc.eval()


ARCHS = {
    "striding_x4": dict(subsampling="striding", subsampling_factor=4),
    "dw_striding_x4": dict(subsampling_factor=4),
    "dw_striding_x16": dict(subsampling_factor=16),
    "striding_x8_causal": dict(subsampling="striding", causal_downsampling=True),
    "tied_biases": dict(untie_biases=False),
    "no_xscaling": dict(xscaling=False),
    "layer_norm_k5": dict(conv_norm_type="layer_norm", conv_kernel_size=5),
    "batch_norm_k31_bias": dict(conv_kernel_size=31, use_bias=True),
    "mel128_3heads": dict(feat_in=128, d_model=48, n_heads=3),
    "limited_context": dict(att_context_size=[8, 2]),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_lengths_fusion_and_batching(arch):
    cfg = EncoderConfig.from_nemo(dict(TINY, **ARCHS[arch]))
    ref = random_encoder(cfg)
    enc = ConformerEncoder.from_state(cfg, ref.state_dict())  # strict load + fuse
    frames = [301, 250, 97, 64]
    feats = [torch.randn(cfg.feat_in, t) for t in frames]
    out, lengths = run_padded(enc, feats)
    pads = 3 if cfg.causal_downsampling else 2
    stages = cfg.subsampling_factor.bit_length() - 1
    assert lengths.tolist() == [nemo_calc_length(t, pads, stages) for t in frames]
    assert out.shape == (4, cfg.d_model, int(lengths.max()))
    for i, f in enumerate(feats):
        n = int(lengths[i])
        with torch.inference_mode():
            single, single_len = enc(f[None], torch.tensor([f.shape[1]]))
            unfused, _ = ref(f[None], torch.tensor([f.shape[1]]))
        assert single_len.tolist() == [n]
        torch.testing.assert_close(out[i, :, :n], single[0], atol=1e-4, rtol=0)
        # BatchNorm / xscale folding changes only rounding.
        torch.testing.assert_close(single, unfused, atol=1e-4, rtol=1e-4)


def test_unpadded_batch_matches_single_rows():
    # No row is padded: the encoder takes its mask-free path, which must batch just as well.
    cfg = EncoderConfig.from_nemo(TINY)
    enc = ConformerEncoder.from_state(cfg, random_encoder(cfg).state_dict())
    x = torch.randn(3, 80, 200)
    with torch.inference_mode():
        out, lengths = enc(x, torch.tensor([200, 200, 200]))
        for i in range(3):
            single, _ = enc(x[i : i + 1], torch.tensor([200]))
            torch.testing.assert_close(out[i], single[0], atol=1e-4, rtol=0)
    assert lengths.tolist() == [25, 25, 25]


def nemo_context_mask(style: str, left: int, right: int, t: int) -> torch.Tensor:
    """NeMo's `_create_masks` attention context (True = visible), written the way NeMo does."""
    att = torch.ones(t, t, dtype=torch.bool)
    if style == "regular":
        att = att.triu(diagonal=-left) if left >= 0 else att
        return att.tril(diagonal=right) if right >= 0 else att
    chunk = right + 1
    idx = torch.div(torch.arange(t), chunk, rounding_mode="trunc")
    diff = idx.unsqueeze(1) - idx.unsqueeze(0)
    return (diff <= (left // chunk if left >= 0 else 10000)) & (diff >= 0)


@pytest.mark.parametrize("style, context", [("regular", [8, 2]), ("regular", [-1, 0]), ("regular", [5, -1]),
                                            ("chunked_limited", [70, 13]), ("chunked_limited", [-1, 3]),
                                            ("chunked_limited", [0, 4])])
def test_context_mask_matches_nemo(style, context):
    enc = ConformerEncoder(EncoderConfig.from_nemo(dict(TINY, att_context_style=style, att_context_size=context)))
    got = enc._context_mask(torch.arange(50))
    assert torch.equal(got, nemo_context_mask(style, *context, 50))


def test_bad_lengths_rejected():
    cfg = EncoderConfig.from_nemo(TINY)
    enc = ConformerEncoder.from_state(cfg, random_encoder(cfg).state_dict())
    with pytest.raises(ValueError, match="lengths must lie in"):
        enc(torch.randn(2, 80, 100), torch.tensor([100, 101]))
    with pytest.raises(ValueError, match="shape \\[2\\]"):
        enc(torch.randn(2, 80, 100), torch.tensor([100]))


def test_packed_linear_matches_linear():
    from engines.fast_linear import PackedLinear, onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    lin = torch.nn.Linear(48, 40)
    x = torch.randn(2, 7, 48)
    for act, fn in [("none", lambda y: y), ("relu", torch.relu), ("swish", torch.nn.functional.silu),
                    ("gelu", torch.nn.functional.gelu)]:
        got = PackedLinear(lin.weight, lin.bias, act)(x)
        torch.testing.assert_close(got, fn(lin(x)), atol=1e-5, rtol=1e-5)


def test_tied_biases_are_shared():
    cfg = EncoderConfig.from_nemo(dict(TINY, untie_biases=False))
    enc = ConformerEncoder(cfg)
    assert enc.layers[0].self_attn.pos_bias_u is enc.layers[1].self_attn.pos_bias_u
    assert "layers.1.self_attn.pos_bias_v" in enc.state_dict()


def test_rel_shift_matches_nemo_trick():
    bd = torch.randn(2, 3, 7, 13)
    torch.testing.assert_close(rel_shift(bd), rel_shift_export(bd), atol=0, rtol=0)
    # Column j of row i holds relative position i - j, stored at index (T-1) - (i - j).
    assert rel_shift(bd)[0, 0, 5, 2] == bd[0, 0, 5, 6 - 3]


@pytest.mark.parametrize("mask", [False, True])
def test_attention_mask_handed_to_sdpa_is_contiguous(mask):
    """The additive mask SDPA gets must be an ordinary tensor: rel_shift's view starts T-1
    elements into its storage with row stride 2T-2, and SDPA's CUDA kernels read the mask with
    vector loads, which stopped the bf16/fp16 encoder with "misaligned address" on an H100 for a
    batch without padding (mask None: the view was passed on as it was)."""
    from engines.attention import RelPositionMultiHeadAttention

    att = RelPositionMultiHeadAttention(4, 64, use_bias=True)
    t = 37
    q_v, p = torch.randn(2, t, 4, 16), torch.randn(1, 2 * t - 1, 64)
    m = torch.zeros(2, 1, t, t) if mask else None
    bd = att.position_term(q_v, p, m)
    # dense from the start of its own storage (a masked one may be a permuted dense layout)
    assert bd.shape == (2, 4, t, t) and bd.storage_offset() == 0 and bd.stride(-1) == 1
    assert bd.untyped_storage().nbytes() == bd.numel() * bd.element_size()


def test_no_grad_state_and_inference_mode():
    cfg = EncoderConfig.from_nemo(TINY)
    enc = ConformerEncoder.from_state(cfg, random_encoder(cfg).state_dict())
    assert not enc.training and not any(p.requires_grad for p in enc.parameters())
    with torch.inference_mode():
        out, _ = enc(torch.randn(2, 80, 120), torch.tensor([120, 100]))
    assert torch.isfinite(out).all()


# --- full-size architecture ----------------------------------------------------------------


@needs_shared
def test_parakeet_0_6b_builds_with_checkpoint_shapes():
    cfg = EncoderConfig.from_nemo(yaml.safe_load((SHAPE_DIR / "model_config.yaml").read_text())["encoder"])
    with torch.device("meta"):
        enc = ConformerEncoder(cfg)
    shapes = json.loads((SHAPE_DIR / "state_dict_shapes.json").read_text())
    want = {k[len("encoder."):]: v[0] for k, v in shapes.items() if k.startswith("encoder.")}
    got = {k: list(v.shape) for k, v in enc.state_dict().items()}
    assert got == want


@pytest.mark.parametrize("mask_rows", [None, 1, 3])
def test_shifted_position_scores_equal_shift_of_position_scores_plus_mask(mask_rows):
    """The CPU oneDNN path (per head, shifted and masked straight into the result) against the
    plain path: rel_shift(bmm scores) + mask."""
    from engines.attention import position_scores, shifted_position_scores
    from engines.fast_linear import onednn_linear_available

    if not onednn_linear_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linear")
    g = torch.Generator().manual_seed(0)
    b, t, h, d_k = 3, 37, 4, 16
    q, p = torch.randn(b, t, h, d_k, generator=g), torch.randn(2 * t - 1, h, d_k, generator=g)
    mask = None
    if mask_rows:
        mask = torch.zeros(mask_rows, 1, t, t)
        mask[-1, :, :, 30:] = -10000.0
    want = rel_shift(position_scores(q, p))
    want = want if mask is None else want + mask
    got = shifted_position_scores(q, p, mask)
    assert got.shape == (b, h, t, t) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
