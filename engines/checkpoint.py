"""Checkpoints: `.nemo` archives read in place, and registry names resolved through Hugging Face.

A `.nemo` file is a tar archive holding `model_config.yaml`, `model_weights.ckpt` (a torch
state dict with NeMo's key names) and the tokenizer's files, referenced from the config as
`nemo:<member name>`. We never unpack the archive: the config and tokenizer are read as bytes,
and the weights are streamed by `torch.load` straight from the tar member (an uncompressed tar
member is a seekable window of the archive), so a 2.4 GB checkpoint costs no temporary copy.
"""
from __future__ import annotations

import os
import pickle
import tarfile
import urllib.error
import urllib.request
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import yaml

if TYPE_CHECKING:  # torch is imported where weights are read: choosing a model needs none
    import torch
    from torch import nn

CONFIG_MEMBER = "model_config.yaml"
PROBE_TIMEOUT_S = 2.0  # one HEAD request to the hub before any download (`hub_reachable`)
WEIGHTS_MEMBER = "model_weights.ckpt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or holds something we do not support."""


@dataclass(frozen=True)
class RegistryEntry:
    """A model name users can pass to `--model`, and where its weights live."""

    name: str
    repo_id: str
    filename: str
    family: str  # "parakeet" (a .nemo transducer / CTC model) or "whisper"
    extra_files: tuple[str, ...] = ()  # fetched into the same snapshot folder as `filename`
    # Fetched there too when the repo has them, and loaded without when not (an older cache):
    # Whisper's generation_config.json lists its alignment heads, without which word times
    # come from OpenAI's default heads and moved up to 0.14 s (whisper-base on JFK).
    optional_files: tuple[str, ...] = ()


# Parakeet / FastConformer checkpoints published by NVIDIA as single `.nemo` files.
REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry("parakeet-tdt-0.6b-v2", "nvidia/parakeet-tdt-0.6b-v2", "parakeet-tdt-0.6b-v2.nemo", "parakeet"),
        RegistryEntry("parakeet-tdt-0.6b-v3", "nvidia/parakeet-tdt-0.6b-v3", "parakeet-tdt-0.6b-v3.nemo", "parakeet"),
        RegistryEntry("parakeet-tdt-1.1b", "nvidia/parakeet-tdt-1.1b", "parakeet-tdt-1.1b.nemo", "parakeet"),
        RegistryEntry("parakeet-rnnt-0.6b", "nvidia/parakeet-rnnt-0.6b", "parakeet-rnnt-0.6b.nemo", "parakeet"),
        RegistryEntry("parakeet-rnnt-1.1b", "nvidia/parakeet-rnnt-1.1b", "parakeet-rnnt-1.1b.nemo", "parakeet"),
        RegistryEntry("parakeet-tdt_ctc-110m", "nvidia/parakeet-tdt_ctc-110m", "parakeet-tdt_ctc-110m.nemo", "parakeet"),
        RegistryEntry("parakeet-tdt_ctc-1.1b", "nvidia/parakeet-tdt_ctc-1.1b", "parakeet-tdt_ctc-1.1b.nemo", "parakeet"),
        RegistryEntry("parakeet-ctc-0.6b", "nvidia/parakeet-ctc-0.6b", "parakeet-ctc-0.6b.nemo", "parakeet"),
        RegistryEntry("parakeet-ctc-1.1b", "nvidia/parakeet-ctc-1.1b", "parakeet-ctc-1.1b.nemo", "parakeet"),
        # OpenAI Whisper in Hugging Face's safetensors layout (weights + head counts + vocab).
        *[RegistryEntry(f"whisper-{size}", f"openai/whisper-{size}", "model.safetensors", "whisper",
                        ("config.json", "tokenizer.json"), ("generation_config.json",))
          for size in ("large-v3", "large-v3-turbo", "large-v2", "medium", "medium.en", "small",
                       "small.en", "base.en", "tiny", "tiny.en")],
    ]
}


def _member_name(name: str) -> str:
    """Config references look like `nemo:abc_tokenizer.model`; archive members may carry `./`."""
    return name[len("nemo:"):] if name.startswith("nemo:") else name


class NemoArchive:
    """Read-only view of a `.nemo` tar archive. Members are located once, read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such checkpoint file")
        try:
            # "r:*" also reads the gzip-compressed archives older NeMo versions wrote.
            self._tar = tarfile.open(self.path, "r:*")
        except tarfile.TarError as e:  # its message lists each compression tried, a line each
            raise CheckpointError(f"{self.path}: not a .nemo (tar) archive ({str(e).splitlines()[0].rstrip(':')})") from e
        try:
            members = self._tar.getmembers()
        except (tarfile.TarError, EOFError, OSError) as e:  # a download cut short, most often
            self._tar.close()
            raise CheckpointError(f"{self.path}: the archive is cut short or damaged ({e}); "
                                  f"download or copy it again") from e
        self._members = {os.path.basename(m.name): m for m in members if m.isfile()}
        for required in (CONFIG_MEMBER, WEIGHTS_MEMBER):
            if required not in self._members:
                raise CheckpointError(f"{self.path}: archive has no {required}")
        self._config: dict[str, Any] | None = None

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> "NemoArchive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def member_bytes(self, name: str) -> bytes:
        """The bytes of one member, by its name or its `nemo:` reference from the config."""
        key = os.path.basename(_member_name(name))
        if key not in self._members:
            raise CheckpointError(f"{self.path}: archive has no member {name!r}")
        f = self._tar.extractfile(self._members[key])
        assert f is not None  # members were filtered to regular files
        return f.read()

    @property
    def config(self) -> dict[str, Any]:
        """`model_config.yaml` as a plain dict (read once)."""
        if self._config is None:
            try:
                self._config = yaml.safe_load(self.member_bytes(CONFIG_MEMBER))
            except yaml.YAMLError as e:  # not a ValueError: it was a traceback
                mark = getattr(e, "problem_mark", None)
                where = f" (line {mark.line + 1}: {e.problem})" if mark is not None else ""
                raise CheckpointError(f"{self.path}: {CONFIG_MEMBER} is not valid YAML{where}") from e
            if not isinstance(self._config, dict):
                raise CheckpointError(f"{self.path}: {CONFIG_MEMBER} is not a mapping")
        return self._config

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights with NeMo's key names, streamed from the archive (no temporary file)."""
        f = self._tar.extractfile(self._members[WEIGHTS_MEMBER])
        assert f is not None
        import torch

        # weights_only: a checkpoint is data, never code to run. mmap is impossible inside a
        # tar, but torch's zip reader seeks per tensor record, so memory holds each tensor once.
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile,
                tarfile.TarError, OSError) as e:  # torch: "PytorchStreamReader failed ...", a bad pickle
            # torch's weights-only refusal suggests weights_only=False: code from the file would
            # run. A checkpoint is data; a pickle that is not plain tensors is damaged or foreign.
            reason = ("the weights' index is damaged or holds more than tensors"
                      if isinstance(e, pickle.UnpicklingError) else
                      (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise CheckpointError(f"{self.path}: its weights cannot be read ({reason}); "
                                  f"the archive may be cut short: download or copy it again") from e


@contextmanager
def naming_checkpoint(path: str | os.PathLike) -> Iterator[None]:
    """Inside, a ValueError (a config key we do not support, weights that do not fit the config,
    a tokenizer that is not one) becomes a CheckpointError naming the checkpoint: the user may
    not know which file ran ($TRANSCRIBE_MODEL, the default model, a snapshot path). The one
    place loading errors get the file's name, so the validators stay free of paths."""
    from engines.choices import DeviceError  # the machine's, not the file's: passes as it is

    try:
        yield
    except (CheckpointError, DeviceError):
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def config_section(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """A top-level section of model_config.yaml; ValueError when it is missing or not a mapping
    (a KeyError or AttributeError deep in a config reader was a traceback)."""
    section = cfg.get(key)
    if not isinstance(section, dict):
        what = "is missing" if section is None else f"is a {type(section).__name__}, not a mapping"
        raise ValueError(f"{CONFIG_MEMBER}: section '{key}' {what}")
    return section


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """`module.load_state_dict(state, strict=True, assign=True)`, the names and shapes compared
    first: weights that do not fit the module the config built are one ValueError with the
    counts, the first name and the first shape that differ, not torch's RuntimeError listing
    every key (hundreds for a large model). `prefix`: the keys' prefix in the checkpoint."""
    want = module.state_dict()  # on the meta device: the names and shapes the config gives
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state if k not in want]
    reshaped = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or reshaped:
        parts = [f"{len(keys)} {what} (first: {prefix}.{keys[0]})"
                 for keys, what in ((missing, "missing"), (unexpected, "unexpected")) if keys]
        if reshaped:
            k = reshaped[0]
            parts.append(f"{len(reshaped)} of another shape (first: {prefix}.{k} is {list(state[k].shape)} "
                         f"in the weights, {list(want[k].shape)} by the config)")
        raise ValueError(f"the weights do not match {CONFIG_MEMBER}: {'; '.join(parts)}")
    module.load_state_dict(state, strict=True, assign=True)
    return module


def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix.` with the prefix removed (e.g. "encoder" -> encoder weights)."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in state.items() if k.startswith(p)}


def pop_sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Like `sub_state_dict`, but the entries leave `state`: the result is their only holder."""
    p = prefix + "."
    return {k[len(p):]: state.pop(k) for k in [k for k in state if k.startswith(p)]}


def resolve_checkpoint(model: str, *, offline: bool | None = None, timeout_s: float = 10.0) -> Path:
    """A local path for `model`: a path to a `.nemo` file, or a registry name.

    Registry names are fetched with `huggingface_hub` into its usual cache
    (`HF_HOME` / `HF_HUB_CACHE`), so a second run and an offline machine with a filled cache
    both start without network. `offline=None` follows `HF_HUB_OFFLINE`.
    """
    found = located(model)
    return found if isinstance(found, Path) else _hf_download(found, offline=offline, timeout_s=timeout_s)


def located(model: str) -> Path | RegistryEntry:
    """The local checkpoint file `model` names, or its registry entry (not fetched); a
    CheckpointError for a name or path that is neither. Reads no weights and touches no network:
    a command checks this before it spawns workers or creates its --out (a typo said in a
    fraction of a second)."""
    p = Path(model).expanduser()
    if local_exists(p) or p.suffix == ".nemo":
        if p.is_dir():  # a Hugging Face snapshot folder, an unpacked .nemo, or a Whisper folder without its weights
            return _nemo_in_folder(model, p)
        if not p.is_file():
            raise CheckpointError(f"{model}: no such checkpoint file")
        return p
    entry = REGISTRY.get(registry_name(model))
    if entry is None and ("/" in model or p.suffix.lower() in (".pt", ".pth", ".safetensors", ".bin")):
        raise CheckpointError(f"{model}: no such file or folder")  # a path, not a misspelt name
    if entry is None:
        names = sorted([*REGISTRY, "whisper-base"])  # whisper-base: bundled (engines.loader)
        guess = did_you_mean(model, names)
        raise CheckpointError(f"unknown model {model!r}{f' (did you mean {guess}?)' if guess else ''}: pass a "
                              f"checkpoint's path (.nemo; Whisper: .pt, .safetensors, a CTranslate2 or Hugging Face "
                              f"folder) or one of: {', '.join(names)} (`transcribe models` says where each comes from)")
    return entry


def did_you_mean(model: str, names: list[str]) -> str | None:
    """The registry name a user most likely meant: faster-whisper's and openai-whisper's own names
    (`base`, `large-v3`) are ours with `whisper-` before them; else the closest spelling."""
    import difflib

    lowered = model.lower()
    if f"whisper-{lowered}" in names:
        return f"whisper-{lowered}"
    close = difflib.get_close_matches(lowered, names, n=1, cutoff=0.75)
    return close[0] if close else None


def local_exists(p: Path) -> bool:
    """Whether `p` is there; CheckpointError when a folder on its way cannot be entered (Path.exists
    raises PermissionError there: a traceback)."""
    try:
        return p.exists()
    except PermissionError:
        raise CheckpointError(f"{p}: permission denied (a folder on its path cannot be entered)") from None


def registry_name(model: str) -> str:
    """The registry's name for a Hugging Face repo id (`nvidia/parakeet-tdt-0.6b-v2`, what NeMo
    and HF users type; any case, as the hub takes it), else `model` as it is."""
    for entry in REGISTRY.values():
        if model.lower() == entry.repo_id.lower():
            return entry.name
    return model


def _nemo_in_folder(model: str, folder: Path) -> Path:
    """The one `.nemo` a folder holds (a Hugging Face snapshot folder); CheckpointError naming
    what it found otherwise."""
    found = sorted(f for f in folder.glob("*.nemo") if f.is_file())
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(f"{model}: a folder holding {len(found)} .nemo files "
                              f"({', '.join(f.name for f in found)}): pass the one to run")
    raise CheckpointError(f"{model}: a folder holding no checkpoint (a Whisper folder holds model.bin "
                          "or model.safetensors; a Parakeet checkpoint is a .nemo file)")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value: never touch the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face endpoint answers an HTTP HEAD request (any status) within
    `timeout_s` a step (connect, TLS, response). An accepted TCP connection was taken for an
    answer: behind a firewall or a dead mirror that accepts and never replies, the download
    then spent huggingface_hub's five 10 s retries (399 s) failing, and a run without --model
    hung there instead of taking the bundled Whisper."""
    if hub_offline():
        return False
    request = urllib.request.Request(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return True  # an answer, if not a welcome one
    except (OSError, ValueError):  # URLError, timeouts, refused; ValueError: no usable URL
        return False
    return True


def _hf_download(entry: RegistryEntry, *, offline: bool | None, timeout_s: float) -> Path:
    # Imported here: resolving a local path must not pay for huggingface_hub's import.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if offline is None:
        offline = hub_offline()
    files = (entry.filename, *entry.extra_files)
    try:
        # Cache first: a filled cache must never wait on the network.
        path = [Path(hf_hub_download(entry.repo_id, f, local_files_only=True)) for f in files][0]
        _fetch_optional(entry, local_only=True, timeout_s=timeout_s)
        return path
    except LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(
                f"{entry.name}: not in the Hugging Face cache and offline mode is on "
                f"(download {entry.repo_id} ({', '.join(files)}) on a connected machine, or pass a local path)"
            ) from None
    except OSError as e:  # HF_HOME a file, say: the token and cache paths under it are not folders
        raise CheckpointError(f"{entry.name}: cannot read the Hugging Face cache ({_hub_settings()}): {e}") from None
    # Only now, on a cache miss, is the network needed: a quick probe first, so that a network
    # that drops packets fails in seconds instead of hanging the download.
    if not hub_reachable():
        raise CheckpointError(f"{entry.name}: not in the Hugging Face cache and the hub is unreachable "
                              f"(download {entry.repo_id} ({', '.join(files)}) on a connected machine into "
                              "the cache, HF_HOME, or pass a local path)")
    try:
        path = [Path(hf_hub_download(entry.repo_id, f, etag_timeout=timeout_s)) for f in files][0]
    except Exception as e:  # network errors come in many types (requests, httpx, OSError)
        raise CheckpointError(f"{entry.name}: download of {entry.repo_id} failed: {e}") from e
    _fetch_optional(entry, local_only=False, timeout_s=timeout_s)
    return path


def _hub_settings() -> str:
    """The environment that places huggingface_hub's cache and token, as set (or its default)."""
    named = [f"{k}={os.environ[k]}" for k in ("HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH") if os.environ.get(k)]
    return ", ".join(named) or "HF_HOME unset: ~/.cache/huggingface"


def _fetch_optional(entry: RegistryEntry, *, local_only: bool, timeout_s: float) -> None:
    """`entry.optional_files` into the snapshot folder, those it can get (`RegistryEntry`)."""
    from huggingface_hub import hf_hub_download

    for f in entry.optional_files:
        try:
            hf_hub_download(entry.repo_id, f, local_files_only=local_only, etag_timeout=timeout_s)
        except Exception:  # not in the repo, or not cached: the defaults serve  # noqa: BLE001
            pass
