"""The TensorRT engine cache and the ONNX export it builds from, on the CPU: the builder is a
stand-in module with TensorRT 10's build API (it records its builds and returns a plan), and
torch is told the GPU's name. What TensorRT itself does with the ONNX is a GPU check
(bench/gpu/on_device.sh); here: one build per key, what a failed or killed build leaves,
a read-only cache of prebuilt engines, a large model's export layout, error lines."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import threading
import time
import types

import numpy as np
import pytest
import torch
from conftest import Reference, needs_shared

from engines.choices import EngineBuildError
from engines.encoder_backend import BackendOptions, feature_profiles
from engines.encoder_tensorrt import aligned
from engines.encoder_tensorrt_build import ensure_engine, export_onnx
from transcribe.export_engine import ExportError, ExportRequest, export_engine
from transcribe.features import FeatureConfig

pytestmark = needs_shared


class StandInTensorRT(types.ModuleType):
    """`tensorrt` as far as `build_engine` calls it; `builds` counts finished builds, `fail`
    makes build_serialized_network return None (as TensorRT does when a build fails),
    `sleep_s` holds a build open."""

    def __init__(self):
        super().__init__("tensorrt")
        self.__version__ = "10.9.0.34"
        self.builds, self.fail, self.sleep_s = 0, False, 0.0
        self.parsed: list[str] = []
        trt = self
        self.float32 = "float32"
        self.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda s, level=2: None})
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
        self.BuilderFlag = types.SimpleNamespace(FP16="fp16", BF16="bf16", OBEY_PRECISION_CONSTRAINTS="obey")
        self.LayerType = types.SimpleNamespace(NORMALIZATION="norm", SOFTMAX="softmax", REDUCE="reduce")
        self.INormalizationLayer = type("INormalizationLayer", (), {})

        class Network:
            num_layers = 0

        class Parser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                trt.parsed.append(path)
                return os.path.getsize(path) > 0

        class Config:
            def set_memory_pool_limit(self, *args):
                pass

            def add_optimization_profile(self, profile):
                return 0

            def set_flag(self, flag):
                pass

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return types.SimpleNamespace(set_shape=lambda *a: None)

            def build_serialized_network(self, network, config):
                trt.sigterm_in_build = signal.getsignal(signal.SIGTERM)
                time.sleep(trt.sleep_s)
                if trt.fail:
                    return None
                trt.builds += 1
                return b"plan"

        self.OnnxParser, self.Builder = Parser, Builder


@pytest.fixture
def trt(monkeypatch):
    stand_in = StandInTensorRT()
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
    return stand_in


def _profiles(nemo):
    from engines.checkpoint import NemoArchive

    with NemoArchive(nemo) as archive:
        fcfg = FeatureConfig.from_nemo(archive.config["preprocessor"])
    return feature_profiles(fcfg, BackendOptions()), fcfg.features


def test_one_build_per_engine_when_two_ask_at_once(trt, tmp_path, capsys):
    """Shards of one job (or export-engine beside a run) each built the same engine, timing
    their tactics against each other on one GPU; the second now waits and finds it built."""
    nemo = Reference("tdt_tiny").nemo
    profiles, n_mels = _profiles(nemo)
    trt.sleep_s = 1.0
    got = []
    runs = [threading.Thread(target=lambda: got.append(ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path)))
            for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert trt.builds == 1 and sorted(built for _, built in got) == [False, True]
    assert got[0][0] == got[1][0] and got[0][0].read_bytes() == b"plan"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".onnx-")]  # the build's ONNX is gone
    assert "note: waiting for another process to finish building" in capsys.readouterr().err


def test_a_cache_without_flock_builds_unguarded_saying_so(trt, tmp_path, monkeypatch, capsys):
    """Lustre without flock, some NFS: flock raises ENOLCK, and every build failed with it."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    nemo = Reference("tdt_tiny").nemo
    profiles, n_mels = _profiles(nemo)
    path, built = ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path)
    assert built and path.read_bytes() == b"plan"
    assert "cannot lock it (No locks available); building without a lock" in capsys.readouterr().err


def test_sigterm_kills_a_build_at_once_and_its_handler_comes_back(trt, tmp_path):
    """A Python handler (export-engine's, which unwinds) runs only once TensorRT's native build
    returns: a time limit's SIGTERM waited out minutes of build, then threw the plan away."""
    def handler(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, handler)
    try:
        nemo = Reference("tdt_tiny").nemo
        profiles, n_mels = _profiles(nemo)
        ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path)
        assert trt.sigterm_in_build is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_killed_builds_onnx_is_removed_by_the_next_build(trt, tmp_path):
    nemo = Reference("tdt_tiny").nemo
    profiles, n_mels = _profiles(nemo)
    path, _ = ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path)
    path.unlink()
    left = tmp_path / f".onnx-{path.stem}"  # what a SIGKILLed build leaves: gigabytes for a 0.6B model
    left.mkdir()
    (left / "encoder.onnx").write_bytes(b"half")
    assert ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path) == (path, True)
    assert not left.exists()


def test_a_digest_memo_that_cannot_be_written_is_skipped(trt, tmp_path, monkeypatch):
    """The model's digest memo is a convenience: a read-only cache of prebuilt engines shipped
    without it (or the same model at another path) failed with "cannot write .../digests"."""
    import engines.encoder_tensorrt_build as build

    nemo = Reference("tdt_tiny").nemo
    profiles, n_mels = _profiles(nemo)
    path, _ = ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path)

    def read_only(path, data):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(build, "atomic_write_bytes", read_only)
    for memo in (tmp_path / "digests").iterdir():
        memo.unlink()
    assert ensure_engine(nemo, profiles, n_mels, "fp16", tmp_path) == (path, False)


def test_a_failed_build_is_an_export_error_and_reuses_the_onnx_asked_for(trt, tmp_path):
    """TensorRT's build returning None (bf16 on a GPU without it, the builder out of memory) was
    a RuntimeError traceback; an --onnx export was made twice (2.4 GB and ~45 s for 0.6B)."""
    nemo = str(Reference("tdt_tiny").nemo)
    trt.fail = True
    with pytest.raises(ExportError, match="TensorRT failed to build the encoder engine") as e:
        export_engine(ExportRequest(nemo, "bf16", tmp_path / "c"), echo=lambda line: None)
    assert e.value.code == 1 and isinstance(e.value.__cause__, EngineBuildError)
    trt.fail = False
    said = []
    assert export_engine(ExportRequest(nemo, "fp16", tmp_path / "c", onnx=tmp_path / "e.onnx"), echo=said.append) == 0
    assert trt.parsed[-1] == str(tmp_path / "e.onnx") and "built" in said[-1]


def test_tensorrt_11_is_an_export_error_naming_the_version_to_install(trt, tmp_path):
    trt.__version__ = "11.0.0"
    del trt.BuilderFlag.FP16
    with pytest.raises(ExportError, match=r"pip install 'tensorrt>=10,<11'"):
        export_engine(ExportRequest(str(Reference("tdt_tiny").nemo), "fp16", tmp_path), echo=lambda line: None)


def _external_per_tensor(real_export):
    """torch's layout for a model over 2 GB (what CI cannot export in minutes): every weight a
    file of its own, named by the graph, so alike for two models of one architecture."""
    import onnx

    def export(encoder, path, **kwargs):
        real_export(encoder, path, **kwargs)
        model = onnx.load(str(path))
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False,
                        size_threshold=0)
    return export


def test_two_large_exports_in_one_folder_keep_their_own_weights(tmp_path, monkeypatch):
    """Two exports of same-architecture models into one folder (the cache's onnx/, or --onnx
    beside each other) overwrote each other's weight files: the first .onnx then ran the second
    model's weights. Each export's weights are now one file named for it."""
    ort = pytest.importorskip("onnxruntime")
    import engines.encoder_onnx as encoder_onnx
    from engines.encoder_onnx import run_session
    from engines.parakeet import ParakeetEngine

    monkeypatch.setattr(encoder_onnx, "export_encoder", _external_per_tensor(encoder_onnx.export_encoder))
    first, second = Reference("tdt_tiny"), Reference("rnnt_tiny")
    export_onnx(first.nemo, tmp_path / "a.onnx")
    export_onnx(second.nemo, tmp_path / "b.onnx")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and names[0] == "a.onnx" and names[2] == "b.onnx", names
    assert names[1].startswith("a.onnx.") and names[3].startswith("b.onnx.") and names[3].endswith(".data")
    export_onnx(first.nemo, tmp_path / "a.onnx")  # again: its old weights file goes
    assert len(list(tmp_path.glob("a.onnx.*.data"))) == 1 and len(list(tmp_path.iterdir())) == 4
    engine = ParakeetEngine.from_nemo(first.nemo, "cpu")
    feats = [torch.from_numpy(first.array("features", i)) for i in range(2)]
    feats, flen = engine._batch(feats)
    got, got_len = run_session(ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"]),
                               feats.numpy(), flen.numpy())
    with torch.inference_mode():
        want, want_len = engine.encoder(feats, flen)
    assert got_len.tolist() == want_len.tolist()
    n = int(want_len[0])
    assert np.abs(got[0, :, :n] - want[0, :, :n].numpy()).max() < 1e-4


def test_tensor_addresses_handed_to_tensorrt_are_256_byte_aligned():
    """A chunk of a batch is a view at any row offset (`in_chunks`); TensorRT requires 256-byte
    aligned addresses, so a view elsewhere is copied (CUDA's allocator aligns to 512)."""
    storage = torch.arange(4096, dtype=torch.float32)
    seen = set()
    for offset in range(64):  # 4 bytes a step
        view = storage[offset:offset + 100]
        out = aligned(view)
        seen.add(view.data_ptr() % 256 == 0)
        if view.data_ptr() % 256 == 0:
            assert out is view
        else:
            assert out.data_ptr() != view.data_ptr() and torch.equal(out, view)
    assert seen == {True, False}
