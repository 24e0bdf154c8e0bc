"""Word / segment timestamps from decoded tokens vs NeMo's `timestamps['word']`, exactly."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from conftest import NEMO_REF, Reference, needs_shared
from engines.checkpoint import NemoArchive
from engines.ctc import greedy_ctc
from engines.tokenizer import Tokenizer
from engines.transducer import TransducerDecoder
from transcribe.results import Segment, Word
from transcribe.timestamps import FrameTiming, _Span, build_result, segment_spans

TIMING = FrameTiming(window_stride=0.01, subsampling_factor=8)


@lru_cache(maxsize=None)
def parts(variant: str) -> tuple[TransducerDecoder, Tokenizer]:
    archive = NemoArchive(NEMO_REF / variant / "model.nemo")
    return TransducerDecoder.from_archive(archive), Tokenizer.from_archive(archive)


@lru_cache(maxsize=None)
def hypothesis(variant: str, i: int):
    enc = torch.from_numpy(Reference(variant).array("encoder", i))
    return parts(variant)[0].decode(enc[None], torch.tensor([enc.shape[1]]))[0]


def result_for(ref: Reference, i: int, offset_s: float = 0.0):
    dec, tok = parts(ref.dir.name)
    hyp = hypothesis(ref.dir.name, i)
    timing = FrameTiming(dec.config.window_stride, dec.config.subsampling_factor)
    kind = "tdt" if dec.config.is_tdt else "rnnt"
    return build_result(tok, hyp.tokens, hyp.frames, hyp.durations, kind, timing, offset_s=offset_s)


def test_words_equal_nemo_exactly(reference: Reference):
    for i, f in enumerate(reference.files):
        res = result_for(reference, i)
        got = [{"word": w.word, "start": w.start, "end": w.end} for w in res.words]
        assert got == f["words"], f"file {i}"  # strings and float times, bit for bit
        assert res.text == f["transcribe_text"]
        assert res.tokens == f["tokens"]


def test_segments_cover_words(reference: Reference):
    # these vocabularies hold no '.', '?' or '!': one segment per file, as NeMo produces
    for i in range(len(reference.files)):
        res = result_for(reference, i)
        assert res.segments == [Segment(" ".join(w.word for w in res.words), res.words[0].start, res.words[-1].end)]


@needs_shared
def test_rnnt_words_from_nemo_token_frames():
    """RNN-T needs no durations: NeMo's own token frames give NeMo's words."""
    ref = Reference("rnnt_tiny")
    _, tok = parts("rnnt_tiny")
    for i, f in enumerate(ref.files):
        res = build_result(tok, ref.array("tokens", i), ref.array("token_frames", i).tolist(), [], "rnnt", TIMING)
        assert [(w.word, w.start, w.end) for w in res.words] == [(w["word"], w["start"], w["end"]) for w in f["words"]]
    assert any(w["word"] == " \u2047 " for w in ref.files[0]["words"])  # each <unk> is its own word


@needs_shared
def test_offset_shifts_every_time():
    ref = Reference("tdt_tiny")
    base, shifted = result_for(ref, 2), result_for(ref, 2, offset_s=30.0)
    assert [w.word for w in shifted.words] == [w.word for w in base.words]
    for a, b in zip(base.words + base.segments, shifted.words + shifted.segments):
        assert b.start == pytest.approx(a.start + 30.0, abs=1e-9) and b.end == pytest.approx(a.end + 30.0, abs=1e-9)


@needs_shared
def test_tdt_punctuation_is_pinned_to_previous_word():
    _, tok = parts("tdt_tiny")
    # '▁the'@0 (2 frames), "'"@9: the apostrophe is glued to "the" and gets a zero-length span at 2
    res = build_result(tok, [10, 121, 3], [0, 9, 12], [2, 1, 1], "tdt", TIMING)
    assert res.words == [Word("the'", 0.0, 2 * 0.01 * 8), Word("t", 12 * 0.01 * 8, 13 * 0.01 * 8)]
    # RNN-T: no refinement, one frame per token
    res = build_result(tok, [10, 121, 3], [0, 9, 12], [], "rnnt", TIMING)
    assert res.words == [Word("the'", 0.0, 10 * 0.01 * 8), Word("t", 12 * 0.01 * 8, 13 * 0.01 * 8)]


@needs_shared
def test_unk_and_bare_space_words():
    _, tok = parts("tdt_tiny")
    # '▁the' 're' '<unk>' 're' '▁' 'e': unk starts a word; a bare '▁' starts the next word
    res = build_result(tok, [10, 7, 0, 7, 100, 101], [0, 1, 2, 3, 4, 5], [], "rnnt", TIMING)
    assert [w.word for w in res.words] == ["there", " \u2047 re", "e"]
    assert [w.start for w in res.words] == [0.0, 2 * 0.01 * 8, 4 * 0.01 * 8]
    assert res.text == "there \u2047 re e"


def _words(*items: tuple[str, int, int]) -> list[_Span]:
    return [_Span(text, "", start, end) for text, start, end in items]


def test_segments_split_on_sentence_punctuation():
    words = _words(("Hello", 0, 2), ("world.", 3, 5), ("How", 6, 7), ("are", 7, 8), ("you?", 8, 9), ("Fine", 20, 22))
    segs = segment_spans(words)
    assert [(s.text, s.start, s.end) for s in segs] == [
        ("Hello world.", 0, 5), ("How are you?", 6, 9), ("Fine", 20, 22)]


def test_segments_split_on_long_gaps_too():
    words = _words(("a", 0, 1), ("b", 2, 3), ("c.", 3, 4), ("d", 30, 31), ("e", 31, 32))
    segs = segment_spans(words, max_gap_frames=10)
    assert [(s.text, s.start, s.end) for s in segs] == [("a b c.", 0, 4), ("d e", 30, 32)]
    segs = segment_spans(_words(("a", 0, 1), ("b", 25, 26)), max_gap_frames=10)
    assert [s.text for s in segs] == ["a", "b"]
    assert [s.text for s in segment_spans(_words(("a", 0, 1), ("b", 25, 26)))] == ["a b"]


@needs_shared
def test_build_result_gap_in_seconds_and_edge_cases():
    _, tok = parts("tdt_tiny")
    res = build_result(tok, [10, 3], [0, 40], [1, 1], "tdt", TIMING, max_gap_s=1.0)
    assert [s.text for s in res.segments] == ["the", "t"]
    empty = build_result(tok, [], [], [], "tdt", TIMING)
    assert (empty.text, empty.words, empty.segments, empty.tokens) == ("", [], [], [])
    with pytest.raises(ValueError, match="one frame and duration per token"):
        build_result(tok, [10, 3], [0, 1], [1], "tdt", TIMING)


@needs_shared
def test_no_word_or_segment_ends_before_it_starts_in_the_json():
    """Random greedy outputs (TDT durations of 0 included, which give words and one-word
    segments of no length), stitched as pieces of a file with its times capped at the next
    piece and the file's end: every word and segment the json holds ends no earlier than it
    starts."""
    import json
    import random

    from transcribe.stitching import stitch
    from transcribe.writers import write_json

    _, tok = parts("tdt_tiny")
    rng = random.Random(0)
    for trial in range(200):
        kind = rng.choice(["tdt", "rnnt", "ctc"])
        pieces = []
        for _ in range(rng.randint(1, 3)):
            tokens, frames, durations, frame = [], [], [], rng.randint(0, 2)
            for _ in range(rng.randint(1, 25)):
                tokens.append(rng.randrange(1, 128))
                durations.append(rng.randint(0, 4))
                frames.append(frame)
                frame += durations[-1] if kind == "tdt" else rng.randint(kind == "ctc", 3)
            pieces.append(build_result(tok, tokens, frames, durations, kind, TIMING))
        offsets = sorted(rng.uniform(0, 10) for _ in pieces)
        doc = json.loads(write_json(stitch(pieces, offsets, duration=offsets[-1] + rng.uniform(0, 3))))
        for item in doc["words"] + doc["segments"]:
            assert item["end"] >= item["start"], (trial, kind, item)


CTC_REF = Path(__file__).parent / "data" / "ctc_timestamps"


def test_ctc_words_and_segments_equal_nemo_on_a_punctuated_vocabulary():
    """NeMo's CTC decoding, on 400 greedy label paths over a small SentencePiece vocabulary with
    punctuation in five scripts (bench/make_ctc_timestamp_references.py): the same text, words
    and segments, times to the bit. A token whose text begins with a mark ("...", "»,") ends
    where it starts, keeping its own start (NeMo's CTC rule); the TDT rule, taken for CTC too,
    moved `the?!` and `«Привет»,` ends by frames (over half of these cases differed)."""
    ref = json.loads((CTC_REF / "reference.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_bytes((CTC_REF / "tokenizer.model").read_bytes())
    timing = FrameTiming(ref["window_stride"], ref["subsampling_factor"])
    assert sorted(tokenizer.supported_punctuation) == ref["punctuation"]
    blank = ref["blank"]
    wrong = []
    for i, case in enumerate(ref["cases"]):
        labels = torch.tensor(case["labels"])
        log_probs = torch.full((1, len(labels), blank + 1), -10.0)
        log_probs[0, torch.arange(len(labels)), labels] = 0.0
        (hyp,) = greedy_ctc(log_probs, torch.tensor([len(labels)]), blank)
        r = build_result(tokenizer, hyp.tokens, hyp.frames, hyp.durations, "ctc", timing)
        got = {"text": r.text, "words": [[w.word, w.start, w.end] for w in r.words],
               "segments": [[s.text, s.start, s.end] for s in r.segments]}
        if got != {k: case[k] for k in got}:
            wrong.append((i, got, case))
    assert not wrong, f"{len(wrong)} of {len(ref['cases'])} differ; first: {wrong[0]}"


def test_a_file_cut_into_pieces_has_the_words_and_segments_of_one_decode():
    """A long file is decoded in pieces cut at pauses; NeMo decodes it whole. Stitched with the
    transducer's sentence rule (`stitch(..., sentence_delimiters)`), the pieces' words and
    segments must be those of one decode of all the tokens: before, every cut ended a segment
    (a sentence running over it came out as two, each a subtitle cue), and a piece opening with
    the "." of the sentence before gave a lone "." word and segment. Random TDT token paths
    over a vocabulary with punctuation (tests/data/ctc_timestamps), cut between two tokens
    where a word starts, or before a closing mark that ends a word (a model emits the "." of
    a sentence cut at a pause first thing in the next piece)."""
    import random

    from transcribe.stitching import stitch
    from transcribe.timestamps import DEFAULT_SEGMENT_DELIMITERS

    tok = Tokenizer.from_bytes((CTC_REF / "tokenizer.model").read_bytes())
    punct = tok.supported_punctuation
    closing = {p for p in punct if p not in "(«„“"}
    ids = [i for i in range(tok.vocab_size) if tok.pieces([i])[0] not in ("<unk>",) and tok.text([i]).strip()]
    stop = tok.vocab.index(".")
    fs = TIMING.frame_seconds
    rng = random.Random(0)
    checked = glued = joined = 0
    for trial in range(400):
        n = rng.randint(6, 30)
        tokens = [rng.choice(ids) for _ in range(n)]
        for i in rng.sample(range(n), 3):  # sentence ends, to have segments to keep or join
            tokens[i] = stop
        durations = [rng.randint(0, 3) for _ in tokens]
        frames = [sum(durations[:i]) for i in range(n)]
        pieces = tok.pieces(tokens)

        def word_start(i: int) -> bool:
            return pieces[i].startswith("\u2581") and len(pieces[i]) > 1 and pieces[i][1] not in punct

        cuts = [c for c in range(1, n) if durations[c - 1] > 0 and (word_start(c) or (
            pieces[c] in closing and pieces[c - 1] not in punct and pieces[c - 1] != "\u2581"
            and (c + 1 == n or word_start(c + 1))))]
        if not cuts:
            continue
        c = rng.choice(cuts)
        whole = build_result(tok, tokens, frames, durations, "tdt", TIMING)
        a = build_result(tok, tokens[:c], frames[:c], durations[:c], "tdt", TIMING)
        b = build_result(tok, tokens[c:], [f - frames[c] for f in frames[c:]], durations[c:], "tdt", TIMING)
        got = stitch([a, b], [0.0, frames[c] * fs], duration=frames[-1] * fs + 10, sentence_delimiters=DEFAULT_SEGMENT_DELIMITERS)
        assert [w.word for w in got.words] == [w.word for w in whole.words], (trial, c, pieces)
        assert [(s.text) for s in got.segments] == [s.text for s in whole.segments], (trial, c, pieces)
        for mine, theirs in ((got.segments, whole.segments), (got.words, whole.words)):
            assert [t for x in mine for t in (x.start, x.end)] == \
                pytest.approx([t for x in theirs for t in (x.start, x.end)], abs=1e-9), (trial, c, pieces)
        assert got.text == whole.text, (trial, c, pieces)
        checked += 1
        glued += pieces[c] in closing
        joined += len(got.segments) < len(a.segments) + len(b.segments)
    assert checked > 250 and glued > 30 and joined > 100, (checked, glued, joined)
