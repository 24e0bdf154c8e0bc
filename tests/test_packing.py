"""Whether FastConformer's fp32 encoder layers run as oneDNN-packed GEMMs or through F.linear
(engines.fast_linear.packing_pays, engines.conformer.ConformerEncoder._pack_linears): timed once
per process, because the faster of the two depends on the CPU (packed 2-3x faster on a Zen 5
EPYC, F.linear ~1.2x faster for the 618M encoder on an AVX2-only Zen 3). Either way the encoder
gives NeMo's outputs; bf16 and streaming steps always run packed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEMO_REF, Reference, needs_shared
from torch import nn

from engines import conformer, fast_linear
from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig
from engines.fast_linear import PackedLinear, onednn_linear_available


def fake_pair(monkeypatch, clock, seconds: dict[str, float]) -> None:
    """probe_pair stand-in on the fake clock: a run of "packed" or "plain" takes seconds[kind]."""
    monkeypatch.setattr(fast_linear, "probe_pair",
                        lambda *shape: {kind: (lambda kind=kind, s=s: clock.spend(kind, s)) for kind, s in seconds.items()})


@pytest.mark.parametrize("plain_seconds, pays", [(0.5, False), (0.94, False), (0.96, True), (1.0, True), (2.5, True)])
def test_packing_is_dropped_only_where_f_linear_beats_it_by_the_margin(monkeypatch, fake_clock, plain_seconds, pays):
    """F.linear must take under PACKING_MARGIN (0.95) of packed's time; within it packing stays.
    Each runs `rounds` (3) times, interleaved, and the answer is kept per shape."""
    fake_pair(monkeypatch, fake_clock, {"packed": 1.0, "plain": plain_seconds})
    monkeypatch.setattr(fast_linear, "onednn_linear_available", lambda dtype=torch.float32: True)
    fast_linear.packing_pays.cache_clear()
    try:
        assert fast_linear.packing_pays(64, 256, "swish") is pays
        assert fake_clock.runs == ["packed", "plain"] * 3
        assert fast_linear.packing_pays(64, 256, "swish") is pays and len(fake_clock.runs) == 6
    finally:
        fast_linear.packing_pays.cache_clear()


def test_packing_never_pays_where_onednn_packs_no_fp32(monkeypatch, fake_clock):
    fake_pair(monkeypatch, fake_clock, {"packed": 0.1, "plain": 1.0})
    monkeypatch.setattr(fast_linear, "onednn_linear_available", lambda dtype=torch.float32: False)
    fast_linear.packing_pays.cache_clear()
    try:
        assert fast_linear.packing_pays(64, 256, "swish") is False and fake_clock.runs == []
    finally:
        fast_linear.packing_pays.cache_clear()


@pytest.mark.parametrize("activation", ["swish", "gelu", "relu", "none"])
def test_the_probe_times_the_same_feed_forward_both_ways(activation):
    """The real probe pair on this CPU: packed (activation fused) and plain compute one function."""
    if not onednn_linear_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linears")
    runs = fast_linear.probe_pair(32, 128, 16, activation)
    assert set(runs) == {"packed", "plain"}
    outputs = {kind: run() for kind, run in runs.items()}
    torch.testing.assert_close(outputs["packed"], outputs["plain"], atol=1e-4, rtol=1e-4)
    assert outputs["packed"].shape == (16, 32)


def load_encoder(variant: str, dtype: torch.dtype = torch.float32, pack_linears: bool = True) -> ConformerEncoder:
    with NemoArchive(Reference(variant).nemo) as archive:
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        return ConformerEncoder.from_state(cfg, sub_state_dict(archive.state_dict(), "encoder"), dtype=dtype,
                                           pack_linears=pack_linears)


def layer_linears(enc: ConformerEncoder) -> list[nn.Module]:
    out = []
    for layer in enc.layers:
        a, c = layer.self_attn, layer.conv
        out += [layer.feed_forward1.linear1, layer.feed_forward1.linear2, layer.feed_forward2.linear1,
                layer.feed_forward2.linear2, a.linear_q, a.linear_k, a.linear_v, a.linear_out, a.linear_pos,
                c.pointwise_conv1, c.pointwise_conv2]
    return out


@needs_shared
@pytest.mark.parametrize("packed", [True, False])
def test_fixture_encoders_give_nemos_outputs_packed_or_not(reference: Reference, monkeypatch, packed):
    """Whatever the probe says, the layers are all packed or all plain, the subsampling's GEMMs
    stay packed, the position scores keep their oneDNN path, and the encoder gives NeMo's."""
    if not onednn_linear_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linears")
    asked = []
    monkeypatch.setattr(conformer, "packing_pays", lambda *shape: asked.append(shape) or packed)
    enc = load_encoder(reference.dir.name)
    assert asked == [(enc.cfg.d_model, enc.layers[0].feed_forward1.linear1.out_features, "swish")]
    kinds = {type(m) for m in layer_linears(enc)}
    assert kinds == ({PackedLinear} if packed else {nn.Linear, nn.Conv1d})
    assert all(layer.feed_forward1.silu_fused is packed for layer in enc.layers)
    assert all(layer.self_attn.onednn for layer in enc.layers)
    assert isinstance(enc.pre_encode.out, PackedLinear)
    for i, meta in enumerate(reference.files[:3]):
        feats = torch.from_numpy(reference.array("features", i))
        with torch.inference_mode():
            out, _ = enc(feats[None], torch.tensor([feats.shape[1]]))
        err = np.abs(out[0].numpy() - reference.array("encoder", i)).max()
        assert err < 1e-3, f"{reference.dir.name} file {i}: max abs error {err}"


@needs_shared
def test_a_bf16_encoder_is_packed_without_timing_anything(monkeypatch):
    if not onednn_linear_available(torch.bfloat16):
        pytest.skip("this CPU has no bf16 GEMMs in oneDNN")

    def no_probe(*shape):
        raise AssertionError("bf16 runs packed: nothing to time")
    monkeypatch.setattr(conformer, "packing_pays", no_probe)
    enc = load_encoder("tdt_tiny", torch.bfloat16)
    assert {type(m) for m in layer_linears(enc)} == {PackedLinear}


@needs_shared
def test_streaming_packs_the_layers_whatever_the_probe_said(monkeypatch):
    """A streaming step runs tens of rows, where packed GEMMs win (2x at 8 rows on the Zen 3 EPYC
    whose batches run faster through F.linear): StreamingModel packs what the load left plain."""
    if not onednn_linear_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linears")
    from transcribe.streaming.scheduler import StreamingModel

    monkeypatch.setattr(conformer, "packing_pays", lambda *shape: False)
    sm = StreamingModel.from_nemo(NEMO_REF / "rnnt_streaming_tiny" / "model.nemo")
    assert {type(m) for m in layer_linears(sm.engine.encoder)} == {PackedLinear}
    assert all(layer.feed_forward1.silu_fused for layer in sm.engine.encoder.layers)


@needs_shared
def test_an_encoder_off_the_cpu_is_neither_timed_nor_packed(monkeypatch):
    """oneDNN packs CPU weights only: a CUDA model asked to pack (pack_linears=True) must not pay
    the CPU probe's ~0.65 s at load. The meta device stands in for CUDA on this machine."""
    def no_probe(*shape):
        raise AssertionError("nothing to pack off the CPU: nothing to time")
    monkeypatch.setattr(conformer, "packing_pays", no_probe)
    enc = load_encoder("tdt_tiny", pack_linears=False)
    enc.to("meta")
    enc.fuse_for_inference(pack_linears=True)
    assert {type(m) for m in layer_linears(enc)} == {nn.Linear, nn.Conv1d}
    assert not any(layer.self_attn.onednn for layer in enc.layers)
    assert not isinstance(enc.pre_encode.out, PackedLinear)
