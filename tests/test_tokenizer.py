"""SentencePiece tokenizer from `.nemo` bytes: decoding identical to NeMo's ids_to_text."""
from __future__ import annotations

import pytest

from conftest import NEMO_REF, Reference, needs_shared
from engines.checkpoint import NemoArchive
from engines.tokenizer import Tokenizer


def tokenizer_for(variant: str) -> Tokenizer:
    return Tokenizer.from_archive(NemoArchive(NEMO_REF / variant / "model.nemo"))


def test_decode_matches_nemo_text(reference: Reference):
    tok = tokenizer_for(reference.dir.name)
    assert tok.vocab_size == 128
    for i, f in enumerate(reference.files):
        assert tok.decode(f["tokens"]) == f["text"], f"file {i}"
        assert tok.decode(reference.array("tokens", i)) == f["text"], f"file {i} (numpy ids)"
        # NeMo's transcribe() also drops the space before supported punctuation
        assert tok.text(f["tokens"]) == f["transcribe_text"], f"file {i}"


@needs_shared
def test_pieces_word_starts_and_specials():
    tok = tokenizer_for("tdt_tiny")
    assert tok.pieces([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    assert tok.decode([0]) == " \u2047 "  # <unk> renders as ' ⁇ ', a word of its own
    assert tok.decode_pieces(["<unk>"]) == tok.decode([0])
    assert tok.vocab[3] == "\u2581t" and tok.is_word_start(3)
    assert not tok.is_word_start(7)  # 're'
    assert tok.decode([10, 7]) == "there" and tok.decode([10, 3]) == "the t"
    assert tok.pieces([36, 121]) == ["\u2581'", "'"]


@needs_shared
@pytest.mark.parametrize("variant", ["tdt_tiny", "rnnt_tiny", "tdt_ctc_tiny", "rnnt_streaming_tiny"])
def test_tables_spell_every_id_as_sentencepiece_does(variant):
    """`pieces` and `token_texts` read tables built once; every id must come out as
    sentencepiece's own id_to_piece and decode_pieces give it, and an id outside the
    vocabulary must raise as id_to_piece does, not wrap around."""
    tok = tokenizer_for(variant)
    sp = tok._sp
    ids = list(range(tok.vocab_size))
    assert tok.pieces(ids) == [sp.id_to_piece(i) for i in ids]
    assert tok.token_texts(ids) == [sp.decode_pieces([sp.id_to_piece(i)]) for i in ids]
    if variant == "tdt_tiny":
        assert tok.token_texts([3, 3, 0]) == ["t", "t", " \u2047 "]  # '▁t' twice, <unk>
    for bad in (-1, tok.vocab_size):
        for read in (tok.pieces, tok.token_texts):
            with pytest.raises(IndexError):
                read([bad])


@needs_shared
def test_supported_punctuation_like_nemo():
    # "'" comes from the bare "'" piece; "▁'" is a word-start piece and does not count
    tok = tokenizer_for("tdt_tiny")
    assert tok.supported_punctuation == frozenset({"'"})
    assert tok.text([10, 36]) == "the'"
    assert tok.decode([10, 36]) == "the '"


class _Archive:
    def __init__(self, config):
        self.config = config

    def member_bytes(self, name):  # pragma: no cover - never reached in these tests
        raise AssertionError(name)


@pytest.mark.parametrize("config,key", [
    ({}, "tokenizer"),
    ({"tokenizer": {"type": "wpe", "model_path": "nemo:x.model"}}, "tokenizer.type"),
    ({"tokenizer": {"type": "bpe"}}, "tokenizer.model_path"),
])
def test_from_archive_rejects_unsupported(config, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Tokenizer.from_archive(_Archive(config))


def test_the_tokenizer_type_is_read_as_nemo_reads_it_in_any_case():
    """NeMo lower-cases `tokenizer.type`: a checkpoint saying "BPE" was refused here."""
    with pytest.raises(AssertionError, match="nemo:x.model"):  # past the type, on to the member
        Tokenizer.from_archive(_Archive({"tokenizer": {"type": "BPE", "model_path": "nemo:x.model"}}))
