"""`transcribe export-engine`: build the TensorRT encoder engine ahead of time, or write the ONNX.

The engine lands in the same cache (and under the same key) that `--encoder-backend tensorrt`
looks in ($TRANSCRIBE_TRT_CACHE, else $XDG_CACHE_HOME/transcribe/trt), so a later run starts
without the minutes-long build, as long as it uses the same precision and profiles
(`--batch-seconds`; the rows per batch are the run's, `DEFAULT_MAX_BATCH`: an option here that
no run takes built engines that no run found). `--onnx PATH` also writes the
exported encoder; `--onnx-only` stops there, which needs neither a GPU nor TensorRT.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Only torch-free names here: a bad --precision or a Whisper --model is said before torch's
# seconds of import (test_cli), as the other commands' usage errors are.
from engines.choices import DEFAULT_BATCH_SECONDS, DEFAULT_MAX_BATCH, PRECISIONS

EXIT_OK, EXIT_NOTHING_RAN, EXIT_USAGE = 0, 1, 2


class ExportError(Exception):
    """A reason the export cannot run, with the exit status to end with."""

    def __init__(self, message: str, code: int = EXIT_NOTHING_RAN):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ExportRequest:
    model: str | None
    precision: str = "fp16"
    cache_dir: Path | None = None
    onnx: Path | None = None
    onnx_only: bool = False
    max_batch: int = DEFAULT_MAX_BATCH
    batch_seconds: float = DEFAULT_BATCH_SECONDS

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.max_batch < 1:
            raise ValueError(f"--max-batch {self.max_batch}: expected >= 1")


def _parakeet_name(model: str | None) -> str:
    """The model to export; a Whisper one is a usage error (exit 2). Reads no weights."""
    from engines.loader import choose_model, is_whisper

    name = choose_model(model, bundled=False)  # the bundled whisper-base has no encoder to export
    if is_whisper(name):  # a model the command does not take: the user's to change, as --language for Parakeet
        raise ExportError(f"{name} is a Whisper model: export-engine builds Parakeet (.nemo) encoders only", EXIT_USAGE)
    return name


def _tensorrt_ready() -> None:
    """Raise ExportError (exit 1) unless the tensorrt package imports and a CUDA GPU is present."""
    import torch

    from engines.encoder_tensorrt_build import TENSORRT_HINT, TensorRTUnavailable, import_tensorrt

    try:
        import_tensorrt()
    except TensorRTUnavailable as e:
        raise ExportError(f"building a TensorRT engine needs the `tensorrt` package, which is not installed: "
                          f"{TENSORRT_HINT} ({e.__cause__})") from e
    if not torch.cuda.is_available():
        raise ExportError("building a TensorRT engine needs a CUDA GPU (the engine is specific to the GPU model)")


def export_engine(req: ExportRequest, echo: Callable[[str], None] = print) -> int:
    """Run the export; returns the exit status (0 done). ExportError carries failures."""
    name = _parakeet_name(req.model)
    from engines.checkpoint import CheckpointError, NemoArchive, naming_checkpoint, resolve_checkpoint
    from engines.nemo_spec import NemoSpec
    from engines.encoder_backend import BackendOptions, feature_profiles
    from engines.choices import EngineBuildError
    from engines.encoder_tensorrt_build import (TensorRTUnavailable, default_cache_dir, ensure_engine, export_onnx,
                                                model_digest)

    if not req.onnx_only and req.onnx is None:
        _tensorrt_ready()  # fail fast, before a download: nothing else was asked for
    try:
        nemo = resolve_checkpoint(name)
        with NemoArchive(nemo) as archive, naming_checkpoint(nemo):
            # The whole config and tokenizer, as a run's load checks them: an engine no run can
            # use is refused here, not after minutes of building.
            fcfg = NemoSpec.read(archive).features
    except (CheckpointError, ValueError, OSError) as e:
        raise ExportError(f"cannot load model: {e}") from e
    cache_dir = req.cache_dir or default_cache_dir()
    onnx = None
    try:
        if req.onnx is not None or req.onnx_only:
            out = req.onnx or cache_dir / "onnx" / f"{nemo.stem}-{model_digest(nemo, cache_dir)[:16]}.onnx"
            onnx = export_onnx(nemo, out)
            echo(f"encoder ONNX -> {onnx}")
            if req.onnx_only:
                return EXIT_OK
            _tensorrt_ready()
        profiles = feature_profiles(fcfg, BackendOptions(req.max_batch, req.batch_seconds, req.precision))
        path, built = ensure_engine(nemo, profiles, fcfg.features, req.precision, cache_dir, onnx_path=onnx)
    except (EngineBuildError, TensorRTUnavailable) as e:  # a failed build; TensorRT 11's or no onnx package
        raise ExportError(str(e)) from e
    except CheckpointError as e:  # weights that do not fit the config, found when the encoder is built
        raise ExportError(f"cannot load model: {e}") from e
    except OSError as e:  # an --onnx or --cache-dir that cannot be written (read-only, a file)
        verb = "read" if e.filename is not None and Path(e.filename) == nemo else "write"
        raise ExportError(f"cannot {verb} {e.filename or cache_dir}: {e.strerror or e}") from e
    echo(f"TensorRT engine ({req.precision}, {len(profiles)} profiles) {'built' if built else 'already cached'}: {path}")
    return EXIT_OK
