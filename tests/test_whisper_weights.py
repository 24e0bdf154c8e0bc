"""Whisper loaders: one tiny random Whisper written as CTranslate2 model.bin, OpenAI .pt and
HF safetensors must load to identical tensors and identical model outputs; the KV cache must
reproduce a full causal forward; the bundled base model must stream from its two halves."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from engines.whisper import WhisperDims, build_whisper, sinusoids
from engines.whisper_weights import (WhisperWeightsError, bundled_base_dir, load_any, load_ct2,
                                     load_hf, load_openai)

DIMS = WhisperDims(n_mels=80, n_vocab=96, n_audio_ctx=24, n_audio_state=128, n_audio_head=2,
                   n_audio_layer=2, n_text_ctx=16, n_text_state=128, n_text_head=2, n_text_layer=2)


def openai_state(d: WhisperDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under OpenAI names, fp16 like the released checkpoints."""
    g = torch.Generator().manual_seed(seed)
    s, sd = d.n_audio_state, {}

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).half()

    def lin(name, o, i, bias=True):
        sd[f"{name}.weight"] = r(o, i)
        if bias:
            sd[f"{name}.bias"] = r(o)

    sd["encoder.conv1.weight"], sd["encoder.conv1.bias"] = r(s, d.n_mels, 3), r(s)
    sd["encoder.conv2.weight"], sd["encoder.conv2.bias"] = r(s, s, 3), r(s)
    sd["encoder.positional_embedding"] = sinusoids(d.n_audio_ctx, s).half()
    sd["decoder.token_embedding.weight"] = r(d.n_vocab, s)
    sd["decoder.positional_embedding"] = r(d.n_text_ctx, s)
    for part, n, attns in (("encoder", d.n_audio_layer, ["attn"]), ("decoder", d.n_text_layer, ["attn", "cross_attn"])):
        for i in range(n):
            p = f"{part}.blocks.{i}"
            for a in attns:
                for proj in ("query", "key", "value", "out"):
                    lin(f"{p}.{a}.{proj}", s, s, bias=proj != "key")
                sd[f"{p}.{a}_ln.weight"], sd[f"{p}.{a}_ln.bias"] = 1 + r(s), r(s)
            lin(f"{p}.mlp.0", 4 * s, s)
            lin(f"{p}.mlp.2", s, 4 * s)
            sd[f"{p}.mlp_ln.weight"], sd[f"{p}.mlp_ln.bias"] = 1 + r(s), r(s)
    for ln in ("encoder.ln_post", "decoder.ln"):
        sd[f"{ln}.weight"], sd[f"{ln}.bias"] = 1 + r(s), r(s)
    return sd


def hf_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenAI names -> transformers' WhisperForConditionalGeneration names (no k bias)."""
    names = {"attn.query": "self_attn.q_proj", "attn.key": "self_attn.k_proj", "attn.value": "self_attn.v_proj",
             "attn.out": "self_attn.out_proj", "attn_ln": "self_attn_layer_norm",
             "cross_attn.query": "encoder_attn.q_proj", "cross_attn.key": "encoder_attn.k_proj",
             "cross_attn.value": "encoder_attn.v_proj", "cross_attn.out": "encoder_attn.out_proj",
             "cross_attn_ln": "encoder_attn_layer_norm", "mlp.0": "fc1", "mlp.2": "fc2", "mlp_ln": "final_layer_norm"}
    top = {"encoder.ln_post": "encoder.layer_norm", "decoder.ln": "decoder.layer_norm",
           "decoder.token_embedding": "decoder.embed_tokens", "encoder.conv1": "encoder.conv1",
           "encoder.conv2": "encoder.conv2"}
    out = {}
    for k, t in sd.items():
        mod, leaf = k.rsplit(".", 1)
        if ".blocks." in k:
            part, _, i, rest = mod.split(".", 3)
            out[f"model.{part}.layers.{i}.{names[rest]}.{leaf}"] = t
        elif mod in top:
            out[f"model.{top[mod]}.{leaf}"] = t
    out["model.encoder.embed_positions.weight"] = sd["encoder.positional_embedding"]
    out["model.decoder.embed_positions.weight"] = sd["decoder.positional_embedding"]
    out["proj_out.weight"] = sd["decoder.token_embedding.weight"].clone()  # tied, stored twice
    return out


def write_ct2(path, d: WhisperDims, sd: dict[str, torch.Tensor]) -> None:
    """A CTranslate2 v6 WhisperSpec model.bin, laid out like the converter writes it."""
    var: dict[str, np.ndarray] = {"decoder/num_heads": np.array(d.n_text_head, np.int16),
                                  "encoder/num_heads": np.array(d.n_audio_head, np.int16)}
    z = lambda n: torch.zeros(n, dtype=torch.float16)  # noqa: E731  (k has no bias)
    s = d.n_audio_state
    for part, n in (("encoder", d.n_audio_layer), ("decoder", d.n_text_layer)):
        for i in range(n):
            p, c = f"{part}.blocks.{i}", f"{part}/layer_{i}"
            a = sd
            var[f"{c}/self_attention/linear_0/weight"] = torch.cat([a[f"{p}.attn.query.weight"], a[f"{p}.attn.key.weight"], a[f"{p}.attn.value.weight"]])
            var[f"{c}/self_attention/linear_0/bias"] = torch.cat([a[f"{p}.attn.query.bias"], z(s), a[f"{p}.attn.value.bias"]])
            pairs = {"self_attention/linear_1": "attn.out", "self_attention/layer_norm": "attn_ln",
                     "ffn/linear_0": "mlp.0", "ffn/linear_1": "mlp.2", "ffn/layer_norm": "mlp_ln"}
            if part == "decoder":
                pairs |= {"attention/linear_0": "cross_attn.query", "attention/linear_2": "cross_attn.out",
                          "attention/layer_norm": "cross_attn_ln"}
                var[f"{c}/attention/linear_1/weight"] = torch.cat([a[f"{p}.cross_attn.key.weight"], a[f"{p}.cross_attn.value.weight"]])
                var[f"{c}/attention/linear_1/bias"] = torch.cat([z(s), a[f"{p}.cross_attn.value.bias"]])
            for ct, oa in pairs.items():
                ln = ct.endswith("layer_norm")
                var[f"{c}/{ct}/{'gamma' if ln else 'weight'}"] = a[f"{p}.{oa}.weight"]
                var[f"{c}/{ct}/{'beta' if ln else 'bias'}"] = a[f"{p}.{oa}.bias"]
    for ct, oa in (("encoder/conv1", "encoder.conv1"), ("encoder/conv2", "encoder.conv2")):
        var[f"{ct}/weight"], var[f"{ct}/bias"] = sd[f"{oa}.weight"], sd[f"{oa}.bias"]
    for ct, oa in (("encoder/layer_norm", "encoder.ln_post"), ("decoder/layer_norm", "decoder.ln")):
        var[f"{ct}/gamma"], var[f"{ct}/beta"] = sd[f"{oa}.weight"], sd[f"{oa}.bias"]
    var["decoder/embeddings/weight"] = sd["decoder.token_embedding.weight"]
    var["encoder/position_encodings/encodings"] = sd["encoder.positional_embedding"]
    var["decoder/position_encodings/encodings"] = sd["decoder.positional_embedding"]
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}

    def string(f, x):
        f.write(struct.pack("<H", len(x) + 1) + x.encode() + b"\0")

    with open(path, "wb") as f:
        f.write(struct.pack("<I", 6))
        string(f, "WhisperSpec")
        f.write(struct.pack("<II", 3, len(var)))
        for name in sorted(var):
            arr = var[name].numpy() if isinstance(var[name], torch.Tensor) else var[name]
            string(f, name)
            f.write(struct.pack("<B", arr.ndim) + struct.pack(f"<{arr.ndim}I", *arr.shape))
            f.write(struct.pack("<BI", ids[arr.dtype], arr.nbytes) + arr.tobytes())
        f.write(struct.pack("<I", 1))
        string(f, "decoder/projection/weight")
        string(f, "decoder/embeddings/weight")


def write_safetensors(path, sd: dict[str, torch.Tensor]) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:  # same format by hand: u64 header size, JSON header, raw data
        header, blobs, off = {}, [], 0
        for k, t in sd.items():
            b = t.contiguous().numpy().tobytes()
            header[k] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)
        h = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
        return
    save_file({k: t.contiguous() for k, t in sd.items()}, str(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_whisper")
    sd = openai_state(DIMS)
    torch.save({"dims": vars(DIMS), "model_state_dict": sd}, tmp / "tiny.pt")
    write_ct2(tmp / "model.bin", DIMS, sd)
    hf = tmp / "hf"
    hf.mkdir()
    write_safetensors(hf / "model.safetensors", hf_state(sd))
    (hf / "config.json").write_text(json.dumps({"encoder_attention_heads": 2, "decoder_attention_heads": 2}))
    return tmp


def test_three_formats_load_identically(checkpoints):
    loaded = [load_ct2(checkpoints / "model.bin"), load_openai(checkpoints / "tiny.pt"), load_hf(checkpoints / "hf")]
    for dims, state in loaded:
        assert dims == DIMS
        assert state.keys() == loaded[0][1].keys()
        for k, t in state.items():
            assert torch.equal(t, loaded[0][1][k]), k
    mel = torch.randn(2, DIMS.n_mels, 2 * DIMS.n_audio_ctx, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[1, 5, 7, 9], [2, 3, 4, 8]])
    outs = []
    with torch.inference_mode():
        for dims, state in loaded:
            model = build_whisper(dims, state)
            audio = model.encoder(mel)
            cache = model.decoder.new_cache(audio, DIMS.n_text_ctx)
            outs.append((audio, model.decoder(tokens, cache)))
    for audio, logits in outs[1:]:
        assert torch.equal(audio, outs[0][0]) and torch.equal(logits, outs[0][1])
    assert torch.isfinite(outs[0][1]).all()


def test_kv_cache_steps_match_full_forward_and_compaction(checkpoints):
    model = build_whisper(*load_any(checkpoints / "tiny.pt"))
    mel = torch.randn(3, DIMS.n_mels, 2 * DIMS.n_audio_ctx, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, DIMS.n_vocab, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        audio = model.encoder(mel)
        full = model.decoder(tokens, model.decoder.new_cache(audio, 12))
        cache = model.decoder.new_cache(audio, 12)
        steps = [model.decoder(tokens[:, :3], cache)]
        steps.append(model.decoder(tokens[:, 3:5], cache))  # two at once, after a cached prefix
        steps.append(model.decoder(tokens[:, 5:6], cache))
        cross = cache.cross_k.clone()
        cache.keep([0, 2, 1], 2)  # row 1 finished: rows 0 and 2 continue as 0 and 1
        assert torch.equal(cache.cross_k, cross[:, [0, 2, 1]])  # its audio is kept, behind them
        for t in range(6, 9):
            steps.append(model.decoder(tokens[[0, 2], t:t + 1], cache))
    torch.testing.assert_close(torch.cat(steps[:3], 1), full[:, :6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps[3:], 1), full[[0, 2], 6:], rtol=1e-4, atol=1e-4)


def test_ct2_split_anywhere_streams_like_one_file(checkpoints, tmp_path):
    data = (checkpoints / "model.bin").read_bytes()
    cut = len(data) // 2 + 3  # lands inside a tensor's bytes
    (tmp_path / "a").write_bytes(data[:cut])
    (tmp_path / "b").write_bytes(data[cut:])
    whole, parts = load_ct2(checkpoints / "model.bin"), load_ct2([tmp_path / "a", tmp_path / "b"])
    assert whole[0] == parts[0]
    assert all(torch.equal(whole[1][k], parts[1][k]) for k in whole[1])
    (tmp_path / "short").write_bytes(data[:cut])
    with pytest.raises(WhisperWeightsError, match="truncated"):
        load_ct2(tmp_path / "short")


def test_ct2_rejects_other_specs(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(struct.pack("<I", 6) + struct.pack("<H", 16) + b"TransformerSpec\0" + struct.pack("<II", 1, 0))
    with pytest.raises(WhisperWeightsError, match="WhisperSpec"):
        load_ct2(p)
    with pytest.raises(WhisperWeightsError, match="format"):
        load_any(tmp_path / "weights.onnx")


def test_bundled_base_streams_from_both_packages():
    try:
        parts, data = bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    assert [p.name for p in parts] == ["model.bin.part1", "model.bin.part2"]
    assert (data / "tokenizer.json").is_file()
    dims, state = load_ct2(parts)
    assert dims == WhisperDims()  # whisper base: 6+6 layers, 512 wide, 8 heads, 80 mels
    assert sum(t.numel() for k, t in state.items() if not k.endswith(".pos")) > 71_000_000
    torch.testing.assert_close(state["encoder.pos"].float(), sinusoids(1500, 512), atol=1e-3, rtol=0)


def test_a_damaged_checkpoint_file_is_a_clear_error_naming_it(tmp_path):
    """A cut-short or foreign .pt (torch's RuntimeError), a .safetensors with a garbage header
    length (MemoryError) or cut short (numpy's "cannot reshape", naming no file) were
    tracebacks or riddles; each is a WhisperWeightsError naming the file."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 64 * 64 * 4]}}).encode()
    files = {"garbage.pt": b"garbage\n", "empty.pt": b"", "garbage.safetensors": b"garbage\n",
             "cut.safetensors": struct.pack("<Q", len(header)) + header + bytes(1000)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(WhisperWeightsError, match=rf"{name}: not a readable Whisper checkpoint"):
            load_any(tmp_path / name)
