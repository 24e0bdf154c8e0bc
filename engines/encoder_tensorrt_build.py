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

import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from engines.choices import PRECISIONS, EngineBuildError
from engines.encoder_backend import BucketProfile
# atomic_write_bytes: the one atomic write (temp, fsync, rename)
from transcribe.writers import FILE_MODE, atomic_write_bytes, naming_output, open_lock

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
    except (ImportError, OSError) as e:  # OSError: an install whose libnvinfer cannot be loaded
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
    try:
        atomic_write_bytes(memo, digest.encode())
    except OSError:  # a read-only cache of prebuilt engines: their lookup needs no memo
        pass
    return digest


def export_onnx(nemo_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The encoder of a `.nemo` as ONNX at `out` (on the CPU), in place atomically. A model over
    2 GB (ONNX's limit for one file) keeps its weights in one file beside it,
    `<out name>.<8 hex>.data`, named by the .onnx and renamed into place before it, so an
    .onnx never points at another export's weights; the data file of the export it replaced
    is removed."""
    from engines.checkpoint import NemoArchive, config_section, naming_checkpoint, pop_sub_state_dict
    from engines.conformer import EncoderConfig
    from engines.encoder_onnx import export_encoder, exportable_encoder

    onnx = _import_onnx()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with NemoArchive(nemo_path) as archive, naming_checkpoint(nemo_path):
        cfg = EncoderConfig.from_nemo(config_section(archive.config, "encoder"))
        encoder = exportable_encoder(cfg, pop_sub_state_dict(archive.state_dict(), "encoder"))
    # A folder of its own: torch writes a large model's weights as hundreds of files named by
    # the graph (onnx__MatMul_6170), alike for every model of one architecture, so two exports
    # into one folder overwrote each other's weights.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        try:
            export_encoder(encoder, Path(tmp) / "encoder.onnx", opset=OPSET)
            del encoder  # a large model is loaded again to re-save its weights: not twice in memory
            done = _one_data_file(onnx, Path(tmp), "encoder.onnx", out)
            for f in done:
                os.chmod(f, FILE_MODE)  # mkdtemp's 0700 folder is left; the files keep the umask's mode
            old_data = _data_files(out)
            for f in done:  # the data first: the .onnx is the switch
                os.replace(f, out.parent / f.name)
        except OSError as e:
            raise naming_output(e, out)  # the output's name, not the temporary's
    for stale in old_data - {f.name for f in done}:
        (out.parent / stale).unlink(missing_ok=True)
    return out


def _import_onnx():
    try:
        import onnx
    except ImportError as e:  # torch's exporter needs it too
        raise TensorRTUnavailable(f"ONNX export needs the `onnx` package ({e}): pip install 'transcribe[onnx]'") from e
    return onnx


def _one_data_file(onnx, folder: Path, name: str, out: Path) -> list[Path]:
    """The export in `folder/name` as files to rename into `out`'s folder: `out.name` alone, or
    (weights written as files of their own) with its weights in one data file. Last the .onnx."""
    if os.listdir(folder) == [name]:
        os.replace(folder / name, folder / out.name)
        return [folder / out.name]
    data = f"{out.name}.{os.urandom(4).hex()}.data"
    model = onnx.load(str(folder / name))  # with its external weights
    onnx.save_model(model, str(folder / out.name), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data)
    return [folder / data, folder / out.name]


def _data_files(onnx_path: Path) -> set[str]:
    """The weight files of the export at `onnx_path` that `export_onnx` names, those there."""
    return {f.name for f in onnx_path.parent.glob(f"{glob.escape(onnx_path.name)}.*.data")}


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
        raise EngineBuildError(f"TensorRT could not parse {onnx_path}: {errors}")
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
        raise EngineBuildError(f"TensorRT failed to build the encoder engine from {onnx_path} (see its log above)")
    return plan


def engine_spec(nemo_path: str | os.PathLike, profiles: Sequence[BucketProfile], n_mels: int, precision: str,
                cache_dir: str | os.PathLike, device=None) -> EngineSpec:
    """The spec of the engine for this model on this GPU with the installed TensorRT."""
    trt = import_tensorrt()
    major, minor = torch.cuda.get_device_capability(device)
    return EngineSpec(model_digest(nemo_path, cache_dir), torch.cuda.get_device_name(device), (major, minor),
                      trt.__version__, precision, tuple(profiles), n_mels)


def ensure_engine(nemo_path: str | os.PathLike, profiles: Sequence[BucketProfile], n_mels: int, precision: str,
                  cache_dir: str | os.PathLike | None = None, device=None,
                  onnx_path: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """The cached engine file for this model/GPU/TensorRT/precision/profiles, built first when
    missing (from `onnx_path` when the caller exported it already). Returns (path, built now).

    One build per key at a time: a process that finds another building the same engine (shards
    of one job, export-engine beside a run) waits for its lock and then finds the engine, where
    both built it, each timing its tactics against the other's on one GPU. The build's ONNX
    goes to a folder named by the key, so one left by a killed build is removed by the next."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = engine_spec(nemo_path, profiles, n_mels, precision, cache_dir, device)
    path = spec.path(cache_dir)
    if path.is_file():
        return path, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock, _ = open_lock(cache_dir / f".{path.stem}.lock")
    try:
        _build_lock(lock, path)
        if path.is_file():
            return path, False  # built while this one waited
        work = cache_dir / f".onnx-{path.stem}"
        shutil.rmtree(work, ignore_errors=True)  # a killed build's
        try:
            onnx = Path(onnx_path) if onnx_path is not None else export_onnx(nemo_path, work / "encoder.onnx")
            # The builder times its tactics on the current device: make it the one the key names.
            with torch.cuda.device(device), _killable():
                plan = build_engine(onnx, spec)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        atomic_write_bytes(path, plan)
        meta = {**asdict(spec), "key": spec.key(), "format": ENGINE_FORMAT, "model": str(nemo_path)}
        atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    finally:
        os.close(lock)  # the lock goes with it, as with a process that dies
    return path, True


def _build_lock(fd: int, engine: Path) -> None:
    """Take the build lock of `engine`, saying so when another process holds it (its build
    takes minutes); where the file system has no flock (Lustre without it, some NFS), build
    unguarded, as runs write an --out there (`resume.out_dir_lock`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"note: waiting for another process to finish building {engine}", file=sys.stderr)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        print(f"note: {engine.parent}: cannot lock it ({e.strerror}); building without a lock", file=sys.stderr)


@contextmanager
def _killable() -> Iterator[None]:
    """SIGTERM's default action during TensorRT's build: a Python handler (the CLI's, which
    unwinds) runs only once the minutes-long native call returns, and a batch job's time limit
    then waited out the build to throw it away. Killed, the build leaves only its folder under
    the key, which the next build removes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
