"""ONNX export of the FastConformer encoder, and running it with onnxruntime.

Graph: features float32 [batch, n_mels, frames] + lengths int64 [batch] -> encoded float32
[batch, d_model, enc_frames] + encoded_lengths int64 [batch]; batch and frames are dynamic.

Exporter: torch 2.13's default (`dynamo=True`) needs the `onnxscript` package, which this
project does not depend on; the TorchScript-based exporter (`dynamo=False`) handles this graph
(masks built unconditionally, NeMo's pad-and-reshape rel_shift instead of `as_strided`).
The positional table is baked in: inputs must stay within `pos_emb_max_len` encoder frames.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from engines.conformer import ConformerEncoder, EncoderConfig
from engines.fast_linear import PackedLinear

INPUTS = ("features", "lengths")
OUTPUTS = ("encoded", "encoded_lengths")
DYNAMIC_AXES = {
    "features": {0: "batch", 2: "frames"},
    "lengths": {0: "batch"},
    "encoded": {0: "batch", 2: "enc_frames"},
    "encoded_lengths": {0: "batch"},
}


def exportable_encoder(cfg: EncoderConfig, state: dict[str, torch.Tensor]) -> ConformerEncoder:
    """An encoder for export: BatchNorm and xscale folded, linears left as plain nn.Linear."""
    return ConformerEncoder.from_state(cfg, state, pack_linears=False)


def export_encoder(encoder: ConformerEncoder, path: str | os.PathLike, *, opset: int = 17,
                   example_frames: int = 400) -> Path:
    """Write `encoder` as ONNX to `path` (dynamic batch and time axes); returns the path.

    The encoder must not hold oneDNN-packed linears (build it with `exportable_encoder`).
    """
    if any(isinstance(m, PackedLinear) for m in encoder.modules()):
        raise ValueError("encoder has oneDNN-packed linears, which ONNX cannot hold: "
                         "build it with exportable_encoder() / from_state(..., pack_linears=False)")
    if encoder.dtype != torch.float32:
        # The graph is the fp32 model; TensorRT lowers its precision itself (engines.encoder_tensorrt_build).
        raise ValueError(f"export an fp32 encoder, not {encoder.dtype}: TensorRT picks its own precision")
    cfg = encoder.cfg
    # Two rows of different lengths, so the traced graph carries the padding masks.
    features = torch.randn(2, cfg.feat_in, example_frames)
    lengths = torch.tensor([example_frames, example_frames * 3 // 4], dtype=torch.int64)
    path = Path(path)
    encoder.set_export_mode(True)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # The tracer flags shape checks and the positional-table bound as constants: intended.
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)  # the legacy exporter
            warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
            torch.onnx.export(encoder, (features, lengths), str(path), dynamo=False, opset_version=opset,
                              input_names=list(INPUTS), output_names=list(OUTPUTS), dynamic_axes=DYNAMIC_AXES)
    finally:
        encoder.set_export_mode(False)
    return path


def load_session(path: str | os.PathLike, threads: int | None = None):
    """An onnxruntime CPU session for an exported encoder; `threads` caps intra-op threads."""
    import onnxruntime as ort  # optional dependency: only needed here

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads is not None:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def run_session(session, features: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """features float32 [B, n_mels, T], lengths [B] -> (encoded [B, d_model, T'], lengths [B] int64)."""
    feeds = {"features": np.ascontiguousarray(features, dtype=np.float32),
             "lengths": np.asarray(lengths, dtype=np.int64)}
    encoded, encoded_lengths = session.run(list(OUTPUTS), feeds)
    return encoded, encoded_lengths
