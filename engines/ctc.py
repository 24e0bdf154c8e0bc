"""CTC heads of NeMo checkpoints and greedy CTC decoding.

Two layouts share NeMo's `ConvASRDecoder` (a 1x1 Conv1d over encoder features + log-softmax):
- hybrid TDT/RNN-T + CTC models (`EncDecHybridRNNTCTCBPEModel`): config `aux_ctc.decoder`,
  weights `ctc_decoder.decoder_layers.0.*`;
- pure CTC models (`EncDecCTCModelBPE`, e.g. parakeet-ctc): config `decoder`, weights
  `decoder.decoder_layers.0.*`. `CTCDecoder` is their entry point:

    dec = CTCDecoder.from_archive(NemoArchive("parakeet-ctc.nemo"))
    hyps = dec.decode(encoder_out, lengths)    # [B, D, T], [B] -> list[Hypothesis]

Greedy CTC = per-frame argmax (first index wins ties, as torch.max in NeMo), collapse repeats,
drop blank (the last class). A hypothesis' `frames` are the first frame of each kept token and
`durations` the length of its run of frames.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engines.checkpoint import load_strict, sub_state_dict
from engines.decode_stages import Hypothesis

CTC_TARGETS = ("EncDecCTCModelBPE",)
CHAR_CTC_TARGETS = ("EncDecCTCModel",)  # `decoder.vocabulary` characters, no SentencePiece model


@dataclass(frozen=True)
class CTCConfig:
    feat_in: int  # encoder width D
    num_classes: int  # tokens without blank; blank id = num_classes
    state_prefix: str  # "ctc_decoder" (hybrid) or "decoder" (pure CTC)

    @property
    def blank_id(self) -> int:
        return self.num_classes


def ctc_config_from_nemo(cfg: dict[str, Any]) -> CTCConfig:
    """Read the CTC head of a hybrid (`aux_ctc.decoder`) or pure CTC (`decoder`) model config."""
    target = str(cfg.get("target", "")).rsplit(".", 1)[-1]
    if target in CHAR_CTC_TARGETS:  # it has a CTC head; what we lack is its character vocabulary
        raise ValueError(f"config key 'target' = {cfg.get('target')!r} is a character-vocabulary CTC model: "
                         f"not supported (BPE CTC models only: {', '.join(CTC_TARGETS)})")
    if "aux_ctc" in cfg:
        head, key, prefix = (cfg["aux_ctc"] or {}).get("decoder"), "aux_ctc.decoder", "ctc_decoder"
    elif target in CTC_TARGETS:
        head, key, prefix = cfg.get("decoder"), "decoder", "decoder"
    else:
        raise ValueError(f"config key 'target' = {cfg.get('target')!r} has no CTC head "
                         f"(needs 'aux_ctc' or one of {CTC_TARGETS})")
    if not isinstance(head, dict):
        raise ValueError(f"config key {key!r} = {head!r} must be a mapping")
    kind = str(head.get("_target_", "")).rsplit(".", 1)[-1]
    if kind != "ConvASRDecoder":
        raise ValueError(f"config key '{key}._target_' = {head.get('_target_')!r} is not supported (ConvASRDecoder)")
    num_classes = head.get("num_classes", -1)
    if not isinstance(num_classes, int) or num_classes < 1:
        num_classes = len(head.get("vocabulary") or [])  # NeMo's fallback when num_classes <= 0
    feat_in = head.get("feat_in")
    if not isinstance(feat_in, int) or feat_in < 1 or num_classes < 1:
        raise ValueError(f"config key {key!r} needs positive feat_in and num_classes, got {feat_in!r}, {num_classes!r}")
    return CTCConfig(feat_in=feat_in, num_classes=num_classes, state_prefix=prefix)


class CTCHead(nn.Module):
    """NeMo ConvASRDecoder: Conv1d(D, vocab + 1, 1) then log-softmax over classes."""

    def __init__(self, cfg: CTCConfig):
        super().__init__()
        self.decoder_layers = nn.Sequential(nn.Conv1d(cfg.feat_in, cfg.num_classes + 1, kernel_size=1, bias=True))

    def forward(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """encoder_out [B, D, T] -> log-probs [B, T, vocab + 1]."""
        return self.decoder_layers(encoder_out).transpose(1, 2).log_softmax(dim=-1)


def greedy_ctc(log_probs: torch.Tensor, lengths: torch.Tensor, blank_id: int) -> list[Hypothesis]:
    """log_probs [B, T, C], lengths [B] -> per item: collapsed non-blank tokens, first frames, runs."""
    best = log_probs.argmax(dim=-1).cpu()
    out = []
    for b, n in enumerate(lengths.cpu().tolist()):
        ids = best[b, :n]
        if n == 0:
            out.append(Hypothesis([], [], []))
            continue
        # run boundaries: a frame starts a run when its label differs from the previous frame's
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = ids[1:] != ids[:-1]
        start_idx = starts.nonzero().squeeze(1)
        run_len = torch.diff(start_idx, append=torch.tensor([n]))
        labels = ids[start_idx]
        keep = labels != blank_id
        out.append(Hypothesis(labels[keep].tolist(), start_idx[keep].tolist(), run_len[keep].tolist()))
    return out


class CTCDecoder:
    """Greedy CTC for pure CTC checkpoints (and any model whose CTC head `ctc_config_from_nemo` reads)."""

    def __init__(self, config: CTCConfig, head: CTCHead):
        self.config = config
        self.head = head

    @classmethod
    def from_archive(cls, archive: Any, state_dict: dict[str, torch.Tensor] | None = None) -> "CTCDecoder":
        cfg = ctc_config_from_nemo(archive.config)
        state = archive.state_dict() if state_dict is None else state_dict
        with torch.device("meta"):
            head = CTCHead(cfg)
        return cls(cfg, load_strict(head, sub_state_dict(state, cfg.state_prefix), cfg.state_prefix).eval())

    @torch.inference_mode()
    def log_probs(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """[B, D, T] -> [B, T, vocab + 1]."""
        return self.head(encoder_out)

    def decode(self, encoder_out: torch.Tensor, lengths: torch.Tensor) -> list[Hypothesis]:
        return greedy_ctc(self.log_probs(encoder_out), lengths, blank_id=self.config.blank_id)
