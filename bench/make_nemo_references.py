#!/usr/bin/env python3
"""Build small random-weight NeMo ASR models for architectures the shared fixtures do not
cover, and record NeMo's own outputs on a few real recordings (golden references).

Runs INSIDE the NeMo virtualenv (see bench/README.md):

    /work/venvs/nemo/bin/python bench/make_nemo_references.py [--out tests/data/nemo_extra]
        [--base /work/shared/fixtures/nemo_reference/tdt_tiny/model.nemo] [--only NAME ...]
        [--check-fixture tdt_tiny]

For each variant it writes OUT/<name>/model.nemo, reference.json and reference.npz with the
schema of ../shared/fixtures/nemo_reference/<variant>/ (see the README there):

  reference.json  {variant, spec, seed, files: [{audio, samples, feature_frames,
                  encoder_frames, tokens, text, transcribe_text, words}]}
                  `audio` is relative to OUT (the folder that holds the variant folders,
                  as in the fixtures, where it is relative to nemo_reference/); with the
                  default OUT it is ../../../../shared/data/speech/librispeech_test_other/...
  reference.npz   features_i [n_mels, frames], encoder_i [d_model, frames], tokens_i,
                  token_frames_i, and ctc_logprobs_i [frames, vocab+1] for CTC models;
                  written with np.savez_compressed (np.load reads it the same way).

How every field is produced (CPU, fp32, eval mode, torch.inference_mode):
  features      model.preprocessor(input_signal=[1, samples], length=[samples]) on the file
                read with soundfile as float32 (int16 / 32768), batch of one, cropped to the
                returned length. Dither is off in eval mode; per-feature normalisation.
  encoder       model.encoder(audio_signal=features, length=feature_frames), batch of one.
  tokens, token_frames
                transducers: model.decoding.rnnt_decoder_predictions_tensor(encoder, lengths,
                return_hypotheses=True) on that batch-of-one encoder output: y_sequence and
                the hypothesis' `timestamp` (encoder frame of each token, as NeMo reports it).
                CTC: model.decoder(encoder_output=...) log-probs -> NeMo greedy CTC decoding
                (model.decoding.ctc_decoder_predictions_tensor); token_frames = the encoder
                frame where each collapsed token's run starts in the argmax path.
  text          model.tokenizer.ids_to_text(tokens)
  transcribe_text  model.transcribe(paths, batch_size=4) on a freshly restored model
  words         model.transcribe(paths, batch_size=4, timestamps=True) -> hyp.timestamp['word']
                as {word, start, end} in seconds.
The script checks that the batch-of-one tokens equal the tokens of NeMo's transcribe()
hypotheses and records any mismatch under "notes" in reference.json. `text` and
transcribe_text may differ where NeMo's transcribe() strips the space before punctuation
("ar '" vs "ar'"), as in the shared fixtures.

Weights: torch.manual_seed(seed) then NeMo's own initialisation, then every norm scale is
1 + 0.3 N(0,1), every norm shift 0.1 N(0,1), batch-norm running_mean 0.2 N(0,1) and
running_var 1 + 0.3 |N(0,1)|, attention pos biases 0.1 N(0,1) (NeMo initialises these to
exact ones/zeros, which would hide bugs), and the subsampling (pre_encode) convs and linear
are re-drawn U(+-2/sqrt(fan_in)) with biases U(+-0.1/sqrt(fan_in)), as in the shared
fixtures (NeMo's own subsampling init makes the encoder output nearly constant in time).
The transducer joints' blank logit gets no extra bias; the CTC head's blank bias is raised
by spec["blank_bias"] so that greedy CTC paths contain blanks and repeats.

--check-fixture VARIANT re-runs the same procedure on a shared fixture's model.nemo and
compares with its reference files (validates this script against the fixture generator).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile

import numpy as np

SHARED = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared"))
DEFAULT_BASE = os.path.join(SHARED, "fixtures", "nemo_reference", "tdt_tiny", "model.nemo")
DEFAULT_OUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "nemo_extra"))
SPEECH = os.path.join(SHARED, "data", "speech", "librispeech_test_other")
# three short test-other recordings (2.0 s, 2.8 s, 4.3 s); the second is also in the fixtures
FILES = [
    "3005/3005-163389-0007.flac",
    "1688/1688-142285-0002.flac",
    "1688/1688-142285-0005.flac",
]
SEED = 1234

# encoder / model variants; keys not given come from the base (tdt_tiny) config
VARIANTS = {
    "tdt_striding4": dict(
        kind="tdt", feats=80, d_model=48, n_layers=2, heads=2, sub="striding", sub_factor=4, sub_ch=16,
        conv_k=5, norm="batch_norm", xscaling=False, untie=False, use_bias=False, pred_hidden=32,
        joint_hidden=32,
    ),
    "tdt_dw16_128mel": dict(
        kind="tdt", feats=128, d_model=48, n_layers=2, heads=4, sub="dw_striding", sub_factor=16, sub_ch=16,
        conv_k=31, norm="layer_norm", xscaling=True, untie=True, use_bias=True, pred_hidden=32,
        joint_hidden=32,
    ),
    "ctc_dw8": dict(
        kind="ctc", feats=80, d_model=48, n_layers=2, heads=2, sub="dw_striding", sub_factor=8, sub_ch=16,
        conv_k=9, norm="batch_norm", xscaling=True, untie=True, use_bias=False, blank_bias=1.5,
    ),
}


def _quiet():
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)
    logging.getLogger("nemo_logger").setLevel(logging.ERROR)


def read_base(base_nemo: str, tokdir: str):
    """Base config (OmegaConf) of the .nemo and its tokenizer files copied to tokdir."""
    from omegaconf import OmegaConf

    with tarfile.open(base_nemo) as tar:
        cfg = OmegaConf.create(tar.extractfile("./model_config.yaml").read().decode())
        for m in tar.getmembers():
            name = os.path.basename(m.name)
            for want in ("tokenizer.model", "vocab.txt", "tokenizer.vocab"):
                if name.endswith("_" + want) or name == want:
                    with open(os.path.join(tokdir, want), "wb") as f:
                        f.write(tar.extractfile(m).read())
    return cfg


def make_config(base, spec: dict, tokdir: str):
    from omegaconf import OmegaConf, open_dict

    cfg = copy.deepcopy(base)
    d = spec["d_model"]
    with open_dict(cfg):
        cfg.tokenizer = OmegaConf.create({"dir": tokdir, "type": "bpe"})
        cfg.preprocessor.features = spec["feats"]
        enc = cfg.encoder
        enc.feat_in = spec["feats"]
        enc.n_layers = spec["n_layers"]
        enc.d_model = d
        enc.n_heads = spec["heads"]
        enc.subsampling = spec["sub"]
        enc.subsampling_factor = spec["sub_factor"]
        enc.subsampling_conv_channels = spec["sub_ch"]
        enc.conv_kernel_size = spec["conv_k"]
        enc.conv_norm_type = spec["norm"]
        enc.xscaling = spec["xscaling"]
        enc.untie_biases = spec["untie"]
        enc.use_bias = spec["use_bias"]
        cfg.validation_ds = None  # set after construction: a dataset config here makes NeMo build loaders
        if spec["kind"] == "ctc":
            for k in ("joint", "loss", "model_defaults", "labels"):
                cfg.pop(k, None)
            cfg.decoder = OmegaConf.create({
                "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
                "feat_in": d, "num_classes": -1, "vocabulary": [],
            })
            cfg.decoding = OmegaConf.create({"strategy": "greedy_batch"})
            cfg.target = "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE"
        else:
            ph, jh = spec["pred_hidden"], spec["joint_hidden"]
            cfg.model_defaults.enc_hidden = d
            cfg.model_defaults.pred_hidden = ph
            cfg.model_defaults.joint_hidden = jh
            cfg.decoder.prednet.pred_hidden = ph
            cfg.joint.jointnet.encoder_hidden = d
            cfg.joint.jointnet.pred_hidden = ph
            cfg.joint.jointnet.joint_hidden = jh
    return cfg


def perturb(model, seed: int) -> None:
    """Give norms, batch-norm statistics and pos biases non-trivial values (see module doc)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    norm_types = (torch.nn.LayerNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.GroupNorm)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, norm_types):
                if getattr(mod, "weight", None) is not None:
                    mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape, generator=g))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=g))
                if isinstance(mod, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)) and mod.running_mean is not None:
                    mod.running_mean.copy_(0.2 * torch.randn(mod.running_mean.shape, generator=g))
                    mod.running_var.copy_(1 + 0.3 * torch.randn(mod.running_var.shape, generator=g).abs())
        for name, p in model.named_parameters():
            if name.endswith("pos_bias_u") or name.endswith("pos_bias_v"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        # NeMo's subsampling init plus ReLUs leaves the pre-encoder output almost constant in
        # time (its biases dominate), so that a CTC head emits one token per file. Like the
        # shared fixtures: weights U(+-2/sqrt(fan_in)), biases a tenth of PyTorch's default.
        for mod in model.encoder.pre_encode.modules():
            if isinstance(mod, (torch.nn.Conv2d, torch.nn.Conv1d, torch.nn.Linear)):
                fan_in = mod.weight[0].numel()
                mod.weight.copy_((torch.rand(mod.weight.shape, generator=g) * 2 - 1) * 2 / fan_in ** 0.5)
                if mod.bias is not None:
                    mod.bias.copy_((torch.rand(mod.bias.shape, generator=g) * 2 - 1) * 0.1 / fan_in ** 0.5)


def build_model(name: str, spec: dict, base_cfg, tokdir: str, seed: int):
    import torch
    from nemo.collections.asr.models import EncDecCTCModelBPE, EncDecRNNTBPEModel
    from omegaconf import open_dict

    cfg = make_config(base_cfg, spec, tokdir)
    torch.manual_seed(seed)
    cls = EncDecCTCModelBPE if spec["kind"] == "ctc" else EncDecRNNTBPEModel
    model = cls(cfg=cfg)
    perturb(model, seed)
    if spec.get("blank_bias"):  # CTC: raise the blank logit so that blanks separate tokens
        import torch

        with torch.no_grad():
            model.decoder.decoder_layers[0].bias[-1] += spec["blank_bias"]
    with open_dict(model.cfg):
        model.cfg.validation_ds = {"use_start_end_token": False}
    return model.to(torch.float32).eval()


def read_audio(path: str):
    import soundfile as sf

    x, sr = sf.read(path, dtype="float32")
    assert sr == 16000 and x.ndim == 1, (path, sr, x.shape)
    return x


def _as_list(x):
    if x is None:
        return []
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def _ctc_collapse(logp):
    """Greedy CTC on [T, V+1] log-probs (blank last): (tokens, frame where each token's run starts)."""
    return _ctc_collapse_path(logp.argmax(-1).tolist(), logp.shape[-1] - 1)


def _ctc_collapse_path(path, blank):
    tokens, frames, prev = [], [], blank
    for t, k in enumerate(path):
        if k != blank and k != prev:
            tokens.append(k)
            frames.append(t)
        prev = k
    return tokens, frames


def _token_frames(hyp) -> list:
    ts = hyp.timestamp
    if isinstance(ts, dict):
        ts = ts.get("timestep", [])
    return _as_list(ts)


def _words(hyp) -> list:
    ts = hyp.timestamp if isinstance(hyp.timestamp, dict) else {}
    return [{"word": w["word"], "start": float(w["start"]), "end": float(w["end"])} for w in ts.get("word", [])]


def reference_outputs(nemo_path: str, paths: list, is_ctc: bool):
    """Run the recipe of the module doc on a saved .nemo; (files list, arrays dict, notes)."""
    import torch
    from nemo.collections.asr.models import ASRModel
    from omegaconf import open_dict

    def restore():
        m = ASRModel.restore_from(nemo_path, map_location=torch.device("cpu"))
        m = m.to(torch.float32).eval()
        with open_dict(m.cfg):
            if m.cfg.get("validation_ds") is None:
                m.cfg.validation_ds = {"use_start_end_token": False}
        return m

    m = restore()
    files, arrays, notes = [], {}, []
    with torch.inference_mode():
        for i, p in enumerate(paths):
            x = read_audio(p)
            sig = torch.from_numpy(x)[None]
            n = torch.tensor([x.shape[0]])
            feats, flen = m.preprocessor(input_signal=sig, length=n)
            enc, elen = m.encoder(audio_signal=feats, length=flen)
            F, T = int(flen[0]), int(elen[0])
            arrays[f"features_{i}"] = feats[0, :, :F].float().numpy()
            arrays[f"encoder_{i}"] = enc[0, :, :T].float().numpy()
            if is_ctc:
                logp = m.decoder(encoder_output=enc)
                hyp = m.decoding.ctc_decoder_predictions_tensor(logp, decoder_lengths=elen, return_hypotheses=True)[0]
                tokens, frames = _ctc_collapse(logp[0, :T])
                # NeMo's greedy CTC hypothesis keeps the per-frame argmax path in y_sequence
                if _ctc_collapse_path(_as_list(hyp.y_sequence)[:T], logp.shape[-1] - 1)[0] != tokens:
                    notes.append(f"file {i}: NeMo greedy CTC path differs from the argmax path")
                arrays[f"ctc_logprobs_{i}"] = logp[0, :T].float().numpy()
                token_frames = frames
            else:
                hyp = m.decoding.rnnt_decoder_predictions_tensor(
                    encoder_output=enc, encoded_lengths=elen, return_hypotheses=True
                )[0]
                tokens = _as_list(hyp.y_sequence)
                token_frames = _token_frames(hyp)
                if len(token_frames) != len(tokens):
                    notes.append(f"file {i}: {len(token_frames)} token frames for {len(tokens)} tokens")
            arrays[f"tokens_{i}"] = np.asarray(tokens, dtype=np.int64)
            arrays[f"token_frames_{i}"] = np.asarray(token_frames, dtype=np.int64)
            files.append({
                "audio": p,
                "samples": int(x.shape[0]),
                "feature_frames": F,
                "encoder_frames": T,
                "tokens": tokens,
                "text": m.tokenizer.ids_to_text(tokens),
            })

    # transcribe() on a fresh model (timestamps=True changes the decoding config for good)
    m = restore()
    plain = m.transcribe(paths, batch_size=4, verbose=False)
    plain = plain[0] if isinstance(plain, tuple) else plain
    m = restore()
    hyps = m.transcribe(paths, batch_size=4, verbose=False, timestamps=True, return_hypotheses=True)
    hyps = hyps[0] if isinstance(hyps, tuple) else hyps
    for i, (f, tr, h) in enumerate(zip(files, plain, hyps)):
        f["transcribe_text"] = tr if isinstance(tr, str) else tr.text
        f["words"] = _words(h)
        if is_ctc:
            ys = h.y_sequence
            if getattr(ys, "ndim", 1) == 2:  # transcribe() hypotheses carry the log-probs
                got = _ctc_collapse(ys[: f["encoder_frames"]])[0]
            else:
                got = _ctc_collapse_path(_as_list(ys)[: f["encoder_frames"]], 128)[0]
            if got != f["tokens"]:
                notes.append(f"file {i}: transcribe() tokens differ from the batch-of-one decode")
        elif _as_list(h.y_sequence) != f["tokens"]:
            notes.append(f"file {i}: transcribe() tokens differ from the batch-of-one decode")
    return files, arrays, notes


def write_variant(out_dir: str, name: str, spec: dict, base_cfg, tokdir: str, seed: int) -> dict:
    vdir = os.path.join(out_dir, name)
    os.makedirs(vdir, exist_ok=True)
    model = build_model(name, spec, base_cfg, tokdir, seed)
    nemo_path = os.path.join(vdir, "model.nemo")
    model.save_to(nemo_path)
    del model
    paths = [os.path.join(SPEECH, f) for f in FILES]
    files, arrays, notes = reference_outputs(nemo_path, paths, spec["kind"] == "ctc")
    for f in files:
        f["audio"] = os.path.relpath(f["audio"], out_dir)
    keep = {k: v for k, v in spec.items() if k not in ("pred_hidden", "joint_hidden")}
    keep["vocab"] = 128
    if spec["kind"] != "ctc":
        keep["durations"] = list(base_cfg.model_defaults.tdt_durations)
        keep["pred_hidden"], keep["joint_hidden"] = spec["pred_hidden"], spec["joint_hidden"]
    meta = {"variant": name, "spec": keep, "seed": seed, "nemo_version": _nemo_version(), "files": files}
    if notes:
        meta["notes"] = notes
    with open(os.path.join(vdir, "reference.json"), "w") as fp:
        json.dump(meta, fp, indent=1)
        fp.write("\n")
    np.savez_compressed(os.path.join(vdir, "reference.npz"), **arrays)
    size = sum(os.path.getsize(os.path.join(vdir, n)) for n in os.listdir(vdir))
    print(f"{name}: {size / 1e6:.2f} MB, files {[(f['encoder_frames'], len(f['tokens'])) for f in files]}"
          + (f"\n  notes: {notes}" if notes else ""))
    return meta


def _nemo_version() -> str:
    import nemo

    return nemo.__version__


def check_fixture(variant: str) -> int:
    """Re-run the recipe on a shared fixture and compare with its stored outputs."""
    d = os.path.join(SHARED, "fixtures", "nemo_reference", variant)
    ref = json.load(open(os.path.join(d, "reference.json")))
    z = np.load(os.path.join(d, "reference.npz"))
    paths = [os.path.normpath(os.path.join(os.path.dirname(d), f["audio"])) for f in ref["files"]]
    is_ctc = False
    files, arrays, notes = reference_outputs(os.path.join(d, "model.nemo"), paths, is_ctc)
    bad = 0
    for i, (a, b) in enumerate(zip(files, ref["files"])):
        for k in ("samples", "feature_frames", "encoder_frames", "tokens", "text", "transcribe_text", "words"):
            if a[k] != b[k]:
                bad += 1
                print(f"file {i} {k}: ours {str(a[k])[:120]} fixture {str(b[k])[:120]}")
        for k in ("features", "encoder", "tokens", "token_frames"):
            x, y = arrays[f"{k}_{i}"], z[f"{k}_{i}"]
            if x.shape != y.shape or np.abs(x.astype(np.float64) - y).max() > 1e-4:
                bad += 1
                print(f"file {i} {k}: shapes {x.shape} {y.shape} max diff "
                      f"{np.abs(x.astype(np.float64) - y).max() if x.shape == y.shape else 'n/a'}")
    print(f"check {variant}: {'OK' if not bad else f'{bad} mismatches'}; notes {notes}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--base", default=DEFAULT_BASE, help="a .nemo whose config and tokenizer are the base")
    ap.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-fixture", default=None, metavar="VARIANT")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    _quiet()
    if a.check_fixture:
        return check_fixture(a.check_fixture)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    tokdir = tempfile.mkdtemp(prefix="nemo-extra-tok-")
    try:
        base_cfg = read_base(a.base, tokdir)
        for name in a.only or list(VARIANTS):
            write_variant(out, name, VARIANTS[name], base_cfg, tokdir, a.seed)
    finally:
        shutil.rmtree(tokdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
