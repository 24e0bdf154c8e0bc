"""`FileLanguages`: a file's later pieces wait for its language, decided by a sure piece or a
vote, then take it."""
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
    de = Result("Guten Tag.", language="de", language_probability=0.97)
    assert langs.decided(first, de) == ([(first, de)], later)  # it stands; the rest, in file order
    assert [langs.language(p) for p in later] == ["de"] * 3
    assert langs.admit(piece(0, 4)) and langs.language(piece(0, 4)) == "de"  # arriving after: at once
    en = Result("Hello.", language="en")
    assert langs.decided(later[0], en) == ([(later[0], en)], [])  # decided already: it stands
    assert langs.language(later[1]) == "de"
    assert langs.forget(0) == [] and langs.language(later[1]) is None


def test_a_piece_that_says_nothing_passes_the_choice_on():
    """A silent first piece (no language) or one without text (its language is a guess)
    decides nothing: the next piece detects, the rest keep waiting; a next piece that has not
    arrived yet detects when it does."""
    langs = FileLanguages()
    p0, p1, p2, p3 = (piece(0, i) for i in range(4))
    assert langs.admit(p0) and not langs.admit(p1)
    silent = Result("")
    assert langs.decided(p0, silent) == ([(p0, silent)], [p1])  # silent: p1 detects
    assert langs.language(p1) is None
    empty = Result("", language="ja", language_probability=0.9)
    assert langs.decided(p1, empty) == ([(p1, empty)], [])  # no text; p2 is not here yet
    assert langs.admit(p2) and langs.language(p2) is None  # so it detects on arrival
    assert not langs.admit(p3)
    fr = Result("Bonjour.", language="fr", language_probability=0.95)
    assert langs.decided(p2, fr) == ([(p2, fr)], [p3])
    assert langs.language(p3) == "fr"


def test_held_next_piece_is_released_when_the_choice_passes_to_it():
    langs = FileLanguages()
    p0, p1, p2 = (piece(0, i) for i in range(3))
    assert langs.admit(p0) and not langs.admit(p1) and not langs.admit(p2)
    assert langs.decided(p0, Result(""))[1] == [p1]
    assert langs.decided(p1, Result("", language="ja"))[1] == [p2]
    assert langs.decided(p2, Result("Bonjour.", language="fr"))[1] == []  # nothing left held
    assert langs.language(piece(0, 3)) == "fr" and langs.admit(piece(0, 3))


def test_an_unsure_piece_waits_for_a_sure_one_and_is_decoded_again_in_its_language():
    """Music before the speech: whisper-base calls the tune Romanian (0.64) and writes text for
    it. That piece keeps its slot and its result aside; the next piece is sure of English, which
    decides: the tune's piece is batched again, in English, and the held pieces with it."""
    langs = FileLanguages()
    p0, p1, p2, p3 = (piece(0, i) for i in range(4))
    assert langs.admit(p0) and not langs.admit(p1) and not langs.admit(p2)
    tune = Result("Ma de reine.", language="ro", language_probability=0.64)
    assert langs.decided(p0, tune) == ([], [p1])  # p0 stands nowhere yet: its slot stays taken
    assert langs.language(p1) is None  # p1 detects
    en = Result("There's iron, they say.", language="en", language_probability=0.99)
    assert langs.decided(p1, en) == ([(p1, en)], [p0, p2])  # p0 again, and the held p2
    assert langs.language(p0) == "en" and langs.language(p2) == "en"
    again = Result("Thank you.", language="en")
    assert langs.decided(p0, again) == ([(p0, again)], [])
    assert langs.admit(p3) and langs.forget(0) == []


def test_an_unsure_probe_in_the_language_decided_stands():
    langs = FileLanguages()
    p0, p1 = piece(0, 0), piece(0, 1)
    langs.admit(p0), langs.admit(p1)
    first = Result("Hello there.", language="en", language_probability=0.7)
    assert langs.decided(p0, first) == ([], [p1])
    sure = Result("General Kenobi.", language="en", language_probability=0.95)
    assert langs.decided(p1, sure) == ([(p1, sure), (p0, first)], [])  # not decoded twice


def test_a_long_intro_lets_its_oldest_unsure_pieces_go_and_the_speech_decides():
    """36 s of a tune in three 12 s pieces, called Romanian at 0.36-0.45 by whisper-base, had
    voted the English talk after them Romanian. At most three unsure probes wait: a fourth lets
    the oldest go as decoded (its slot back), and the first sure piece decides the rest."""
    langs = FileLanguages()
    p = [piece(0, i) for i in range(6)]
    for q in p:
        langs.admit(q)
    tune = [Result(f"Unului {i}.", language="ro", language_probability=pr) for i, pr in enumerate((0.36, 0.45, 0.35))]
    assert langs.decided(p[0], tune[0]) == ([], [p[1]])
    assert langs.decided(p[1], tune[1]) == ([], [p[2]])
    assert langs.decided(p[2], tune[2]) == ([(p[0], tune[0])], [p[3]])  # the oldest goes; two still wait
    en = Result("If the reader will excuse me.", language="en", language_probability=0.99)
    assert langs.decided(p[3], en) == ([(p[3], en)], [p[1], p[2], p[4], p[5]])  # again in English, and the held
    assert all(langs.language(q) == "en" for q in p[1:])


def test_unsure_probes_vote_after_eight_and_those_waiting_are_decoded_again():
    """A file the model is never sure of: after eight unsure probes the three still waiting vote
    (those let go, an intro's most likely, have no say), and are decoded again if they were
    detected otherwise."""
    langs = FileLanguages()
    p = [piece(0, i) for i in range(10)]
    for q in p:
        langs.admit(q)
    guesses = [("ro", 0.55), ("ro", 0.45), ("ro", 0.4), ("ro", 0.5), ("ro", 0.5), ("no", 0.6), ("nn", 0.7), ("no", 0.3)]
    results = [Result(f"Hei {i}.", language=lang, language_probability=pr) for i, (lang, pr) in enumerate(guesses)]
    for i in range(7):
        final, again = langs.decided(p[i], results[i])
        assert final == ([] if i < 2 else [(p[i - 2], results[i - 2])]) and again == [p[i + 1]]
    # Of the three waiting, nn 0.7 against no 0.9: Norwegian Bokmål (all eight: Romanian), the
    # Nynorsk piece again
    assert langs.decided(p[7], results[7]) == ([(p[5], results[5]), (p[7], results[7])], [p[6], p[8], p[9]])
    assert langs.language(p[6]) == "no"


def test_the_end_of_the_file_decides_between_the_unsure_probes():
    """A file whose every piece probed without a sure one: the vote, when its worker says it has
    cut them all (before or after the last one is decoded)."""
    langs = FileLanguages()
    p0, p1 = piece(0, 0), piece(0, 1)
    langs.admit(p0), langs.admit(p1)
    a = Result("Ciao.", language="it", language_probability=0.6)
    b = Result("Hola.", language="es", language_probability=0.7)
    assert langs.decided(p0, a) == ([], [p1])
    assert langs.ended(0, 2) == ([], [])  # p1 is still to be decoded
    assert langs.decided(p1, b) == ([(p1, b)], [p0])  # es 0.7 over it 0.6
    one = piece(1, 0)  # a one-piece file, cut before it is decoded
    langs.admit(one)
    assert langs.ended(1, 1) == ([], [])
    c = Result("Ciao.", language="it", language_probability=0.6)
    assert langs.decided(one, c) == ([(one, c)], [])  # nothing else to ask: it stands
    two = [piece(2, 0), piece(2, 1)]  # decoded before its worker said it was done
    langs.admit(two[0]), langs.admit(two[1])
    assert langs.decided(two[0], c) == ([], [two[1]])
    assert langs.decided(two[1], Result("")) == ([(two[1], Result(""))], [])
    assert langs.ended(2, 2) == ([(two[0], c)], [])


def test_a_failed_file_gives_the_held_and_unsure_pieces_back():
    langs = FileLanguages()
    p0, p1, p2 = (piece(0, i) for i in range(3))
    langs.admit(p0), langs.admit(p1), langs.admit(p2)
    langs.decided(p0, Result("Hm.", language="cy", language_probability=0.3))  # unsure: kept aside
    assert sorted(p.index for p in langs.forget(0)) == [0, 2]  # p1 went to the batcher
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

    def fail(self, file, error, seconds=None):
        self.failed.append(error)

    def finished(self, file, result, seconds):
        self.finished_files.append(file)

    def flush(self):
        pass


class _Detecting:
    """An engine that detects "de" and fails on the piece with 7 frames, alone or in a batch."""

    name, device, settings, sample_rate, bucket_edges_s = "stub", "cpu", {}, 16000, (30.0,)
    detects_language, stage_seconds = True, {}

    def transcribe_features(self, views, languages=None, after_pause=None):
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
    job.stats = pipeline.RunStats()
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
