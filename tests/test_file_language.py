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


class _Pool:
    def __init__(self):
        self.released: list[int] = []

    def release(self, slots):
        self.released += slots


class _Slab:
    def view(self, slot, shape):
        import numpy as np

        return np.zeros(shape, np.float32)


class _Outputs:
    def __init__(self):
        self.failed, self.finished_files = [], []

    def fail(self, file, error):
        self.failed.append(error)

    def finished(self, file, result, seconds):
        self.finished_files.append(file)

    def flush(self):
        pass


class _Detecting:
    """An engine that detects "de" and fails on the piece with 7 frames, alone or in a batch."""

    name, device, settings, sample_rate, bucket_edges_s = "stub", "cpu", {}, 16000, (30.0,)
    detects_language, stage_seconds = True, {}

    def transcribe_features(self, views, languages=None):
        if any(v.shape[1] == 7 for v in views):
            raise RuntimeError("a piece the model fails on")
        return [Result("hallo", language=lang or "de") for lang in languages]


def test_held_pieces_of_a_file_that_fails_while_they_are_batched_give_their_slots_back():
    """The first piece decides; the 14 held pieces are batched, 10 to a full batch, which runs
    at once and fails the file (its 4th piece; halving isolates it). The pieces still being
    released after that belonged to a failed file: they were admitted again under a fresh
    state, held for good, and their slots never came back (enough of them stall the run)."""
    from pathlib import Path

    import transcribe.pipeline as pipeline
    from transcribe.batching import Batcher
    from transcribe.inputs import InputFile

    job = pipeline._Job.__new__(pipeline._Job)
    job.engine, job.outputs, job.split_at_s = _Detecting(), _Outputs(), float("inf")
    job.languages = FileLanguages()
    job.files = {0: pipeline._File(InputFile(Path("/a.wav"), Path("a.wav")))}
    pool, slab = _Pool(), _Slab()
    batcher = Batcher((30.0,), 300.0, 100)  # 10 pieces of 20 s to a full batch
    pieces = [Piece(0, i, 100 + i, 1, 7 if i == 3 else 3, 20.0 * i, 16000 * 20) for i in range(15)]
    for p in pieces:
        job._add(p, batcher, pool, slab)
    assert len(batcher) == 1 and len(job.languages.files[0].held) == 14
    job._run_batch(batcher.take(), batcher, pool, slab)
    assert job.files == {} and "a piece the model fails on" in job.outputs.failed[0]
    assert len(batcher) == 0 and job.languages.files == {}
    assert sorted(pool.released) == [p.slot for p in pieces]  # each slot back, once
