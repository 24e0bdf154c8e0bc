"""The Parakeet engine: a `.nemo` FastConformer model (TDT, RNN-T, hybrid or CTC) end to end.

audio pieces [samples] -> padded batch [B, T] -> LogMel [B, n_mels, F] -> ConformerEncoder
[B, D, T'] -> greedy decoding (label-looping transducer or CTC) -> tokens + frames ->
`Result` (text, words, segments). The checkpoint is read once: one state dict feeds every module.
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from engines.checkpoint import NemoArchive, sub_state_dict
from engines.conformer import ConformerEncoder, EncoderConfig
from engines.ctc import CTCDecoder
from engines.tokenizer import Tokenizer
from engines.transducer import TransducerDecoder
from transcribe.features import FeatureConfig, LogMel
from transcribe.results import Result
from transcribe.timestamps import FrameTiming, build_result

# Pieces longer than this are cut at pauses by the pipeline: attention memory grows with the
# square of the length, and Parakeet models were trained on utterances up to about 30-40 s.
DEFAULT_MAX_PIECE_SECONDS = 40.0
CTC_ONLY_TARGETS = ("EncDecCTCModelBPE", "EncDecCTCModel")


def pick_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu; anything else is checked and returned."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    return device


class ParakeetEngine:
    """Transcribes batches of 16 kHz float32 pieces with one loaded `.nemo` model."""

    def __init__(self, name: str, features: LogMel, encoder: ConformerEncoder, decoder, tokenizer: Tokenizer,
                 kind: str, timing: FrameTiming, device: str = "cpu"):
        self.name = name
        self.device = device
        self.features = features.to(device)
        self.encoder = encoder.to(device)
        self.decoder = decoder.to(device) if hasattr(decoder, "to") else decoder
        self.tokenizer = tokenizer
        self.kind = kind  # "tdt" | "rnnt" | "ctc": how token frames become word times
        self.timing = timing
        self.sample_rate = features.cfg.sample_rate
        self.max_piece_seconds = DEFAULT_MAX_PIECE_SECONDS
        self.stage_seconds: dict[str, float] = defaultdict(float)

    @classmethod
    def from_nemo(cls, path: str | Path, device: str = "auto", name: str | None = None,
                  decoding: str = "auto") -> "ParakeetEngine":
        """Load a `.nemo` checkpoint. `decoding`: auto (transducer if present), or ctc (hybrids)."""
        device = pick_device(device)
        with NemoArchive(path) as archive:
            cfg = archive.config
            state = archive.state_dict()
            fcfg = FeatureConfig.from_nemo(cfg["preprocessor"])
            bufs = sub_state_dict(state, "preprocessor.featurizer")
            features = LogMel(fcfg, window=bufs.get("window"), fb=bufs.get("fb"))
            encoder = ConformerEncoder.from_state(EncoderConfig.from_nemo(cfg["encoder"]), sub_state_dict(state, "encoder"))
            target = str(cfg.get("target", ""))
            if target.endswith(CTC_ONLY_TARGETS) or decoding == "ctc" and "aux_ctc" not in cfg:
                decoder, kind = CTCDecoder.from_archive(archive, state), "ctc"
            else:
                decoder = TransducerDecoder.from_archive(archive, state)
                kind = "ctc" if decoding == "ctc" else ("tdt" if decoder.config.is_tdt else "rnnt")
            tokenizer = Tokenizer.from_archive(archive)
        del state
        timing = FrameTiming(fcfg.window_stride, encoder.cfg.subsampling_factor)
        return cls(name or Path(path).stem, features, encoder, decoder, tokenizer, kind, timing, device)

    def _batch(self, pieces: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-padded [B, T] float32 and lengths [B], built on the host then moved once."""
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
        audio = torch.zeros(len(pieces), int(lengths.max()), dtype=torch.float32,
                            pin_memory=self.device.startswith("cuda"))
        for i, p in enumerate(pieces):
            audio[i, : len(p)] = torch.from_numpy(p)
        return audio.to(self.device, non_blocking=True), lengths.to(self.device, non_blocking=True)

    def _timed(self, stage: str, t0: float) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # one sync per stage per batch, for honest stage times
        t1 = time.perf_counter()
        self.stage_seconds[stage] += t1 - t0
        return t1

    @torch.inference_mode()
    def encode(self, pieces: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pieces -> encoder output [B, D, T'] and valid lengths [B]."""
        t = time.perf_counter()
        audio, lengths = self._batch(pieces)
        feats, flen = self.features(audio, lengths)
        t = self._timed("features", t)
        enc, elen = self.encoder(feats, flen)
        self._timed("encoder", t)
        return enc, elen

    @torch.inference_mode()
    def transcribe(self, pieces: list[np.ndarray]) -> list[Result]:
        """A batch of float32 mono pieces at `sample_rate` -> one Result per piece."""
        enc, elen = self.encode(pieces)
        t = time.perf_counter()
        if self.kind == "ctc" and isinstance(self.decoder, TransducerDecoder):
            hyps = self.decoder.decode_ctc(enc, elen)
        else:
            hyps = self.decoder.decode(enc, elen)
        t = self._timed("decoder", t)
        out = [build_result(self.tokenizer, h.tokens, h.frames, h.durations, self.kind, self.timing) for h in hyps]
        self._timed("detokenize", t)
        return out
