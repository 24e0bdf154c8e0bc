"""What a `.nemo` holds besides its weights, checked whole before a weight is read.

`model_config.yaml`'s sections and the tokenizer -> `NemoSpec`: a key we do not support, a
missing section, or a tokenizer that does not fit the decoder fails in about a second, not after
a 2.4 GB read of the weights and the encoder's build (`ParakeetEngine.from_nemo` reads this
first). Errors are ValueErrors naming the key; `checkpoint.naming_checkpoint` adds the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.checkpoint import config_section
from engines.ctc import CHAR_CTC_TARGETS, CTC_TARGETS, ctc_config_from_nemo
from engines.encoder_config import EncoderConfig
from engines.tokenizer import Tokenizer
from engines.transducer import TransducerConfig
from transcribe.features import FeatureConfig

# Models decoded by their CTC head alone (the character-vocabulary one is refused by name, ctc.py).
CTC_ONLY_TARGETS = CTC_TARGETS + CHAR_CTC_TARGETS


@dataclass(frozen=True)
class NemoSpec:
    features: FeatureConfig
    encoder: EncoderConfig
    ctc_only: bool  # a CTC head is the decoder: a CTC model, or decoding="ctc" of one without aux_ctc
    tokenizer: Tokenizer

    @classmethod
    def read(cls, archive: Any, decoding: str = "auto") -> "NemoSpec":
        """From a `NemoArchive`; `decoding` as `ParakeetEngine.from_nemo` takes it."""
        cfg = archive.config
        features = FeatureConfig.from_nemo(config_section(cfg, "preprocessor"))
        encoder = EncoderConfig.from_nemo(config_section(cfg, "encoder"))
        ctc_only = str(cfg.get("target", "")).endswith(CTC_ONLY_TARGETS) or decoding == "ctc" and "aux_ctc" not in cfg
        heads = [] if ctc_only else [("decoder.vocab_size", TransducerConfig.from_nemo(cfg).vocab_size)]
        if ctc_only or "aux_ctc" in cfg:
            ctc = ctc_config_from_nemo(cfg)
            heads.append((f"{'aux_ctc.' if ctc.state_prefix == 'ctc_decoder' else ''}decoder.num_classes", ctc.num_classes))
        tokenizer = Tokenizer.from_archive(archive)
        for key, classes in heads:
            # NeMo sizes the decoder from the tokenizer, so the weights then fail to load; ours are
            # sized from the config and loaded, and the text came out spelt in the wrong vocabulary.
            if tokenizer.vocab_size != classes:
                raise ValueError(f"the tokenizer has {tokenizer.vocab_size} pieces but {key} = {classes}: "
                                 "they must match (a tokenizer from another model?)")
        return cls(features, encoder, ctc_only, tokenizer)
