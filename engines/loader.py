"""Which model to run, and loading it: `--model` > $TRANSCRIBE_MODEL > parakeet-tdt-0.6b-v2 (in
the Hugging Face cache, or fetched when the hub answers quickly) > the bundled whisper-base.

Never hangs on a network that drops packets: before any download we open one TCP connection
to the hub with a short timeout, and go offline if it does not answer.
"""
from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

from pathlib import Path

from engines.checkpoint import REGISTRY, CheckpointError, RegistryEntry, resolve_checkpoint

DEFAULT_PARAKEET = "parakeet-tdt-0.6b-v2"
BUNDLED = "whisper-base"
WHISPER_NAMES = ("whisper-base",)
PROBE_TIMEOUT_S = 2.0
_NONE = RegistryEntry("", "", "", "")
WHISPER_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin")


def is_whisper_path(model: str) -> bool:
    """A local Whisper checkpoint: OpenAI .pt, safetensors, CT2 model.bin, or a folder of those."""
    p = Path(model)
    if p.is_dir():
        return (p / "model.bin").is_file() or (p / "model.safetensors").is_file()
    return p.suffix in WHISPER_SUFFIXES and p.is_file()


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection within `timeout_s`."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def choose_model(model: str | None) -> str:
    """The model name or path to use, following the documented order."""
    if model:
        return model
    env = os.environ.get("TRANSCRIBE_MODEL")
    if env:
        return env
    try:
        resolve_checkpoint(DEFAULT_PARAKEET, offline=True)
        return DEFAULT_PARAKEET
    except CheckpointError:
        pass
    if hub_reachable():
        return DEFAULT_PARAKEET
    print(
        f"note: {DEFAULT_PARAKEET} is not in the Hugging Face cache and the hub is unreachable; "
        f"using the bundled {BUNDLED}. For Parakeet, run once with network access "
        f"(`transcribe --model {DEFAULT_PARAKEET} FILE`) or pass a local .nemo with --model.",
        file=sys.stderr,
    )
    return BUNDLED


def load_engine(model: str | None, device: str = "auto"):
    """An engine (see `transcribe.pipeline.Engine`) for `model` on `device`."""
    name = choose_model(model)
    if name in WHISPER_NAMES or is_whisper_path(name) or REGISTRY.get(name, _NONE).family == "whisper":
        from engines.whisper_engine import WhisperEngine

        if name in WHISPER_NAMES:
            return WhisperEngine.load(name, device)
        path = resolve_checkpoint(name, offline=None if hub_reachable() else True) if name in REGISTRY else Path(name)
        return WhisperEngine.load_path(path, device, name=name)
    from engines.parakeet import ParakeetEngine

    path = resolve_checkpoint(name, offline=None if hub_reachable() else True)
    return ParakeetEngine.from_nemo(path, device, name=name)
