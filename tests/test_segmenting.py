"""Cutting long audio at pauses, and stitching piece results back with file times."""
import numpy as np
import pytest

from transcribe.results import Result, Segment, Word
from transcribe.segmenting import PieceCutter, split_long
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


def test_a_pause_the_vad_joins_to_soft_speech_is_cut_where_it_is_quiet():
    """A quiet voice (a sick speaker, a trailing word) can be non-speech to the VAD, which joins
    it to the pause after it: the run's middle then fell in the words (whisper-base lost "in
    the original one" on a real recording). The cut is the run's quietest 100 ms."""
    sr, rng = 16000, np.random.default_rng(0)

    def speechy(seconds, level):  # noise with a 4 Hz syllable envelope
        t = np.arange(int(seconds * sr)) / sr
        return (level * rng.standard_normal(t.size) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))).astype(np.float32)

    a = np.concatenate([speechy(14, 0.1), speechy(2.0, 0.004), speechy(1.0, 0.0003), speechy(10, 0.1)])
    (offset, _), = split_long(a, sr, 20.0)[1:]
    assert 16.0 + 0.05 <= offset <= 17.0 - 0.05  # in the silence, not the soft speech before it


@pytest.mark.parametrize("seconds", [12.0, 29.5, 30.0])
def test_a_file_that_fits_max_seconds_stays_whole_whatever_cut_seconds(seconds):
    a = np.random.default_rng(1).standard_normal(int(seconds * 16000)).astype(np.float32)
    assert [(o, len(p)) for o, p in split_long(a, 16000, 30.0, cut_seconds=10.0)] == [(0.0, len(a))]


@pytest.mark.parametrize("seconds", [30.5, 31.2, 47.0, 95.0])
def test_longer_files_are_tiled_with_pieces_of_cut_seconds(seconds):
    sr = 16000
    rng = np.random.default_rng(2)
    a = rng.standard_normal(int(seconds * sr)).astype(np.float32)
    for t in np.arange(6.0, seconds, 7.0):  # pauses every 7 s
        a[int(t * sr):int((t + 0.4) * sr)] = 0.0
    pieces = split_long(a, sr, 30.0, cut_seconds=20.0)
    assert len(pieces) >= 2 and all(len(p) <= 20 * sr for _, p in pieces)
    assert np.array_equal(np.concatenate([p for _, p in pieces]), a)  # nothing lost or repeated
    assert [o for o, _ in pieces] == [0.0] + list(np.cumsum([len(p) for _, p in pieces[:-1]]) / sr)
    # The workers' streaming cutter (2 s blocks) cuts exactly where the one-shot split does.
    cutter, streamed = PieceCutter(sr, 30.0, cut_seconds=20.0), []
    for i in range(0, len(a), 2 * sr):
        streamed += cutter.push(a[i:i + 2 * sr])
    streamed += cutter.finish()
    assert [(o / sr, len(p)) for o, p in streamed] == [(o, len(p)) for o, p in pieces]


def test_cut_seconds_may_not_exceed_max_seconds():
    with pytest.raises(ValueError, match="cut_seconds"):
        PieceCutter(16000, 20.0, cut_seconds=30.0)


def test_stitch_moves_times_by_offsets():
    r1 = Result(text="a b", words=[Word("a", 0.0, 0.1), Word("b", 0.2, 0.3)], segments=[Segment("a b", 0.0, 0.3)], tokens=[1, 2])
    r2 = Result(text="c", words=[Word("c", 0.5, 0.6)], segments=[Segment("c", 0.5, 0.6)], tokens=[3])
    s = stitch([r1, r2], [0.0, 10.0])
    assert s.text == "a b c"
    assert [(w.word, w.start) for w in s.words] == [("a", 0.0), ("b", 0.2), ("c", 10.5)]
    assert s.segments[1].start == 10.5 and s.tokens == [1, 2, 3]


def test_stitched_times_of_a_piece_end_where_the_next_begins():
    """A transducer's last word can end past its piece (a TDT duration, the frame grid): cut
    back to the next piece's start, so words and cues never overlap across pieces; the last
    piece keeps its own times, as a whole file does."""
    r1 = Result(text="a b", words=[Word("a", 0.0, 0.1), Word("b", 9.9, 10.3)], segments=[Segment("a b", 0.0, 10.3)])
    r2 = Result(text="c", words=[Word("c", 0.0, 0.4)], segments=[Segment("c", 0.0, 0.4)])
    r3 = Result(text="d", words=[Word("d", 4.8, 5.3)], segments=[Segment("d", 4.8, 5.3)])
    s = stitch([r1, r2, r3], [0.0, 10.0, 20.0])
    assert [(w.word, w.start, w.end) for w in s.words] == [("a", 0.0, 0.1), ("b", 9.9, 10.0), ("c", 10.0, 10.4),
                                                           ("d", 24.8, 25.3)]
    assert [(g.start, g.end) for g in s.segments] == [(0.0, 10.0), (10.0, 10.4), (24.8, 25.3)]
    alone = stitch([r1], [0.0])
    assert alone.words[-1].end == 10.3 and alone.segments[-1].end == 10.3


def test_stitched_times_never_start_before_their_piece():
    """Whisper's alignment gives a token at the first audio frame -0.02 s (OpenAI's DTW border
    step): a 30 ms file's JSON said `"start": -0.02`. Times before a piece's start are its start."""
    r = Result(text="you", words=[Word("you", -0.02, -0.02)], segments=[Segment("you", -0.02, -0.02)])
    alone = stitch([r], [0.0], duration=0.03)
    assert (alone.words[0].start, alone.words[0].end, alone.segments[0].start) == (0.0, 0.0, 0.0)
    later = stitch([Result(text="a", words=[Word("a", 0.0, 0.5)], segments=[Segment("a", 0.0, 0.5)]), r], [0.0, 10.0])
    assert [(w.start, w.end) for w in later.words] == [(0.0, 0.5), (10.0, 10.0)]


def test_pieces_of_an_unspaced_script_join_without_a_space_and_keep_their_own_segments():
    """Whisper's pieces of Chinese were joined with a space at every cut ("感觉 阿娜"), in the
    text and where a window's tail is decoded on; a space stays between words of a spaced
    script, and where only one side is unspaced. Without sentence delimiters (Whisper's
    segments are its timestamp spans) each piece keeps its segments, even unpunctuated."""
    from transcribe.stitching import join_texts

    zh = [Result(text="有太多的感觉", segments=[Segment("有太多的感觉", 0.0, 2.0)]),
          Result(text=" 阿娜。", segments=[Segment("阿娜。", 0.0, 1.0)])]
    s = stitch(zh, [0.0, 13.33])
    assert s.text == "有太多的感觉阿娜。" and [g.text for g in s.segments] == ["有太多的感觉", "阿娜。"]
    assert join_texts(["the end", " 阿娜", "", "and more "]) == "the end 阿娜 and more"
    assert join_texts(["สวัสดี", "ครับ"]) == "สวัสดีครับ"


def test_a_transducer_sentence_over_a_cut_is_one_segment():
    """With the transducer's sentence delimiters a segment runs on over a cut until a word
    ending in . ? ! (NeMo decodes a long file whole: its segments split only there); a piece
    opening with the "." of the sentence before gives it to that sentence's last word."""
    from transcribe.timestamps import DEFAULT_SEGMENT_DELIMITERS

    r1 = Result(text="we left the", words=[Word("we", 0.0, 0.2), Word("left", 0.3, 0.6), Word("the", 0.7, 0.8)],
                segments=[Segment("we left the", 0.0, 0.8)])
    r2 = Result(text="house. And then", words=[Word("house.", 0.1, 0.5), Word("And", 1.0, 1.2), Word("then", 1.3, 1.5)],
                segments=[Segment("house.", 0.1, 0.5), Segment("And then", 1.0, 1.5)])
    r3 = Result(text=". Fine", words=[Word(".", 0.0, 0.0), Word("Fine", 0.2, 0.6)],
                segments=[Segment(".", 0.0, 0.0), Segment("Fine", 0.2, 0.6)])
    s = stitch([r1, r2, r3], [0.0, 10.0, 20.0], 30.0, DEFAULT_SEGMENT_DELIMITERS)
    assert [(g.text, g.start, g.end) for g in s.segments] == [
        ("we left the house.", 0.0, 10.5), ("And then.", 11.0, 11.5), ("Fine", 20.2, 20.6)]
    assert [w.word for w in s.words] == ["we", "left", "the", "house.", "And", "then.", "Fine"]
    assert s.words[5].end == 11.5 and s.text == "we left the house. And then. Fine"
    kept = stitch([r1, r2, r3], [0.0, 10.0, 20.0], 30.0)  # Whisper's way: each piece's segments
    assert [g.text for g in kept.segments] == ["we left the", "house.", "And then", ".", "Fine"]
