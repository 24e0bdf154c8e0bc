"""NeMo parity on inputs the shared fixtures lack (tests/data/nemo_edge, made with NeMo 3.0.0 by
bench/make_edge_references.py): recordings at 8 / 22.05 / 44.1 / 48 kHz, resampled as NeMo's
`transcribe()` does it (lhotse's samples, NeMo's transcripts through our command line), and
files shorter than one 25 ms window, which NeMo transcribes."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SPEECH, Reference, needs_shared
from test_cli import run_cli
from transcribe.resample import output_length, resample

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((Path(__file__).parent / "data" / "nemo_edge" / "reference.json").read_text())
_spec = importlib.util.spec_from_file_location("make_edge_references", ROOT / "bench" / "make_edge_references.py")
make_refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_refs)
RATE_FILES = {k: v for k, v in REFERENCE["files"].items() if "_first" not in k}  # the rest: 16 kHz, short


@pytest.fixture(scope="module")
def derived(tmp_path_factory) -> dict[str, Path]:
    """The reference's input files, rebuilt byte for byte from the shared recordings."""
    folder = tmp_path_factory.mktemp("rates")
    return {p.name: p for p in make_refs.write_inputs(folder, SPEECH / "librispeech_test_other")}


@needs_shared
def test_samples_are_lhotses(derived):
    """What NeMo's model is fed: lhotse's count (round half up, not librosa's ceil) and values."""
    import soundfile as sf

    for name, ref in RATE_FILES.items():
        pcm, rate = sf.read(derived[name], dtype="float32")
        y = resample(pcm, rate, 16000)
        assert y.shape[0] == ref["lhotse_samples"] == output_length(pcm.shape[0], rate, 16000), name
        assert np.abs(y[1000:1008] - np.array(ref["lhotse_head"])).max() < 1e-6, name
        assert abs(float(np.sqrt(np.mean(y.astype(np.float64) ** 2))) - ref["lhotse_rms"]) < 1e-6, name


@needs_shared
@pytest.mark.parametrize("variant", sorted({m for f in REFERENCE["files"].values() for m in f["models"]}))
def test_cli_reproduces_nemo_at_other_rates_and_on_tiny_files(variant, derived, tmp_path):
    """soxr (librosa's resampler, which we used) gave other text on every model at 8 kHz, and
    files under 400 samples failed as too short ("g" for 160 samples, from NeMo)."""
    out = tmp_path / "out"
    p = run_cli(*map(str, derived.values()), "--model", str(Reference(variant).nemo), "--out", str(out),
                "--format", "json", "--batch-seconds", "20")
    assert p.returncode == 0, p.stderr
    for name, ref in REFERENCE["files"].items():
        doc = json.loads((out / Path(name).with_suffix(".json").name).read_text())
        nemo = ref["models"][variant]
        assert doc["text"] == nemo["transcribe_text"], name
        end = ref["lhotse_samples"] / 16000  # NeMo's last word may end past the audio; ours does not
        assert [(w["word"], w["start"], w["end"]) for w in doc["words"]] == [
            (w["word"], round(min(w["start"], end), 3), round(min(w["end"], end), 3)) for w in nemo["words"]], name
