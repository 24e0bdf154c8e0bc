"""Building the TensorRT encoder engine, once per model, GPU and precision, cached on disk.

`.nemo` -> ONNX (`engines.encoder_onnx`, dynamic batch and time axes, opset 17 so that every
LayerNorm is one ONNX LayerNormalization node) -> TensorRT network with one optimization
profile per length bucket (`BucketProfile`: batch 1..max_batch, width min_frames..frames,
tuned for the bucket's largest shape) -> serialized engine in the cache directory.

Cache key (`EngineSpec.key`): the model file's digest, the GPU's name and compute capability,
the TensorRT version, the precision, the profiles, n_mels and ENGINE_FORMAT. An engine only
runs on the GPU model and TensorRT version it was built with, and any change of weights or
profiles makes another engine, so each is part of the key. The model digest is the SHA-256 of
the whole `.nemo` file, computed once and remembered under `digests/` keyed by the file's
path, size, mtime and inode (a 2.5 GB checkpoint takes seconds to hash; a lookup costs a
stat), so a replaced or retrained checkpoint is never served a stale engine.

fp16 / bf16: TensorRT may pick reduced-precision kernels everywhere except where numerics
need range: normalization layers (the LayerNorms: mean and variance of the residual stream),
softmax and reductions are pinned to fp32 with OBEY_PRECISION_CONSTRAINTS, as TensorRT's
guidance on transformers recommends. Engine files are written atomically (temp file, fsync,
rename), so a build killed halfway never leaves a corrupt cache entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from engines.choices import PRECISIONS
from engines.encoder_backend import BucketProfile
from transcribe.writers import FILE_MODE, atomic_write_bytes  # the one atomic write (temp, fsync, rename)

ENGINE_FORMAT = 1  # bump when the export or the build recipe changes: old entries then miss
OPSET = 17  # LayerNormalization is an ONNX op from 17 on: TensorRT's normalization layer
TENSORRT_HINT = "pip install 'transcribe[tensorrt]'"
_HASH_BLOCK = 8 << 20


class TensorRTUnavailable(ImportError):
    """The `tensorrt` package is not installed (or does not import)."""


def import_tensorrt():
    """The `tensorrt` module, or TensorRTUnavailable naming the package and the extra."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailable(f"the TensorRT encoder needs the `tensorrt` package ({e}): {TENSORRT_HINT}") from e
    return tensorrt


CACHE_ENV = "TRANSCRIBE_TRT_CACHE"


def default_cache_dir() -> Path:
    """Where runs and `export-engine` keep engines: $TRANSCRIBE_TRT_CACHE, else
    $XDG_CACHE_HOME/transcribe/trt, else ~/.cache/transcribe/trt."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "transcribe" / "trt"


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine file depends on; `key()` names it in the cache."""

    model_digest: str
    gpu_name: str
    capability: tuple[int, int]
    trt_version: str
    precision: str
    profiles: tuple[BucketProfile, ...]
    n_mels: int

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"TensorRT precision {self.precision!r} is not supported (supported: {', '.join(PRECISIONS)})")
        if not self.profiles:
            raise ValueError("a TensorRT engine needs at least one bucket profile")

    def key(self) -> str:
        """SHA-256 (hex) of the spec's canonical JSON, with ENGINE_FORMAT and OPSET."""
        doc = {**asdict(self), "capability": list(self.capability), "format": ENGINE_FORMAT, "opset": OPSET}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def path(self, cache_dir: str | os.PathLike) -> Path:
        return Path(cache_dir) / f"encoder-{self.precision}-{self.key()[:32]}.plan"


def model_digest(path: str | os.PathLike, cache_dir: str | os.PathLike) -> str:
    """SHA-256 of the model file, remembered in `cache_dir/digests` per (path, size, mtime, inode)."""
    st = os.stat(path)
    ident = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = Path(cache_dir) / "digests" / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    digest = h.hexdigest()
    atomic_write_bytes(memo, digest.encode())
    return digest


def export_onnx(nemo_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The encoder of a `.nemo` as ONNX at `out` (on the CPU; the file appears atomically).
    Models over 2 GB get their weights as external data files next to it (ONNX's limit)."""
    from engines.checkpoint import NemoArchive, pop_sub_state_dict
    from engines.conformer import EncoderConfig
    from engines.encoder_onnx import export_encoder, exportable_encoder

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with NemoArchive(nemo_path) as archive:
        cfg = EncoderConfig.from_nemo(archive.config["encoder"])
        encoder = exportable_encoder(cfg, pop_sub_state_dict(archive.state_dict(), "encoder"))
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        export_encoder(encoder, tmp, opset=OPSET)
        os.chmod(tmp, FILE_MODE)  # mkstemp's 0600 would keep the file from a shared engine cache's users
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _keep_fp32(trt, network) -> int:
    """Pin normalization, softmax and reduce layers (float outputs) to fp32; returns how many."""
    keep = {trt.LayerType.NORMALIZATION, trt.LayerType.SOFTMAX, trt.LayerType.REDUCE}
    n = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type not in keep or layer.get_output(0).dtype != trt.float32:
            continue  # integer reductions (lengths) have no precision to keep
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            layer.set_output_type(j, trt.float32)
        if layer.type == trt.LayerType.NORMALIZATION and hasattr(trt.INormalizationLayer, "compute_precision"):
            # get_layer() returns the base ILayer; as Polygraphy does, view it as its subclass
            # to reach the normalization's own accumulation type (TensorRT 10; gone in 11).
            layer.__class__ = trt.INormalizationLayer
            layer.compute_precision = trt.float32
        n += 1
    return n


def build_engine(onnx_path: str | os.PathLike, spec: EngineSpec, workspace_bytes: int | None = None):
    """Parse the ONNX and build a serialized engine (IHostMemory) with one profile per bucket."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    # parse_from_file, not parse(bytes): it resolves external weight files next to the ONNX.
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    for p in spec.profiles:
        profile = builder.create_optimization_profile()
        profile.set_shape("features", (1, spec.n_mels, p.min_frames), (p.max_batch, spec.n_mels, p.frames),
                          (p.max_batch, spec.n_mels, p.frames))
        profile.set_shape("lengths", (1,), (p.max_batch,), (p.max_batch,))
        config.add_optimization_profile(profile)
    if spec.precision != "fp32":
        if not hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 11 dropped weak typing
            raise TensorRTUnavailable(f"TensorRT {trt.__version__} builds no {spec.precision} engine from an fp32 "
                                      f"network (weakly typed builds ended in TensorRT 11): pip install "
                                      f"'tensorrt>=10,<11', or build in fp32 (export-engine --precision fp32, "
                                      f"transcribe --dtype float32)")
        config.set_flag(trt.BuilderFlag.FP16 if spec.precision == "fp16" else trt.BuilderFlag.BF16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        _keep_fp32(trt, network)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build the encoder engine from {onnx_path} (see its log above)")
    return plan


def engine_spec(nemo_path: str | os.PathLike, profiles: Sequence[BucketProfile], n_mels: int, precision: str,
                cache_dir: str | os.PathLike, device=None) -> EngineSpec:
    """The spec of the engine for this model on this GPU with the installed TensorRT."""
    trt = import_tensorrt()
    major, minor = torch.cuda.get_device_capability(device)
    return EngineSpec(model_digest(nemo_path, cache_dir), torch.cuda.get_device_name(device), (major, minor),
                      trt.__version__, precision, tuple(profiles), n_mels)


def ensure_engine(nemo_path: str | os.PathLike, profiles: Sequence[BucketProfile], n_mels: int, precision: str,
                  cache_dir: str | os.PathLike | None = None, device=None) -> tuple[Path, bool]:
    """The cached engine file for this model/GPU/TensorRT/precision/profiles, built first when
    missing. Returns (path, built now)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = engine_spec(nemo_path, profiles, n_mels, precision, cache_dir, device)
    path = spec.path(cache_dir)
    if path.is_file():
        return path, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    # The builder times its tactics on the current device: make it the one the key names.
    with tempfile.TemporaryDirectory(prefix=".onnx-", dir=cache_dir) as tmp, torch.cuda.device(device):
        plan = build_engine(export_onnx(nemo_path, Path(tmp) / "encoder.onnx"), spec)
    atomic_write_bytes(path, plan)
    meta = {**asdict(spec), "key": spec.key(), "format": ENGINE_FORMAT, "model": str(nemo_path)}
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    return path, True
