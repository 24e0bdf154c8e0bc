"""ONNX export of the encoder: onnxruntime reproduces the torch encoder on NeMo's fixtures."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import Reference, needs_shared

from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig

ort = pytest.importorskip("onnxruntime")
from engines.encoder_onnx import export_encoder, exportable_encoder, load_session, run_session  # noqa: E402


def load(variant: str) -> tuple[EncoderConfig, dict[str, torch.Tensor]]:
    with NemoArchive(Reference(variant).nemo) as archive:
        return EncoderConfig.from_nemo(archive.config["encoder"]), sub_state_dict(archive.state_dict(), "encoder")


def test_onnx_matches_torch_on_fixture_files(reference: Reference, tmp_path):
    cfg, state = load(reference.dir.name)
    torch_enc = ConformerEncoder.from_state(cfg, state)  # the fast (packed) inference model
    session = load_session(export_encoder(exportable_encoder(cfg, state), tmp_path / "encoder.onnx"), threads=2)
    feats = [reference.array("features", i) for i in range(len(reference.files))]
    for i, f in enumerate(feats):
        got, got_len = run_session(session, f[None], np.array([f.shape[1]]))
        with torch.inference_mode():
            want, want_len = torch_enc(torch.from_numpy(f)[None], torch.tensor([f.shape[1]]))
        assert got_len.tolist() == want_len.tolist() == [reference.files[i]["encoder_frames"]]
        assert np.abs(got - want.numpy()).max() < 1e-4
        assert np.abs(got[0] - reference.array("encoder", i)).max() < 1e-3
    # Dynamic batch and time: every file padded into one batch, each row as alone.
    t_max = max(f.shape[1] for f in feats)
    batch = np.zeros((len(feats), cfg.feat_in, t_max), dtype=np.float32)
    for i, f in enumerate(feats):
        batch[i, :, : f.shape[1]] = f
    got, got_len = run_session(session, batch, np.array([f.shape[1] for f in feats]))
    assert got_len.tolist() == [m["encoder_frames"] for m in reference.files]
    for i, n in enumerate(got_len):
        assert np.abs(got[i, :, :n] - reference.array("encoder", i)).max() < 1e-3


@needs_shared
def test_onnx_streaming_config_matches_torch(tmp_path):
    # Causal subsampling, causal depthwise convs and the chunked_limited attention mask.
    cfg, state = load("rnnt_streaming_tiny")
    torch_enc = ConformerEncoder.from_state(cfg, state)
    session = load_session(export_encoder(exportable_encoder(cfg, state), tmp_path / "stream.onnx"))
    x = torch.randn(3, cfg.feat_in, 333)
    lengths = torch.tensor([333, 200, 150])
    got, got_len = run_session(session, x.numpy(), lengths.numpy())
    with torch.inference_mode():
        want, want_len = torch_enc(x, lengths)
    assert got_len.tolist() == want_len.tolist()
    for i, n in enumerate(want_len.tolist()):
        assert np.abs(got[i, :, :n] - want[i, :, :n].numpy()).max() < 1e-4


def test_export_refuses_packed_encoder(tmp_path):
    cfg = EncoderConfig(feat_in=80, n_layers=1, d_model=32, n_heads=2, conv_kernel_size=5)
    enc = ConformerEncoder(cfg)
    enc.pos_enc.materialise()
    enc.fuse_for_inference(pack_linears=True)
    if not any(type(m).__name__ == "PackedLinear" for m in enc.modules()):
        pytest.skip("this torch build has no oneDNN packed linear")
    with pytest.raises(ValueError, match="pack_linears=False"):
        export_encoder(enc, tmp_path / "x.onnx")


@needs_shared
def test_export_has_the_ops_tensorrt_pins_to_fp32(tmp_path):
    # The TensorRT fp16/bf16 build keeps normalization and softmax layers in fp32: that needs
    # every LayerNorm exported as one LayerNormalization node (opset >= 17), not decomposed.
    onnx = pytest.importorskip("onnx")
    from engines.encoder_tensorrt_build import OPSET, export_onnx

    ref = Reference("tdt_tiny")
    path = export_onnx(ref.nemo, tmp_path / "enc.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["enc.onnx"]  # the temp file was renamed
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    cfg, _ = load("tdt_tiny")
    assert model.opset_import[0].version == OPSET >= 17
    assert ops.count("LayerNormalization") == 5 * cfg.n_layers  # 4 pre-norms + norm_out per layer
    assert ops.count("Softmax") == cfg.n_layers and "ReduceMean" not in ops
