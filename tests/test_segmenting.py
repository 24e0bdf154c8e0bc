"""Cutting long audio at pauses, and stitching piece results back with file times."""
import numpy as np

from transcribe.results import Result, Segment, Word
from transcribe.segmenting import split_long
from transcribe.stitching import stitch


def test_short_audio_is_one_piece():
    a = np.ones(16000, dtype=np.float32)
    assert [(o, len(p)) for o, p in split_long(a, 16000, 2.0)] == [(0.0, 16000)]


def test_long_audio_is_cut_in_the_pause():
    rng = np.random.default_rng(0)
    sr = 16000
    a = rng.standard_normal(sr * 25).astype(np.float32)
    a[int(8.5 * sr) : int(9.0 * sr)] = 0.0  # a pause inside the search window of the first cut
    pieces = split_long(a, sr, 10.0)
    assert 8.5 <= pieces[1][0] <= 9.0
    assert all(len(p) <= 10 * sr for _, p in pieces)
    assert np.array_equal(np.concatenate([p for _, p in pieces]), a)  # nothing lost or repeated


def test_stitch_moves_times_by_offsets():
    r1 = Result(text="a b", words=[Word("a", 0.0, 0.1), Word("b", 0.2, 0.3)], segments=[Segment("a b", 0.0, 0.3)], tokens=[1, 2])
    r2 = Result(text="c", words=[Word("c", 0.5, 0.6)], segments=[Segment("c", 0.5, 0.6)], tokens=[3])
    s = stitch([r1, r2], [0.0, 10.0])
    assert s.text == "a b c"
    assert [(w.word, w.start) for w in s.words] == [("a", 0.0), ("b", 0.2), ("c", 10.5)]
    assert s.segments[1].start == 10.5 and s.tokens == [1, 2, 3]
