"""SentencePiece tokenizer of a `.nemo` BPE model, decoding exactly as NeMo does.

NeMo's `SentencePieceTokenizer.ids_to_text` is plain `SentencePieceProcessor.decode_ids`
(non-legacy tokenizers carry no extra special tokens), and the transducer decoders' word
timestamps work on pieces (`id_to_piece`) and `decode_pieces`. We load the model from the
archive's bytes (`model_proto=`), never from a temporary file.

    tok = Tokenizer.from_archive(NemoArchive("model.nemo"))
    tok.decode([46, 56, 86])          # -> "et and ar", same as NeMo's ids_to_text
"""
from __future__ import annotations

import re
import unicodedata
from functools import cached_property
from typing import Any, Iterable, Sequence

import sentencepiece

WORD_START = "\u2581"  # "▁": SentencePiece's marker for "a space precedes this piece"

# Pieces NeMo never treats as punctuation (extract_punctuation_from_vocab): control tokens
# like <unk>, bracketed tags, WordPiece continuations, word-start pieces and blank pieces.
_SPECIAL_PIECE = [re.compile(p) for p in (r"^\[.*\]$", r"^<.*>$", r"^##", r"^\u2581", r"^\s*$")]


class Tokenizer:
    """A SentencePiece BPE model. Ids are `0 .. vocab_size-1`; the transducer blank is not one."""

    def __init__(self, processor: sentencepiece.SentencePieceProcessor):
        self._sp = processor
        self.vocab_size: int = processor.get_piece_size()

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> "Tokenizer":
        sp = sentencepiece.SentencePieceProcessor()
        sp.LoadFromSerializedProto(model_proto)
        return cls(sp)

    @classmethod
    def from_archive(cls, archive: Any) -> "Tokenizer":
        """From a `NemoArchive`: reads `tokenizer.model_path` (a `nemo:` member) from the config."""
        cfg = archive.config.get("tokenizer")
        if not isinstance(cfg, dict):
            raise ValueError(f"config key 'tokenizer' must be a mapping, got {cfg!r}")
        kind = cfg.get("type", "bpe")
        if str(kind).lower() != "bpe":  # NeMo lower-cases it: "BPE" is a SentencePiece model too
            raise ValueError(f"config key 'tokenizer.type' = {kind!r} is not supported (only 'bpe')")
        model_path = cfg.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"config key 'tokenizer.model_path' = {model_path!r} is not a member reference")
        try:
            return cls.from_bytes(archive.member_bytes(model_path))
        except RuntimeError as e:  # sentencepiece's "INTERNAL: ... ParseFromArray": it was a traceback
            raise ValueError(f"tokenizer member {model_path!r} is not a SentencePiece model (damaged, "
                             "or another tokenizer's file)") from e

    # --- decoding ---------------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text, identical to NeMo's `ids_to_text` (e.g. unk renders as ' ⁇ ')."""
        return self._sp.decode_ids([int(i) for i in ids])

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Token ids -> SentencePiece pieces ('▁the', 'ing', '<unk>'), NeMo's `ids_to_tokens`."""
        vocab = self.vocab
        return [vocab[self._index(i)] for i in ids]

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        """Token ids -> each one's text alone, `decode_pieces([piece])` ('▁the' -> 'the'): how word
        timestamps spell a token. From a table built once: a streaming server spells a stream's
        open tail after every step, and sentencepiece's per-call overhead had made that most of
        the transcript's update cost."""
        texts = self._token_texts
        return [texts[self._index(i)] for i in ids]

    @cached_property
    def _token_texts(self) -> list[str]:
        return [self._sp.decode_pieces([piece]) for piece in self.vocab]

    def _index(self, token_id: int) -> int:
        """`token_id` as a list index; out of range raises, as sentencepiece's id_to_piece does
        (a negative id must not wrap around to the end of the vocabulary)."""
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise IndexError(f"token id {i} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        return i

    def decode_pieces(self, pieces: Sequence[str]) -> str:
        """Pieces -> text, NeMo's `tokens_to_text` (used to spell words in word timestamps)."""
        return self._sp.decode_pieces(list(pieces))

    def is_word_start(self, token_id: int) -> bool:
        """True when the piece begins a new word ('▁' prefix)."""
        return self._sp.id_to_piece(int(token_id)).startswith(WORD_START)

    @cached_property
    def vocab(self) -> list[str]:
        """All pieces, by id."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    @cached_property
    def supported_punctuation(self) -> frozenset[str]:
        """Unicode punctuation characters found in ordinary (non word-start, non-control) pieces.

        NeMo uses this set to glue punctuation to the previous word in word timestamps and to
        drop the space before punctuation in the final transcript.
        """
        return frozenset(
            ch
            for piece in self.vocab
            if not any(p.match(piece) for p in _SPECIAL_PIECE)
            for ch in piece
            if unicodedata.category(ch).startswith("P")
        )

    @cached_property
    def _space_before_punct(self) -> re.Pattern[str] | None:
        if not self.supported_punctuation:
            return None
        alternatives = "|".join(re.escape(p) for p in sorted(self.supported_punctuation))
        return re.compile(r"(\s)(" + alternatives + ")")

    def text(self, ids: Iterable[int]) -> str:
        """The transcript as NeMo's `transcribe()` prints it: `decode` minus one space before
        each supported punctuation mark (`decode_tokens_to_str_with_strip_punctuation`)."""
        text = self.decode(ids)
        pattern = self._space_before_punct
        return pattern.sub(r"\2", text) if pattern is not None else text
