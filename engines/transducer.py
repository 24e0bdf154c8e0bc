"""Transducer (TDT / RNN-T) decoding of NeMo `.nemo` checkpoints: config, modules, entry point.

The entry point other code calls is `TransducerDecoder`:

    archive = NemoArchive("model.nemo")
    dec = TransducerDecoder.from_archive(archive)
    hyps = dec.decode(encoder_out, lengths)     # encoder_out [B, D, T] float, lengths [B] int
    hyps[0].tokens, hyps[0].frames, hyps[0].durations
    dec.decode_ctc(encoder_out, lengths)        # hybrid TDT/RNN-T + CTC checkpoints only

`decode` is NeMo's batched greedy label-looping search (`decode_stages.py`), token-for-token
identical to `GreedyBatched{TDT,RNNT}LabelLoopingComputer`. `frames` are encoder frame indices
of each emitted token; `durations` are TDT's predicted durations in frames (empty for RNN-T).
Seconds per frame are `config.window_stride * config.subsampling_factor`.

Modules keep NeMo's parameter names (`prediction.embed`, `prediction.dec_rnn.lstm.*`,
`enc`, `pred`, `joint_net.N`), so the state dict loads by prefix, strictly, onto modules
built on the meta device (no random init, no copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engines.checkpoint import load_strict, sub_state_dict
from engines.cpu_threads import DECODER_THREADS, decoder_threads, fastest_threads
from engines.ctc import CTCHead, ctc_config_from_nemo, greedy_ctc
from engines.decode_graphs import GraphDecoder
from engines.decode_modes import DecodeMode
from engines.decode_stages import DecodeBuffers, Hypothesis, label_looping_decode

SUPPORTED_TARGETS = ("EncDecRNNTBPEModel", "EncDecHybridRNNTCTCBPEModel")
# The prediction network and joint we build (an LSTM stack; a joint over both projections).
# NeMo's SampledRNNTJoint differs from RNNTJoint only in its training loss.
DECODER_TARGETS = ("RNNTDecoder",)
JOINT_TARGETS = ("RNNTJoint", "SampledRNNTJoint")
_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "silu": nn.SiLU, "swish": nn.SiLU}


def _get(cfg: dict[str, Any], dotted: str, default: Any = ...) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is ...:
                raise ValueError(f"config key {dotted!r} is missing")
            return default
        node = node[part]
    return node


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"config key {key!r} = {value!r} is not supported: {why}")


@dataclass(frozen=True)
class TransducerConfig:
    """Everything decoding needs from `model_config.yaml`. Sizes are feature widths."""

    vocab_size: int  # tokens, without blank
    blank_id: int  # = vocab_size for NeMo BPE transducers
    durations: tuple[int, ...]  # TDT durations in frames; () for plain RNN-T
    max_symbols: int  # max tokens emitted on one frame before a blank is forced
    enc_hidden: int
    pred_hidden: int
    pred_rnn_layers: int
    joint_hidden: int
    activation: str
    joint_dropout: bool  # NeMo puts a Dropout at joint_net.1 iff dropout > 0 (shifts key names)
    num_outputs: int  # joint output width: vocab + blank + extra outputs
    joint_log_softmax: bool | None  # None = NeMo's "auto": log-softmax on CPU only
    window_stride: float  # seconds per feature frame
    subsampling_factor: int  # feature frames per encoder frame

    @property
    def is_tdt(self) -> bool:
        return len(self.durations) > 0

    @property
    def frame_seconds(self) -> float:
        return self.window_stride * self.subsampling_factor

    @classmethod
    def from_nemo(cls, cfg: dict[str, Any]) -> "TransducerConfig":
        """Validate and read a NeMo model config; ValueError names the offending key and value."""
        target = str(cfg.get("target", ""))
        _require(target.rsplit(".", 1)[-1] in SUPPORTED_TARGETS, "target", target,
                 f"transducer decoding needs one of {SUPPORTED_TARGETS}")
        for part, known in (("decoder", DECODER_TARGETS), ("joint", JOINT_TARGETS)):
            module = _get(cfg, f"{part}._target_", None)  # absent in hand-written configs: the keys below decide
            _require(module is None or str(module).rsplit(".", 1)[-1] in known, f"{part}._target_", module,
                     f"the {part} must be one of {known}")
        vocab = _get(cfg, "decoder.vocab_size")
        _require(isinstance(vocab, int) and vocab > 0, "decoder.vocab_size", vocab, "must be a positive int")
        _require(_get(cfg, "decoder.normalization_mode", None) is None, "decoder.normalization_mode",
                 _get(cfg, "decoder.normalization_mode", None), "only None")
        _require(_get(cfg, "decoder.blank_as_pad", True) is True, "decoder.blank_as_pad",
                 _get(cfg, "decoder.blank_as_pad", True), "only True (blank is the SOS/pad symbol)")
        pred_hidden = _get(cfg, "decoder.prednet.pred_hidden")
        rnn_hidden = _get(cfg, "decoder.prednet.rnn_hidden_size", -1)
        _require(rnn_hidden in (-1, None, pred_hidden), "decoder.prednet.rnn_hidden_size", rnn_hidden,
                 "projected LSTMs are not implemented")
        num_classes = _get(cfg, "joint.num_classes")
        _require(num_classes == vocab, "joint.num_classes", num_classes, f"must equal decoder.vocab_size={vocab}")
        activation = str(_get(cfg, "joint.jointnet.activation", "relu")).lower()
        _require(activation in _ACTIVATIONS, "joint.jointnet.activation", activation, f"one of {sorted(_ACTIVATIONS)}")
        log_softmax = _get(cfg, "joint.log_softmax", None)
        _require(log_softmax in (None, True, False), "joint.log_softmax", log_softmax, "must be null or a bool")
        # NeMo reads num_extra_outputs from the joint section itself (not jointnet).
        extra = _get(cfg, "joint.num_extra_outputs", 0) or 0
        return cls(
            vocab_size=vocab, blank_id=vocab, durations=_durations(cfg), max_symbols=_max_symbols(cfg),
            enc_hidden=_get(cfg, "joint.jointnet.encoder_hidden"), pred_hidden=pred_hidden,
            pred_rnn_layers=_get(cfg, "decoder.prednet.pred_rnn_layers"),
            joint_hidden=_get(cfg, "joint.jointnet.joint_hidden"), activation=activation,
            joint_dropout=bool(_get(cfg, "joint.jointnet.dropout", 0.0)),
            num_outputs=num_classes + 1 + int(extra), joint_log_softmax=log_softmax,
            window_stride=float(_get(cfg, "preprocessor.window_stride")),
            subsampling_factor=int(_get(cfg, "encoder.subsampling_factor")),
        )


def _durations(cfg: dict[str, Any]) -> tuple[int, ...]:
    dec = _get(cfg, "decoding", {}) or {}
    strategy = dec.get("strategy", "greedy_batch")
    _require(strategy in ("greedy", "greedy_batch"), "decoding.strategy", strategy, "only greedy decoding")
    big = dec.get("big_blank_durations") or []
    _require(not big and dec.get("model_type") != "multiblank", "decoding.big_blank_durations", big,
             "multi-blank RNN-T is not implemented")
    temperature = dec.get("temperature", 1.0)
    _require(temperature == 1.0, "decoding.temperature", temperature, "only 1.0")
    durations, key = dec.get("durations") or [], "decoding.durations"
    # NeMo's set_decoding_type_according_to_loss (rnnt_models.py), at every load: a TDT loss's
    # durations replace decoding.durations (a checkpoint whose two lists differ decoded with the
    # decoding's here and the loss's in NeMo: other text), and a multi-blank loss's big blanks
    # replace the decoding's. Any other loss ("default" is warprnnt_numba) leaves them.
    loss = cfg.get("loss") if isinstance(cfg.get("loss"), dict) else {}
    loss_name = loss.get("loss_name", "default")
    _require(loss_name != "multiblank_rnnt", "loss.loss_name", loss_name, "multi-blank RNN-T is not implemented")
    if loss_name == "tdt":
        kwargs = loss.get("tdt_kwargs")
        durations, key = (kwargs.get("durations") if isinstance(kwargs, dict) else None), "loss.tdt_kwargs.durations"
        _require(isinstance(durations, list) and len(durations) > 0, key, durations,
                 "a TDT loss decodes with these durations (as NeMo does): a non-empty list")
    _require(isinstance(durations, list) and all(isinstance(d, int) and d >= 0 for d in durations),
             key, durations, "must be a list of non-negative ints")
    return tuple(durations)


def _max_symbols(cfg: dict[str, Any]) -> int:
    greedy = _get(cfg, "decoding.greedy", {}) or {}
    value = greedy.get("max_symbols") or greedy.get("max_symbols_per_step")
    # NeMo allows None (no cap, growing buffers); preallocated state needs a bound.
    _require(isinstance(value, int) and value >= 1, "decoding.greedy.max_symbols", value, "must be an int >= 1")
    return value


class _DecRNN(nn.Module):
    """NeMo's LSTMDropout: holds the LSTM as `.lstm` (dropout is training-only)."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, layers)


class PredictionNetwork(nn.Module):
    """RNN-T prediction network: embedding (blank = last row, all zeros) + LSTM stack."""

    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        self.prediction = nn.ModuleDict({
            # Built on the meta device: from_pretrained skips nn.Embedding's normal_ init,
            # which on meta imports torch._dynamo (1.3-2.5 s of every model load).
            "embed": nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size + 1, cfg.pred_hidden), freeze=False),
            "dec_rnn": _DecRNN(cfg.pred_hidden, cfg.pred_rnn_layers),
        })

    def step(self, labels: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One label per item. labels [B] long; state (h, c) each [L, B, H] -> out [B, H], state."""
        lstm = self.prediction["dec_rnn"].lstm
        return lstm_step_native(lstm, self.prediction["embed"](labels), state)


def lstm_step_native(lstm: nn.LSTM, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One time step of `lstm` through torch's own LSTM cell (two GEMMs and one fused kernel per
    layer), never `nn.LSTM`'s cuDNN or oneDNN RNN, on every device, so every decoder mode and the
    streaming decoder run this same step and their tokens stay identical.
    - CUDA: on the H100 (2026-11-23, torch 2.11, CUDA 13) cuDNN's LSTM failed with
      CUDNN_STATUS_INTERNAL_ERROR while a conditional WHILE body was captured, which crashed the
      full-graph decoder. The cell also takes the strided h[:, :B] views of reserved buffers
      that cuDNN rejected.
    - CPU: a decoder step is one time step of a few rows, where `nn.LSTM` (oneDNN) costs far
      more than the cell: on the 2-core Zen 3 EPYC (torch 2.13, 2026-11-28) 640 hidden x 2
      layers took 20-31 ms a step at 1 row against 2.4-2.5 ms, 1.1-1.3x the cell's time at
      8-32 rows, 1.4-1.6x at 128; the streaming fixture's 64 x 1 took 1.6-2.5x.
    x [B, H], state (h, c) each [L, B, H] -> out [B, H], (h, c)."""
    h0, c0 = state
    hs, cs = [], []
    for layer in range(lstm.num_layers):
        h, c = torch.lstm_cell(x, (h0[layer], c0[layer]), getattr(lstm, f"weight_ih_l{layer}"),
                               getattr(lstm, f"weight_hh_l{layer}"), getattr(lstm, f"bias_ih_l{layer}"),
                               getattr(lstm, f"bias_hh_l{layer}"))
        hs.append(h)
        cs.append(c)
        x = h
    return x, (torch.stack(hs), torch.stack(cs))


class Joint(nn.Module):
    """RNN-T / TDT joint: enc and pred projections, activation, output layer."""

    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        self.enc = nn.Linear(cfg.enc_hidden, cfg.joint_hidden)
        self.pred = nn.Linear(cfg.pred_hidden, cfg.joint_hidden)
        layers: list[nn.Module] = [_ACTIVATIONS[cfg.activation]()]
        if cfg.joint_dropout:
            layers.append(nn.Dropout(0.0))  # placeholder keeps NeMo's index of the output layer
        layers.append(nn.Linear(cfg.joint_hidden, cfg.num_outputs))
        self.joint_net = nn.Sequential(*layers)
        self.log_softmax = cfg.joint_log_softmax

    def logits(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Projected encoder frame f [B, J] + projected prediction g [B, J] -> [B, num_outputs].

        Like NeMo, log-softmax over the whole output (tokens, blank and durations) when
        `log_softmax` is None on CPU: it never changes an argmax in exact arithmetic, but the
        rounding it adds decides rare float ties, so we keep it to stay bit-identical."""
        out = self.joint_net(f + g)
        if self.log_softmax or (self.log_softmax is None and not out.is_cuda):
            out = out.log_softmax(dim=-1)
        return out


def _load(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    return load_strict(module, sub_state_dict(state, prefix), prefix).eval()


class TransducerDecoder:
    """Greedy TDT / RNN-T decoding (plus the CTC head of hybrid models) from encoder output."""

    def __init__(self, config: TransducerConfig, prediction: PredictionNetwork, joint: Joint,
                 ctc_head: CTCHead | None = None):
        self.config = config
        self.prediction = prediction
        self.joint = joint
        self.ctc_head = ctc_head
        self.buffers: DecodeBuffers | None = None  # set by reserve(); else allocated per batch
        self.graphs = GraphDecoder(prediction, joint, config)  # eager until set_mode() picks a mode
        self.cpu_threads = DECODER_THREADS  # eager CPU decode; measured by reserve()

    @classmethod
    def from_archive(cls, archive: Any, state_dict: dict[str, torch.Tensor] | None = None) -> "TransducerDecoder":
        """Build from a `NemoArchive` (pass `state_dict` if already loaded, to read it once)."""
        cfg = TransducerConfig.from_nemo(archive.config)
        state = archive.state_dict() if state_dict is None else state_dict
        with torch.device("meta"):
            prediction, joint = PredictionNetwork(cfg), Joint(cfg)
        ctc_head = None
        ctc_cfg = ctc_config_from_nemo(archive.config) if "aux_ctc" in archive.config else None
        if ctc_cfg is not None:
            with torch.device("meta"):
                ctc_head = CTCHead(ctc_cfg)
            _load(ctc_head, state, ctc_cfg.state_prefix)
        return cls(cfg, _load(prediction, state, "decoder"), _load(joint, state, "joint"), ctc_head)

    def to(self, device: torch.device | str) -> "TransducerDecoder":
        """Move all modules (e.g. to "cuda"); decode() then expects encoder_out there too."""
        for module in (self.prediction, self.joint, self.ctc_head):
            if module is not None:
                module.to(device)
        return self

    @torch.inference_mode()
    def decode(self, encoder_out: torch.Tensor, lengths: torch.Tensor) -> list[Hypothesis]:
        """encoder_out [B, D, T] (NeMo's encoder layout), lengths [B] valid frames -> B hypotheses."""
        if encoder_out.dim() != 3 or encoder_out.shape[1] != self.config.enc_hidden:
            raise ValueError(f"encoder_out must be [B, {self.config.enc_hidden}, T], got {tuple(encoder_out.shape)}")
        enc_proj = self.joint.enc(encoder_out.transpose(1, 2))  # projected once: [B, T, J]
        lengths = lengths.to(enc_proj.device)
        if self.graphs.mode is not DecodeMode.EAGER:
            return self.graphs.decode(enc_proj, lengths, self.buffers)
        with decoder_threads(enc_proj.device, self.cpu_threads):
            return label_looping_decode(enc_proj, lengths, self.prediction, self.joint, self.config, self.buffers)

    @property
    def mode(self) -> str:
        """The decoder mode in use: "full-graph", "unrolled" or "eager"."""
        return self.graphs.mode.value

    def set_mode(self, requested: str = "auto") -> str:
        """Choose the decoder mode ("auto", "full-graph", "unrolled", "eager") for the device the
        modules are on (call after `to()`); a fallback is logged once. Returns the mode chosen."""
        return self.graphs.set_mode(requested, self.joint.pred.weight.device).value

    def reserve(self, max_batch: int, max_frames: int) -> None:
        """Preallocate the decoding state for batches up to [max_batch, max_frames] (startup)."""
        w = self.joint.pred.weight
        self.buffers = DecodeBuffers(max_batch, max_frames, self.config, w.shape[0], w.dtype, w.device)
        self.graphs.reserve(max_batch, max_frames)
        if w.device.type == "cpu":
            self.cpu_threads = self._fastest_cpu_threads(max_batch, max_frames)

    @torch.inference_mode()
    def _fastest_cpu_threads(self, max_batch: int, max_frames: int) -> int:
        """Time this decoder on a synthetic full batch (seeded random projected encoder
        frames, a few dozen label steps) with 1 thread and with all; see engines/cpu_threads.py."""
        w = self.joint.pred.weight
        gen = torch.Generator().manual_seed(0)
        b, t = min(max_batch, 32), min(max_frames, 4)  # a typical batch; ~10 label steps
        enc_proj = torch.randn(b, t, w.shape[0], generator=gen).to(w.dtype)
        lengths = torch.full((b,), t, dtype=torch.long)
        return fastest_threads(lambda: label_looping_decode(enc_proj, lengths, self.prediction, self.joint,
                                                            self.config, self.buffers))

    @torch.inference_mode()
    def ctc_log_probs(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """Hybrid models' CTC head: [B, D, T] -> log-probs [B, T, vocab + 1]."""
        if self.ctc_head is None:
            raise ValueError("this checkpoint has no CTC head (config has no 'aux_ctc')")
        return self.ctc_head(encoder_out)

    def decode_ctc(self, encoder_out: torch.Tensor, lengths: torch.Tensor) -> list[Hypothesis]:
        """Greedy CTC with the hybrid's auxiliary head (argmax, collapse repeats, drop blank)."""
        return greedy_ctc(self.ctc_log_probs(encoder_out), lengths, blank_id=self.config.blank_id)
