"""`FileLanguages`: a file's later pieces wait for its first piece's language, then take it."""
from __future__ import annotations

from transcribe.file_language import FileLanguages
from transcribe.preprocess import Piece
from transcribe.results import Result


def piece(fid: int, index: int) -> Piece:
    return Piece(fid=fid, index=index, slot=10 * fid + index, n_mels=80, frames=3000, offset_s=20.0 * index,
                 samples=16000)


def test_later_pieces_wait_for_the_first_and_take_its_language():
    langs = FileLanguages()
    first, later = piece(0, 0), [piece(0, i) for i in (1, 2, 3)]
    assert langs.admit(first) and langs.language(first) is None  # batched now, detects
    assert not any(langs.admit(p) for p in later)  # held
    other = piece(1, 0)
    assert langs.admit(other)  # another file's first piece is not held back
    assert langs.decided(first, Result("Guten Tag.", language="de")) == later  # in file order
    assert [langs.language(p) for p in later] == ["de"] * 3
    assert langs.admit(piece(0, 4)) and langs.language(piece(0, 4)) == "de"  # arriving after: at once
    assert langs.decided(later[0], Result("Hello.", language="en")) == []  # decided already
    assert langs.language(later[1]) == "de"
    assert langs.forget(0) == [] and langs.language(later[1]) is None


def test_a_piece_that_says_nothing_passes_the_choice_on():
    """A silent first piece (no language) or one without text (music, noise: its language is a
    guess) decides nothing: the next piece detects, the rest keep waiting; a next piece that
    has not arrived yet detects when it does."""
    langs = FileLanguages()
    p0, p1, p2, p3 = (piece(0, i) for i in range(4))
    assert langs.admit(p0) and not langs.admit(p1)
    assert langs.decided(p0, Result("")) == [p1]  # silent: p1 detects
    assert langs.language(p1) is None
    assert langs.decided(p1, Result("", language="ja")) == []  # no text; p2 is not here yet
    assert langs.admit(p2) and langs.language(p2) is None  # so it detects on arrival
    assert not langs.admit(p3)
    assert langs.decided(p2, Result("Bonjour.", language="fr")) == [p3]
    assert langs.language(p3) == "fr"


def test_held_next_piece_is_released_when_the_choice_passes_to_it():
    langs = FileLanguages()
    p0, p1, p2 = (piece(0, i) for i in range(3))
    assert langs.admit(p0) and not langs.admit(p1) and not langs.admit(p2)
    assert langs.decided(p0, Result("")) == [p1]
    assert langs.decided(p1, Result("", language="ja")) == [p2]
    assert langs.decided(p2, Result("Bonjour.", language="fr")) == []  # nothing left held
    assert langs.language(piece(0, 3)) == "fr" and langs.admit(piece(0, 3))


def test_a_failed_first_piece_gives_the_held_pieces_back():
    langs = FileLanguages()
    p0, p1, p2 = (piece(0, i) for i in range(3))
    langs.admit(p0), langs.admit(p1), langs.admit(p2)
    assert langs.decided(p0, "RuntimeError: boom") == []  # the pipeline fails the file
    assert sorted(p.index for p in langs.forget(0)) == [1, 2]  # whose slots go back
    assert langs.forget(0) == []
