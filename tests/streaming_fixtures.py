"""Fixtures shared by the streaming tests: the cache-aware fixture model and its recordings.
Import them into a test module (`from streaming_fixtures import model, files`)."""
from __future__ import annotations

import json

import pytest
import soundfile as sf

from conftest import NEMO_REF
from transcribe.streaming.scheduler import StreamingModel

VARIANT = NEMO_REF / "rnnt_streaming_tiny"


@pytest.fixture(scope="module")
def model() -> StreamingModel:
    return StreamingModel.from_nemo(VARIANT / "model.nemo")


@pytest.fixture(scope="module")
def files() -> list[dict]:
    """reference.json's per-file entries, each with its 16 kHz float32 `samples`."""
    meta = json.loads((VARIANT / "reference.json").read_text())
    out = []
    for f in meta["files"]:
        audio, sr = sf.read(str((NEMO_REF / f["audio"]).resolve()), dtype="float32")
        if sr != 16000:
            raise ValueError(f"{f['audio']}: {sr} Hz, the fixture's references are at 16 kHz")
        out.append({**f, "samples": audio})
    return out
