"""Subtitle cues: long segments cut on word times into cues a viewer can read."""
import math
import random
import re

from transcribe.results import Result, Segment, Word
from transcribe.subtitles import (MAX_CUE_CHARS, MAX_CUE_PAUSE_SECONDS, MAX_CUE_SECONDS, MAX_LINE_CHARS, MIN_CUE_SECONDS,
                                 _timed_tokens, _Token, cues, wrap)
from transcribe.writers import needs_words, write_srt


def _speech(n_words: int, seed: int, t0: float = 0.0, pause_every: int = 0) -> tuple[list[Word], str]:
    """Words of 1-12 letters, some ending in a comma, 0.2-0.5 s each with short gaps."""
    rng = random.Random(seed)
    words, t = [], t0
    for i in range(n_words):
        w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.1:
            w += ","
        d = rng.uniform(0.2, 0.5)
        words.append(Word(w, t, t + d))
        t += d + rng.uniform(0.0, 0.15) + (1.5 if pause_every and i % pause_every == pause_every - 1 else 0.0)
    return words, " ".join(w.word for w in words)


def _fits(cue_words: list[Word]) -> bool:
    text = " ".join(w.word for w in cue_words)
    lines = wrap([_Token(t, 0.0, 0.0) for t in text.split()])
    return (len(text) <= MAX_CUE_CHARS and cue_words[-1].end - cue_words[0].start <= MAX_CUE_SECONDS
            and max(map(len, lines)) <= MAX_LINE_CHARS)


def _fewest_cues(words: list[Word]) -> int:
    """Greedy packing: the fewest cues possible, since any run inside a cue that fits fits;
    a pause of MAX_CUE_PAUSE_SECONDS between words ends one."""
    count, cur = 0, []
    for w in words:
        if cur and (not _fits(cur + [w]) or w.start - cur[-1].end >= MAX_CUE_PAUSE_SECONDS):
            count, cur = count + 1, []
        cur.append(w)
    return count + (1 if cur else 0)


def test_long_segments_become_the_fewest_readable_cues_with_their_words_times():
    for seed in range(20):
        words, text = _speech(120, seed, t0=3.0, pause_every=17 if seed % 2 else 0)
        seg = Segment(text, words[0].start - 0.1, words[-1].end + 0.1)
        tail_words, tail = _speech(4, seed + 100, t0=seg.end + 1.0)
        result = Result(text + " " + tail, words + tail_words, [seg, Segment(tail, tail_words[0].start, tail_words[-1].end)])
        got = cues(result)
        assert " ".join(" ".join(c.lines) for c in got) == result.text
        assert got[0].start == seg.start and got[-1].end == tail_words[-1].end
        for a, b in zip(got, got[1:]):
            assert a.start <= a.end <= b.start
        inner = got[:-1]  # the short tail segment is its own cue
        assert len(inner) == _fewest_cues(words), seed
        for c in inner:
            assert 1 <= len(c.lines) <= 2 and all(len(line) <= MAX_LINE_CHARS for line in c.lines), c
            assert sum(map(len, c.lines)) + len(c.lines) - 1 <= MAX_CUE_CHARS
            assert c.end - c.start <= MAX_CUE_SECONDS + 0.1 + 1e-9  # + the segment's own margin
        # Each cue's times are its first and last words' (the segment's at its two ends).
        spelled = iter(words)
        for k, c in enumerate(inner):
            first = next(spelled)
            for _ in range(len(" ".join(c.lines).split()) - 1):
                last = next(spelled)
            last = last if len(" ".join(c.lines).split()) > 1 else first
            start, end = (seg.start if k == 0 else first.start), (seg.end if k == len(inner) - 1 else last.end)
            if end - start >= MIN_CUE_SECONDS:
                assert (c.start, c.end) == (start, end)
            else:  # a cue too short to read takes time from the silence around it
                assert c.start <= start and c.end >= end and c.end - c.start <= MIN_CUE_SECONDS + 1e-9


def test_a_cut_after_punctuation_wins_when_it_costs_no_extra_cue():
    words = [Word(w, 0.4 * i, 0.4 * i + 0.3) for i, w in enumerate(
        "the committee met on tuesday, and after a long debate it voted to approve the plan for the new bridge".split())]
    text = " ".join(w.word for w in words)
    (first, second) = cues(Result(text, words, [Segment(text, 0.0, words[-1].end)]))
    assert " ".join(first.lines) == "the committee met on tuesday,"
    assert second.start == words[5].start


def test_words_split_inside_a_text_token_time_it_together():
    """Whisper's words split "self-substantial" into "self" and "-substantial"; the text keeps
    the token whole, timed from the first part's start to the last part's end."""
    words = [Word("a", 0.0, 0.4), Word("self", 6.5, 6.8), Word("-substantial", 6.8, 7.6), Word("b.", 8.0, 8.4)]
    text = "a self-substantial b."
    (tokens,) = _timed_tokens([Segment(text, 0.0, 8.4)], words)
    assert [(t.text, t.start, t.end) for t in tokens] == [
        ("a", 0.0, 0.4), ("self-substantial", 6.5, 7.6), ("b.", 8.0, 8.4)]
    assert _timed_tokens([Segment(text, 0.0, 8.4)], words[:-1]) is None  # a word short


def test_words_that_do_not_spell_the_text_leave_one_cue_per_segment():
    words, text = _speech(60, 7)
    wrong = words[:-1] + [Word("other", words[-1].start, words[-1].end)]
    segs = [Segment(text, 0.0, words[-1].end)]
    (cue,) = cues(Result(text, wrong, segs))
    assert (cue.start, cue.end) == (0.0, words[-1].end) and " ".join(cue.lines) == text
    (cue,) = cues(Result(text, [], segs))  # no word times at all (Whisper without alignment)
    assert len(cue.lines) == 2


def test_overlapping_word_times_never_overlap_cues():
    words, text = _speech(80, 3)
    early = [Word(w.word, max(0.0, w.start - 0.3), w.end) for w in words]  # each starts before the last ends
    got = cues(Result(text, early, [Segment(text, 0.0, early[-1].end)]))
    assert len(got) > 2
    for a, b in zip(got, got[1:]):
        assert a.start <= a.end <= b.start


def test_one_word_longer_than_a_cue_is_a_cue_of_its_own():
    long = "x" * 100
    words = [Word("a", 0.0, 0.2), Word(long, 0.3, 9.0), Word("b", 9.1, 9.3)]
    text = f"a {long} b"
    got = cues(Result(text, words, [Segment(text, 0.0, 9.3)]))
    assert [c.lines for c in got] == [("a",), (long,), ("b",)]


def test_srt_writes_the_cues_and_subtitles_ask_for_word_times():
    words, text = _speech(40, 11)
    srt = write_srt(Result(text, words, [Segment(text, 0.0, words[-1].end)]))
    blocks = srt.strip().split("\n\n")
    assert len(blocks) == len(cues(Result(text, words, [Segment(text, 0.0, words[-1].end)]))) >= math.ceil(len(text) / MAX_CUE_CHARS)
    assert all(len(line) <= MAX_LINE_CHARS for b in blocks for line in b.splitlines()[2:])
    assert needs_words(["srt"]) and needs_words(["vtt"]) and needs_words(["json"]) and not needs_words(["txt"])


def _columns(line: str) -> int:
    return sum(2 if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef" else 1 for ch in line)


def test_text_without_spaces_is_cut_between_its_words_by_display_width():
    """Chinese: Whisper's words are a few characters each and the segment text one run without
    spaces. It is cut between words (never inside one), rejoined without spaces, and a wide
    character takes two columns of a line."""
    rng = random.Random(5)
    hanzi = [chr(c) for c in range(0x4E00, 0x4E00 + 200)]
    words, t = [], 0.0
    for i in range(60):
        w = "".join(rng.choice(hanzi) for _ in range(rng.randint(1, 3))) + ("，" if i % 7 == 6 else "")
        words.append(Word(w, t, t + 0.22 * len(w)))
        t += 0.22 * len(w) + 0.05
    text = "".join(w.word for w in words)
    got = cues(Result(text, words, [Segment(text, 0.0, words[-1].end)]))
    assert "".join("".join(c.lines) for c in got) == text
    assert len(got) >= math.ceil(sum(map(_columns, text)) / MAX_CUE_CHARS)
    starts = {w.start for w in words}
    for c in got[:-1]:
        assert all(_columns(line) <= MAX_LINE_CHARS for line in c.lines) and len(c.lines) <= 2, c
        assert c.end - c.start <= MAX_CUE_SECONDS + 1e-9
    assert all(c.start in starts for c in got[1:])  # every cut falls between two words
    # Mixed with spaced words: the spaces stay where the text has them, no others are added.
    mixed = [Word("我们用", 0.0, 0.6), Word("Python", 0.7, 1.1), Word("写", 1.2, 1.4), Word("代码。", 1.4, 2.0)]
    mtext = "我们用 Python 写代码。"
    (tokens,) = _timed_tokens([Segment(mtext, 0.0, 2.0)], mixed)
    assert [(t.text, t.glued) for t in tokens] == [("我们用", False), ("Python", False), ("写", False), ("代码。", True)]
    assert wrap(tokens) == (mtext,)


def _spans(result: Result) -> list[tuple[float, float, str]]:
    """Each cue's times (to the microsecond: no float noise) and text."""
    return [(round(c.start, 6), round(c.end, 6), " ".join(c.lines)) for c in cues(result)]


def _plain(*segments: tuple[float, float, str]) -> Result:
    """Segments whose words share their times (one word per segment, or words spread evenly)."""
    words = []
    for a, b, text in segments:
        parts = text.split()
        step = (b - a) / len(parts)
        words += [Word(w, a + k * step, a + (k + 1) * step) for k, w in enumerate(parts)]
    return Result(" ".join(t for _, _, t in segments), words, [Segment(t, a, b) for a, b, t in segments])


def test_a_segment_of_no_length_is_shown_in_the_silence_around_its_time():
    """A zero-length cue is skipped or flashed by players. Whisper's tails made one: a tune's
    "Muzica", moved by its word times past the 2 s where its tail was decoded from, was capped
    there (2.0-2.0, `whisper_engine._decode_tails`); a TDT word of duration 0 makes a one-word
    segment of no length. Such a cue gets up to MIN_CUE_SECONDS of the silence around
    it, centred on its time where there is room; no other cue moves."""
    assert _spans(_plain((2.0, 2.0, "Muzica"), (2.0, 5.74, "Bă, bă."))) == [
        (1.0, 2.0, "Muzica"), (2.0, 5.74, "Bă, bă.")]
    assert _spans(_plain((0.5, 1.5, "one two"), (3.0, 3.0, "three"), (4.0, 5.0, "four"))) == [
        (0.5, 1.5, "one two"), (2.5, 3.5, "three"), (4.0, 5.0, "four")]
    assert _spans(_plain((0.5, 2.9, "one"), (3.0, 3.0, "three"), (3.2, 5.0, "four"))) == [
        (0.5, 2.9, "one"), (2.9, 3.2, "three"), (3.2, 5.0, "four")]
    assert _spans(_plain((0.5, 1.0, "one"), (7.0, 7.0, "last"))) == [(0.25, 1.25, "one"), (6.5, 7.5, "last")]
    # No silence on either side: its words join the cue that begins at its time.
    assert _spans(_plain((1.0, 2.0, "one"), (2.0, 2.0, "two"), (2.0, 2.0, "three"), (2.0, 3.0, "four"))) == [
        (1.0, 2.0, "one"), (2.0, 3.0, "two three four")]
    # Times that differ by less than the millisecond srt shows are no length either.
    (a, b) = cues(_plain((1.0, 2.0, "one"), (2.5001, 2.5004, "two")))
    assert (round(b.start, 3), round(b.end, 3)) == (2.0, 3.0)


def test_words_joined_to_the_next_cue_are_cut_again_when_they_overfill_it():
    """A zero-length segment between cues that meet at its time joins the next cue: ten words
    of it made one cue of two 69-character lines, past the two lines of 42 a cue holds. The
    joined cue is cut again, its time shared among the parts."""
    ten = " ".join(f"word{k:02d}x" for k in range(10))
    after = "and the words after it here"
    result = _plain((0.0, 5.0, "before the pause"), (5.0, 5.0, ten), (5.0, 10.0, after))
    got = _spans(result)
    assert [t for _, _, t in got] == ["before the pause", ten, after]
    assert got[1][0] == 5.0 and got[-1][1] == 10.0 and got[1][1] == got[2][0] and 5.0 < got[1][1] < 10.0
    assert all(len(c.lines) <= 2 and max(map(len, c.lines)) <= MAX_LINE_CHARS for c in cues(result))
    # Joined words that still fit stay one cue, with its times.
    assert _spans(_plain((0.0, 5.0, "before"), (5.0, 5.0, "two words"), (5.0, 10.0, "after"))) == [
        (0.0, 5.0, "before"), (5.0, 10.0, "two words after")]


def test_a_last_cue_of_no_length_stays_within_the_audio():
    """The last cue has only the audio's end after it, not all time: the rnnt_tiny fixture on
    the 816.105 s 100utt_concat file gave a last cue 816.010-817.010, past the file's end,
    where the stitched times (`stitching.stitch`) put its words at 816.010. It takes its
    moment before the end; with no room there either, its words join the cue before it."""
    from transcribe.stitching import stitch

    piece = Result("one. two", [Word("one.", 0.2, 9.0), Word("two", 9.95, 10.4)],
                   [Segment("one.", 0.2, 9.0), Segment("two", 9.95, 10.4)])
    assert _spans(stitch([piece], [0.0], 9.95)) == [(0.2, 9.0, "one."), (9.0, 9.95, "two")]
    assert _spans(stitch([piece], [0.0], 9.0)) == [(0.2, 9.0, "one. two")]
    assert _spans(stitch([piece], [0.0])) == [(0.2, 9.0, "one."), (9.675, 10.675, "two")]  # no end known


def test_a_first_cue_of_no_length_stays_within_a_manifest_segment():
    """A manifest segment's audio begins at its offset, not at 0: a first cue of no length at
    its start (a TDT word of duration 0 with its full stop) took half a second before it,
    15.0-16.0 for the segment from 15.5 s, a time whose audio is not in the segment."""
    from transcribe.stitching import stitch

    piece = Result("a. b", [Word("a.", 0.0, 0.0), Word("b", 2.0, 2.5)], [Segment("a.", 0.0, 0.0), Segment("b", 2.0, 2.5)])
    assert _spans(stitch([piece], [15.5], 30.0)) == [(15.5, 16.5, "a."), (17.25, 18.25, "b")]
    assert _spans(stitch([piece], [0.0], 30.0))[0] == (0.0, 1.0, "a.")


def test_overlapping_segments_end_the_earlier_cue_and_out_of_order_ones_wait():
    """Whisper's word times can end a segment after the next begins, or move one past the
    next: the earlier cue ends where the later begins (every cue appears as its words are
    heard); a cue that begins before the one it follows waits for it to end."""
    assert _spans(_plain((1.0, 4.2, "one two"), (4.0, 7.0, "three"))) == [
        (1.0, 4.0, "one two"), (4.0, 7.0, "three")]
    assert _spans(_plain((2.5, 5.0, "one"), (2.0, 6.0, "two"))) == [(2.5, 5.0, "one"), (5.0, 6.0, "two")]
    assert _spans(_plain((2.5, 5.0, "one"), (2.0, 4.0, "two"), (9.0, 9.5, "three"))) == [
        (2.5, 5.0, "one"), (5.0, 6.0, "two"), (8.75, 9.75, "three")]


def _cue_times(subtitles: str) -> list[tuple[int, int]]:
    """Each cue's (start, end) in milliseconds, as an srt or a vtt says."""
    clock = r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d)"
    ms = lambda h, m, s, f: ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000 + int(f)  # noqa: E731
    return [(ms(*c[:4]), ms(*c[4:])) for c in re.findall(clock + " --> " + clock, subtitles)]


def test_srt_and_vtt_cues_always_have_length_and_never_overlap():
    """Random segments, some of no length, overlapping, out of order, a fraction of a
    millisecond apart, with their words (or none): every cue of the srt and the vtt lasts at
    least 1 ms, begins no earlier than the one before ends, and the cues spell the text."""
    from transcribe.writers import write_vtt

    rng = random.Random(3)
    for trial in range(300):
        segments, t = [], rng.uniform(0, 2)
        for k in range(rng.randint(1, 8)):
            kind = rng.random()
            length = 0.0 if kind < 0.3 else rng.choice([0.0002, 0.3, 2.0, 9.0])
            start = t - rng.uniform(0, 3) if kind > 0.8 else t + rng.choice([0.0, 0.0, 0.0004, 0.5])
            segments.append((max(0.0, start), max(0.0, start) + length, f"w{trial}x{k} y{k}"))
            t = max(t, start + length)
        result = _plain(*segments)
        if trial % 3 == 0:
            result = Result(result.text, [], result.segments)
        for text in (write_srt(result), write_vtt(result)):
            times = _cue_times(text)
            assert len(times) == len(cues(result)) and all(b > a for a, b in times), (segments, times)
            assert all(b[0] >= a[1] for a, b in zip(times, times[1:])), (segments, times)
        assert " ".join(" ".join(c.lines) for c in cues(result)).split() == result.text.split()


def test_no_cue_is_shown_through_a_long_pause():
    """"and so" (10.0-10.5 s), 5 s of silence, "we left the house": one segment (a Parakeet
    sentence runs on over a long file's pauses) came out as one cue from 10.0 to 16.5 s, its
    later words on screen seconds before they are heard. A pause of MAX_CUE_PAUSE_SECONDS or
    more between words ends a cue; a shorter one does not."""
    words = [Word("and", 10.0, 10.2), Word("so", 10.3, 10.5), Word("we", 15.5, 15.7), Word("left", 15.8, 16.0),
             Word("the", 16.05, 16.2), Word("house.", 16.25, 16.5)]
    text = " ".join(w.word for w in words)
    got = _spans(Result(text, words, [Segment(text, 10.0, 16.5)]))
    assert got == [(9.75, 10.75, "and so"), (15.5, 16.5, "we left the house.")]  # the first made 1 s long
    near = [Word("and", 10.0, 10.2), Word("so", 10.3, 10.5), Word("we", 10.5 + MAX_CUE_PAUSE_SECONDS - 0.01, 12.5)]
    assert len(cues(Result("and so we", near, [Segment("and so we", 10.0, 12.5)]))) == 1


def test_a_short_cue_is_shown_long_enough_to_read_in_the_silence_around_it():
    """"And on." timed to its 0.2 s of speech flashed by, with a second of silence after it. A
    cue shorter than MIN_CUE_SECONDS takes up to that much of the silence around it, centred on
    its time; it never covers another cue or leaves the audio, and a long one keeps its times."""
    assert _spans(_plain((1.0, 1.2, "And on."), (3.0, 5.0, "Then we left."))) == [
        (0.6, 1.6, "And on."), (3.0, 5.0, "Then we left.")]
    assert _spans(_plain((1.0, 2.0, "one"), (2.1, 2.4, "two"), (2.6, 4.0, "three"))) == [
        (1.0, 2.0, "one"), (2.0, 2.6, "two"), (2.6, 4.0, "three")]  # all the room there is
    assert _spans(_plain((0.1, 0.3, "hi"), (3.0, 5.0, "there"))) == [(0.0, 1.0, "hi"), (3.0, 5.0, "there")]
