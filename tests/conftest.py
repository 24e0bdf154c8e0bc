"""Shared test helpers: where `../shared` is, and the NeMo reference fixtures in it."""
from __future__ import annotations

import builtins
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = (ROOT / ".." / "shared").resolve()
NEMO_REF = SHARED / "fixtures" / "nemo_reference"
SPEECH = SHARED / "data" / "speech"
OFFLINE_VARIANTS = ["tdt_tiny", "tdt_128mel", "rnnt_tiny", "tdt_ctc_tiny"]
# NeMo references made by bench/make_nemo_references.py for architectures the fixtures lack.
NEMO_EXTRA = ROOT / "tests" / "data" / "nemo_extra"
EXTRA_VARIANTS = ["tdt_striding4", "tdt_dw16_128mel", "ctc_dw8"]

def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need a CUDA device: without one they are reported as skipped
    (never as passed), with the reason, so a CPU run stays green and honest."""
    import torch

    if torch.cuda.is_available():
        # The GPU tests compare tokens exactly with NeMo's fp32 CPU references and across
        # backends whose padded shapes pick other kernels. torch's default lets cuDNN run fp32
        # convolutions in TF32 (10-bit mantissa): encoder outputs then move by ~1e-3 and flip
        # random-weight near-ties (seen on the H100, 2026-11-23). The product keeps torch's
        # default, as NeMo does; the tests check the arithmetic in true fp32.
        torch.backends.cudnn.allow_tf32 = False
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _seed_torch() -> None:
    import torch

    torch.manual_seed(0)


def pytest_sessionstart(session):
    """The first test's session- and module-scoped fixtures are set up before its own seed
    (below): they draw from this one."""
    _seed_torch()


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from one seed of torch's default generator. torch 2.13 seeds it
    differently in every process, so a test that draws inputs or initial weights from it
    (torch.randn, nn.Linear's init) saw other numbers on every run, and a tolerance near its
    edge failed one run in several (the Triton attention check did, in a fresh-clone CI).
    A wider-scoped fixture built in a later test's setup draws after the previous test's
    seeded draws, so a whole run repeats too."""
    _seed_torch()


# Checked without importing triton: the interpreter tests run it in a subprocess (the
# TRITON_INTERPRET flag is read at import), and an import here would only add exit noise.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install -e '.[test]')")


def run_in_triton_interpreter(module: str, function: str) -> str:
    """`module.function()` (a tests/ module) in a fresh interpreter with TRITON_INTERPRET=1 (the
    flag is read when triton is imported, so it cannot be switched on inside this process);
    fails the test on a non-zero exit; returns its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{function}()"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout

needs_shared = pytest.mark.skipif(
    not NEMO_REF.is_dir(), reason=f"shared fixtures not found at {NEMO_REF} (CI always has them)"
)


class Reference:
    """One fixture variant: its `.nemo`, NeMo's per-file outputs (json) and arrays (npz)."""

    def __init__(self, variant: str, base: Path = NEMO_REF):
        self.dir = base / variant
        self.nemo = self.dir / "model.nemo"
        meta = json.loads((self.dir / "reference.json").read_text())
        self.spec = meta.get("spec", {})
        self.files = meta["files"]
        npz = self.dir / "reference.npz"
        self.arrays = np.load(npz) if npz.exists() else None

    def audio_path(self, i: int) -> Path:
        return (self.dir.parent / self.files[i]["audio"]).resolve()

    def array(self, name: str, i: int) -> np.ndarray:
        return self.arrays[f"{name}_{i}"]


@pytest.fixture(scope="session", params=OFFLINE_VARIANTS)
def reference(request) -> Reference:
    if not NEMO_REF.is_dir():
        pytest.skip(f"shared fixtures not found at {NEMO_REF} (CI always has them)")
    return Reference(request.param)


def bundled_whisper_fp32(batch_size: int):
    """The bundled whisper-base in float32 (as the references were made), or a skip when its
    packages or the shared speech are missing."""
    from engines.whisper_engine import WhisperEngine
    from engines.whisper_weights import WhisperWeightsError, bundled_base_dir

    try:
        bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    if not SPEECH.is_dir():
        pytest.skip(f"shared speech data not found at {SPEECH}")
    return WhisperEngine.from_bundled(batch_size=batch_size, dtype="float32")


def refusing_open(locked: Path):
    """`open` that refuses `locked` as a file without read permission does, for tests of that
    case: they may run as root, who reads a chmod 0 file anyway. Every other file opens."""
    real = builtins.open

    def open_(file, *args, **kwargs):
        if str(file) == str(locked):
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    return open_


class FakeClock:
    """What `cpu_threads.perf_counter` reads in tests of the startup probes that time two ways
    of doing the same work (`cpu_threads.best_seconds`): a stand-in for a run calls
    `spend(key, seconds)`, which records the run and moves the clock on."""

    def __init__(self) -> None:
        self.now, self.runs = 0.0, []

    def spend(self, key, seconds: float) -> None:
        self.runs.append(key)
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    from engines import cpu_threads

    clock = FakeClock()
    monkeypatch.setattr(cpu_threads, "perf_counter", lambda: clock.now)
    return clock
