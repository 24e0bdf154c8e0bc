"""Greedy TDT / RNN-T / CTC decoding from NeMo's encoder outputs vs NeMo's own results."""
from __future__ import annotations

import copy
import dataclasses
import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch

from conftest import NEMO_REF, Reference, needs_shared
from engines.checkpoint import NemoArchive
from engines.ctc import CTCDecoder, ctc_config_from_nemo
from engines.transducer import TransducerConfig, TransducerDecoder


@lru_cache(maxsize=None)
def decoder_for(variant: str) -> TransducerDecoder:
    return TransducerDecoder.from_archive(NemoArchive(NEMO_REF / variant / "model.nemo"))


def encoder(ref: Reference, i: int) -> torch.Tensor:
    return torch.from_numpy(ref.array("encoder", i))


def decode_one(dec: TransducerDecoder, enc: torch.Tensor):
    return dec.decode(enc[None], torch.tensor([enc.shape[1]]))[0]


def padded_batch(ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    encs = [encoder(ref, i) for i in range(len(ref.files))]
    batch = torch.zeros(len(encs), encs[0].shape[0], max(e.shape[1] for e in encs))
    for i, e in enumerate(encs):
        batch[i, :, : e.shape[1]] = e
    return batch, torch.tensor([e.shape[1] for e in encs])


def test_tokens_and_frames_match_nemo(reference: Reference):
    dec = decoder_for(reference.dir.name)
    for i, f in enumerate(reference.files):
        hyp = decode_one(dec, encoder(reference, i))
        assert hyp.tokens == f["tokens"], f"file {i}"
        assert hyp.tokens == reference.array("tokens", i).tolist(), f"file {i}"
        assert hyp.frames == reference.array("token_frames", i).tolist(), f"file {i}"
        if dec.config.is_tdt:
            assert len(hyp.durations) == len(hyp.tokens)
            assert set(hyp.durations) <= set(dec.config.durations)
        else:
            assert hyp.durations == []


def test_padded_batch_equals_one_by_one(reference: Reference):
    dec = decoder_for(reference.dir.name)
    batch, lengths = padded_batch(reference)
    one_by_one = [decode_one(dec, encoder(reference, i)) for i in range(len(reference.files))]
    assert dec.decode(batch, lengths) == one_by_one
    # reversed order and extra padding must not change anything either
    wide = torch.nn.functional.pad(batch.flip(0), (0, 7), value=3.0)
    assert dec.decode(wide, lengths.flip(0)) == one_by_one[::-1]


@needs_shared
def test_empty_and_zero_length_items():
    dec = decoder_for("tdt_tiny")
    enc = torch.randn(2, dec.config.enc_hidden, 5)
    hyps = dec.decode(enc, torch.tensor([0, 5]))
    assert hyps[0].tokens == [] and hyps[0].frames == []
    assert hyps[1] == dec.decode(enc[1:], torch.tensor([5]))[0]


@needs_shared
def test_rnnt_max_symbols_cap_and_unk():
    ref = Reference("rnnt_tiny")
    dec = decoder_for("rnnt_tiny")
    cap = dec.config.max_symbols
    hit_cap = False
    for i in range(len(ref.files)):
        hyp = decode_one(dec, encoder(ref, i))
        per_frame = [len(list(g)) for _, g in itertools.groupby(hyp.frames)]
        assert max(per_frame) <= cap
        hit_cap |= cap in per_frame
        assert hyp.frames == sorted(hyp.frames)
    assert hit_cap
    assert 0 in decode_one(dec, encoder(ref, 0)).tokens  # <unk> is emitted, as NeMo does


def _reference_greedy(dec: TransducerDecoder, enc: torch.Tensor) -> list[tuple[int, int]]:
    """Plain frame-by-frame greedy TDT/RNN-T (NeMo's GreedyTDTInfer logic), one utterance."""
    cfg, joint, pred = dec.config, dec.joint, dec.prediction
    f = joint.enc(enc.T)  # [T, J]
    state = (torch.zeros(cfg.pred_rnn_layers, 1, cfg.pred_hidden),) * 2
    out, state = pred.step(torch.tensor([cfg.blank_id]), state)
    g = joint.pred(out)
    k = len(cfg.durations)
    t, per_frame, last_t, result = 0, 0, -1, []
    while t < f.shape[0]:
        logits = joint.logits(f[t : t + 1], g)[0]
        label = int(logits[:-k].argmax()) if k else int(logits.argmax())
        dur = cfg.durations[int(logits[-k:].argmax())] if k else 0
        if label == cfg.blank_id:
            t += max(dur, 1)
            continue
        per_frame = per_frame + 1 if t == last_t else 1
        last_t = t
        result.append((label, t))
        out, state = pred.step(torch.tensor([label]), state)
        g = joint.pred(out)
        t += dur
        if per_frame >= cfg.max_symbols and t == last_t:
            t += 1
    return result


@needs_shared
@pytest.mark.parametrize("durations", [(0, 1, 2, 3, 4), (0, 2, 4, 6, 8), (1, 3, 0, 2, 5)])
def test_any_durations_list_matches_simple_loop(durations):
    base = decoder_for("tdt_ctc_tiny")
    cfg = dataclasses.replace(base.config, durations=durations)
    dec = TransducerDecoder(cfg, base.prediction, base.joint)
    ref = Reference("tdt_ctc_tiny")
    batch, lengths = padded_batch(ref)
    with torch.inference_mode():
        for i, hyp in enumerate(dec.decode(batch, lengths)):
            expected = _reference_greedy(dec, encoder(ref, i))
            assert list(zip(hyp.tokens, hyp.frames)) == expected, f"file {i}"


@needs_shared
def test_ctc_head_log_probs_and_greedy():
    ref = Reference("tdt_ctc_tiny")
    dec = decoder_for("tdt_ctc_tiny")
    batch, lengths = padded_batch(ref)
    log_probs = dec.ctc_log_probs(batch)
    hyps = dec.decode_ctc(batch, lengths)
    blank = dec.config.blank_id
    for i in range(len(ref.files)):
        expected_lp = ref.array("ctc_logprobs", i)
        got = log_probs[i, : lengths[i]].numpy()
        assert np.abs(got - expected_lp).max() < 1e-3
        best = expected_lp.argmax(axis=-1).tolist()
        runs = [(k, len(list(g))) for k, g in itertools.groupby(best)]
        starts = np.cumsum([0] + [n for _, n in runs[:-1]])
        kept = [(k, int(s), n) for (k, n), s in zip(runs, starts) if k != blank]
        assert list(zip(hyps[i].tokens, hyps[i].frames, hyps[i].durations)) == kept
        assert hyps[i].tokens, "random weights still emit CTC tokens"


class _FakeArchive:
    def __init__(self, config, state):
        self.config, self._state = config, state

    def state_dict(self):
        return self._state


@needs_shared
def test_pure_ctc_checkpoint_layout():
    """EncDecCTCModelBPE keeps its head at `decoder.decoder_layers.0`: same results."""
    archive = NemoArchive(NEMO_REF / "tdt_ctc_tiny" / "model.nemo")
    cfg = {k: v for k, v in archive.config.items() if k not in ("aux_ctc", "joint", "decoding")}
    cfg["decoder"] = copy.deepcopy(archive.config["aux_ctc"]["decoder"])
    cfg["target"] = "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE"
    state = {"decoder." + k[len("ctc_decoder."):]: v for k, v in archive.state_dict().items()
             if k.startswith("ctc_decoder.")}
    ctc = CTCDecoder.from_archive(_FakeArchive(cfg, state))
    assert ctc.config.state_prefix == "decoder" and ctc.config.blank_id == 128
    batch, lengths = padded_batch(Reference("tdt_ctc_tiny"))
    assert ctc.decode(batch, lengths) == decoder_for("tdt_ctc_tiny").decode_ctc(batch, lengths)
    with pytest.raises(ValueError, match="target"):
        TransducerConfig.from_nemo(cfg)


@needs_shared
def test_decode_ctc_without_head_and_bad_shapes():
    dec = decoder_for("tdt_tiny")
    enc = torch.zeros(1, dec.config.enc_hidden, 4)
    with pytest.raises(ValueError, match="no CTC head"):
        dec.decode_ctc(enc, torch.tensor([4]))
    with pytest.raises(ValueError, match=r"encoder_out must be"):
        dec.decode(torch.zeros(1, dec.config.enc_hidden + 1, 4), torch.tensor([4]))


def _config(variant: str) -> dict:
    return copy.deepcopy(NemoArchive(NEMO_REF / variant / "model.nemo").config)


@needs_shared
@pytest.mark.parametrize("key,path,value", [
    ("decoding.strategy", ("decoding", "strategy"), "beam"),
    ("decoding.greedy.max_symbols", ("decoding", "greedy", "max_symbols"), None),
    ("decoder.normalization_mode", ("decoder", "normalization_mode"), "layer"),
    ("decoder.blank_as_pad", ("decoder", "blank_as_pad"), False),
    ("joint.jointnet.activation", ("joint", "jointnet", "activation"), "gelu"),
    ("loss.tdt_kwargs.durations", ("loss", "tdt_kwargs", "durations"), [0, -1, 2]),  # a TDT loss's (NeMo's)
    ("decoding.big_blank_durations", ("decoding", "big_blank_durations"), [2, 4]),
    ("joint.num_classes", ("joint", "num_classes"), 127),
    ("target", ("target",), "nemo.collections.asr.models.EncDecMultiTaskModel"),
    ("decoder._target_", ("decoder", "_target_"), "nemo.collections.asr.modules.StatelessTransducerDecoder"),
    ("decoder._target_", ("decoder", "_target_"), "nemo.collections.asr.modules.ConvASRDecoder"),
    ("joint._target_", ("joint", "_target_"), "nemo.collections.asr.modules.HATJoint"),
])
def test_config_validation_names_key_and_value(key, path, value):
    cfg = _config("tdt_tiny")
    node = cfg
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        TransducerConfig.from_nemo(cfg)
    assert repr(value) in str(err.value)


@needs_shared
def test_config_values_from_fixtures():
    tdt = TransducerConfig.from_nemo(_config("tdt_tiny"))
    assert (tdt.vocab_size, tdt.blank_id, tdt.durations, tdt.max_symbols) == (128, 128, (0, 1, 2, 3, 4), 10)
    assert tdt.is_tdt and tdt.num_outputs == 129 and tdt.joint_dropout
    assert tdt.frame_seconds == pytest.approx(0.08)
    rnnt = TransducerConfig.from_nemo(_config("rnnt_tiny"))
    assert rnnt.durations == () and not rnnt.is_tdt
    with pytest.raises(ValueError, match="aux_ctc|target"):
        ctc_config_from_nemo(_config("tdt_tiny"))


@needs_shared
def test_state_dict_must_match_exactly():
    archive = NemoArchive(NEMO_REF / "rnnt_tiny" / "model.nemo")
    state = dict(archive.state_dict())
    del state["joint.enc.bias"]
    with pytest.raises(ValueError, match=r"1 missing \(first: joint.enc.bias\)"):
        TransducerDecoder.from_archive(archive, state_dict=state)


@needs_shared
def test_preallocated_buffers_are_reused_and_give_identical_results():
    """Decoding in buffers reserved once (bigger than any batch) equals fresh allocation, for
    batches of different sizes one after the other, and never reallocates those buffers."""

    ref = Reference("tdt_ctc_tiny")
    dec = TransducerDecoder.from_archive(NemoArchive(ref.nemo))
    encs = [torch.from_numpy(ref.array("encoder", i)) for i in range(len(ref.files))]
    fresh = [dec.decode(e[None], torch.tensor([e.shape[1]]))[0] for e in encs]
    dec.reserve(max_batch=8, max_frames=max(e.shape[1] for e in encs) + 5)
    ptr = dec.buffers.outputs["tokens"].data_ptr()
    for group in ([0], [1, 2, 3], list(range(len(encs))), [4, 5]):
        width = max(encs[i].shape[1] for i in group)
        batch = torch.zeros(len(group), encs[0].shape[0], width)
        for j, i in enumerate(group):
            batch[j, :, : encs[i].shape[1]] = encs[i]
        hyps = dec.decode(batch, torch.tensor([encs[i].shape[1] for i in group]))
        assert [h.tokens for h in hyps] == [fresh[i].tokens for i in group]
        assert [h.frames for h in hyps] == [fresh[i].frames for i in group]
        assert [h.durations for h in hyps] == [fresh[i].durations for i in group]
    assert dec.buffers.outputs["tokens"].data_ptr() == ptr
