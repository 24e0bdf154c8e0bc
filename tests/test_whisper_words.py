"""Whisper word timestamps: equal to openai-whisper's own on real speech, the DTW equal to
OpenAI's `dtw_cpu`, the word grouping and OpenAI's timing heuristics, the graph modes' path,
and words in the JSON output of the pipeline and the CLI."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import SPEECH, bundled_whisper_fp32
from engines.decode_modes import DecodeMode
from engines.whisper import KVCache
from engines.whisper_alignment import alignment_heads, dtw_paths, median_filter
from engines.whisper_graph import WhisperGraphs
from engines.whisper_weights import WhisperWeightsError, bundled_base_dir
from engines.whisper_words import (MAX_MEDIAN_WORD_SECONDS, WindowSegment, WindowWord, _cut_long_words, _fit_segments,
                                   _merge_punctuations, split_words)

REFERENCE = Path(__file__).parent / "data" / "whisper_words" / "reference.json"


@pytest.fixture(scope="module")
def base():
    return bundled_whisper_fp32(batch_size=16)  # openai-whisper ran fp32


def reference_files() -> list[dict]:
    return json.loads(REFERENCE.read_text())["files"]


def audio_of(entry: dict) -> np.ndarray:
    from transcribe.audio import load_audio

    return load_audio(SPEECH / Path(entry["audio"]).relative_to("../shared/data/speech"), 16000)


def openai_window_mel(audios: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    """Windows as openai-whisper's `transcribe` builds them: the log-mel cut after the audio's
    samples // 160 frames and padded with zeros (our frontend keeps the padded audio's log-mel
    instead: engines/whisper_engine.py says why)."""
    from transcribe.whisper_features import N_SAMPLES, FeatureConfig, log_mel_spectrogram

    batch = torch.zeros(len(audios), N_SAMPLES)
    for i, a in enumerate(audios):
        batch[i, :len(a)] = torch.from_numpy(a)
    mel = log_mel_spectrogram(batch, FeatureConfig(80))
    frames = [len(a) // 160 for a in audios]
    for i, n in enumerate(frames):
        mel[i, :, n:] = 0
    return mel, frames


def test_words_equal_openai_whisper_on_its_windows(base, monkeypatch):
    """openai-whisper 20250625, same weights, fp32, greedy (bench/make_whisper_word_references.py),
    given the windows it builds: the text, every word, its start and end, and the segments'
    times moved to their words are equal, with all 11 recordings in one batch (finished rows
    move behind the live ones, their audio kept for the alignment)."""
    moves = []
    keep = KVCache.keep
    monkeypatch.setattr(KVCache, "keep", lambda self, perm, n: (moves.append(n), keep(self, perm, n))[1])
    files = reference_files()
    results = base.decoder.decode(*openai_window_mel([audio_of(f) for f in files]), words=True)
    assert moves, "the batch never compacted: the permuted cross K/V went untested"
    probability_gaps = []
    for f, res in zip(files, results, strict=True):
        assert res.text == f["text"], f["audio"]
        assert [w[:3] for w in res.words] == [(w["start"], w["end"], w["word"].strip()) for w in f["words"]]
        assert [s[:2] for s in res.segments] == [(s["start"], s["end"]) for s in f["segments"]]
        probability_gaps += [abs(w[3] - r["probability"]) for w, r in zip(res.words, f["words"])]
    # Our probabilities come from the greedy pass, OpenAI's from the forced pass without
    # timestamps (engines/whisper_words.py): close, not equal (measured mean 0.026, max 0.25).
    assert np.mean(probability_gaps) < 0.05 and max(probability_gaps) < 0.4


def test_pipeline_words_follow_openai_whisper(base):
    """Through our frontend (the padded audio's log-mel) a few words differ from openai-whisper's
    (commas mostly); where the text is the same, the word times are within a frame or three."""
    files = reference_files()
    features = [torch.from_numpy(base.frontend(audio_of(f))) for f in files]
    before, t0 = dict(base.stage_seconds), time.perf_counter()
    results = base.transcribe_features(features)
    wall = time.perf_counter() - t0
    # Each stage's time is charged once: they add up to no more than the call's wall time.
    spent = {k: v - before.get(k, 0.0) for k, v in base.stage_seconds.items()}
    assert set(spent) == {"batch", "encoder", "decoder", "fallback", "words"}
    assert all(v > 0 for v in spent.values()) and sum(spent.values()) <= wall
    gaps, same = [], 0
    for f, res in zip(files, results, strict=True):
        assert res.words and "".join(w.word for w in res.words) == res.text.replace(" ", "")  # words are stripped
        if res.text != f["text"]:
            continue
        same += 1
        assert [w.word for w in res.words] == [w["word"].strip() for w in f["words"]]
        gaps += [abs(getattr(w, k) - r[k]) for w, r in zip(res.words, f["words"]) for k in ("start", "end")]
    assert same >= 4  # measured: 5 of 11
    assert np.median(gaps) <= 0.02 and max(gaps) <= 0.1  # measured: median 0, max 0.06 s


def openai_dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI's `dtw_cpu` + `backtrace` (whisper/timing.py), written out literally."""
    n, m = x.shape
    cost = np.ones((n + 1, m + 1), dtype=np.float32) * np.inf
    trace = -np.ones((n + 1, m + 1), dtype=np.float32)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    trace[0, :], trace[:, 0] = 2, 1
    result = []
    while i > 0 or j > 0:
        result.append((i - 1, j - 1))
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    rows, cols = np.array(result)[::-1, :].T
    return rows, cols


def test_batched_dtw_equals_openai_dtw():
    rng = np.random.default_rng(0)
    shapes = [(1, 1), (1, 9), (7, 1), (5, 40), (12, 30), (30, 12), (3, 3)]
    costs = [rng.standard_normal(s) for s in shapes]
    costs += [rng.integers(0, 3, (6, 20)).astype(np.float64)]  # many exact ties
    for (rows, cols), x in zip(dtw_paths(costs), costs, strict=True):
        want_rows, want_cols = openai_dtw(x)
        assert np.array_equal(rows, want_rows) and np.array_equal(cols, want_cols)
        assert rows[0] == cols[0] == 0 and (rows[-1], cols[-1]) == (x.shape[0] - 1, x.shape[1] - 1)


def test_median_filter_reflects_at_the_edges():
    x = torch.tensor([[[5.0, 1.0, 2.0, 9.0, 3.0, 4.0]]])
    # width 3, reflect-padded: [1, 5, 1, 2, 9, 3, 4, 3]
    assert median_filter(x, 3).tolist() == [[[1.0, 2.0, 2.0, 3.0, 4.0, 3.0]]]
    assert median_filter(x[..., :1], 3).tolist() == [[[5.0]]]  # too short to filter


def test_alignment_heads_from_config_else_second_half(tmp_path):
    from engines.whisper import WhisperDims

    dims = WhisperDims(n_text_layer=4, n_text_head=2)
    assert alignment_heads(dims, None) == ((2, 0), (2, 1), (3, 0), (3, 1))
    (tmp_path / "generation_config.json").write_text(json.dumps({"alignment_heads": [[1, 1], [3, 0]]}))
    assert alignment_heads(dims, tmp_path) == ((1, 1), (3, 0))
    (tmp_path / "config.json").write_text(json.dumps({"alignment_heads": [[4, 0]]}))
    with pytest.raises(ValueError, match="outside"):
        alignment_heads(dims, tmp_path)


def test_split_words_joins_pieces_of_a_character(base):
    tok = base.decoder.tok

    def ids(*pieces):  # GPT-2 byte-level spellings: "Ġ" a space, "Ã" "©" the two bytes of "é"
        return [tok.ids[p] for p in pieces]

    tokens = ids("ĠThe", "Ġcaf", "Ã", "©", ",", "Ġok")
    assert [tok.decode(w) for w in split_words(tokens, tok, "en")] == [" The", " café", ",", " ok"]
    # Languages written without spaces: every complete character is a word.
    assert [tok.decode(w) for w in split_words(tokens, tok, "zh")] == [" The", " caf", "é", ",", " ok"]


def words(*spans) -> list[WindowWord]:
    return [WindowWord(w, [i], a, b, 0.9) for i, (w, a, b) in enumerate(spans)]


def test_long_words_at_sentence_ends_are_cut():
    ws = words((" Hi", 0.0, 0.2), (".", 0.2, 3.0), (" Then", 3.0, 6.0), (" so", 6.0, 6.2))
    median, longest = _cut_long_words(ws)
    assert (median, longest) == (0.7, 1.4)  # the median (1.6 s) capped at 0.7 s
    assert (ws[1].start, ws[1].end) == (0.2, pytest.approx(0.2 + 1.4))  # "." itself
    assert (ws[2].start, ws[2].end) == (pytest.approx(6.0 - 1.4), 6.0)  # the word after it


def test_punctuation_joins_its_word():
    ws = words((" (", 0, 1), ("hello", 1, 2), (" world", 2, 3), (".", 3, 4), (" ok", 4, 5))
    _merge_punctuations(ws)
    assert [w.word for w in ws] == ["", " (hello", " world.", "", " ok"]
    assert [w.tokens for w in ws] == [[], [0, 1], [2, 3], [], [4]]


def test_segment_times_follow_words_unless_a_word_is_stretched():
    seg = WindowSegment(4.0, 6.0, (0, 1))
    # The first word stretched over the pause before it: cut to the longest allowed (2 * median).
    segs, out = _fit_segments([seg], words((" hello", 0.5, 4.5), (" world", 4.5, 5.0)), 0.5, 1.0)
    assert (segs[0].start, segs[0].end) == (3.5, 5.0)
    assert [(w.start, w.end) for w in out[0]] == [(3.5, 4.5), (4.5, 5.0)]
    # A first word starting well before the segment's own start: the segment's start wins.
    segs, out = _fit_segments([seg], words((" hello", 3.0, 4.2), (" world", 4.2, 4.5)), 0.7, 1.4)
    assert (segs[0].start, segs[0].end) == (4.0, 4.5) and out[0][0].start == pytest.approx(3.5)
    # After a pause, the second word stretched too: both cut, the segment follows them.
    segs, out = _fit_segments([seg], words((" hello", 4.0, 4.5), (" world", 5.0, 8.0)), 0.5, 1.0)
    assert (segs[0].start, segs[0].end) == (6.0, 8.0)
    assert [(w.start, w.end) for w in out[0]] == [(6.0, 7.0), (7.0, 8.0)]
    # A last word ending well after the segment's end: the segment's end wins.
    segs, out = _fit_segments([WindowSegment(1.0, 6.0, (0, 1))], words((" hello", 1.0, 1.5), (" world", 2.0, 8.0)),
                              0.5, 1.0)
    assert (segs[0].start, segs[0].end) == (1.0, 6.0) and out[0][-1].end == 6.0


def test_a_window_cut_in_a_pause_treats_its_first_word_as_after_a_pause():
    """A long file's later piece begins at a cut in a pause: its first word, stretched back to
    the cut (the window's start), kept that start when the pause was counted from the window's
    start, as for a file's first window ("When," at 12.15 s, the speech at 12.35, OpenAI's
    12.82: it carries the last speech of the window before). Counted as after a pause, the
    word is cut to the longest allowed."""
    seg = WindowSegment(0.0, 3.0, (0, 1))
    stretched = lambda: words((" when", 0.0, 1.06), (" she", 1.06, 1.3))  # noqa: E731
    segs, out = _fit_segments([seg], stretched(), 0.3, 0.6)
    assert (segs[0].start, out[0][0].start) == (0.0, 0.0)  # 1.06 s of a file's start: not a pause
    segs, out = _fit_segments([seg], stretched(), 0.3, 0.6, last_speech=-math.inf)
    assert segs[0].start == out[0][0].start == pytest.approx(0.46) and out[0][0].end == 1.06
    # A first word of ordinary length keeps its start either way.
    segs, out = _fit_segments([seg], words((" when", 0.1, 0.4), (" she", 0.4, 0.6)), 0.3, 0.6, last_speech=-math.inf)
    assert (segs[0].start, out[0][0].start) == (0.1, 0.1)


def test_words_are_dealt_to_segments_by_token_count():
    ws = words((" a", 0.0, 0.5), (" b", 0.5, 1.0), (" c", 1.0, 1.5))
    segs, out = _fit_segments([WindowSegment(0.0, 1.0, (0, 1)), WindowSegment(1.0, 1.5, (2,))], ws, 0.5, 1.0)
    assert [[w.word for w in s] for s in out] == [[" a", " b"], [" c"]]
    assert [(s.start, s.end) for s in segs] == [(0.0, 1.0), (1.0, 1.5)]


@pytest.mark.parametrize("mode", [DecodeMode.UNROLLED, DecodeMode.FULL_GRAPH])
def test_graph_modes_path_gives_the_same_words(base, mode):
    """The CUDA-graph modes' static buffers (run step by step without capture on the CPU) keep
    every window's audio through the bucket moves: the same words as eager."""
    from engines.whisper_engine import pad_window

    files = reference_files()[:6]
    feats = [torch.from_numpy(base.frontend(audio_of(f))) for f in files]
    mel = torch.stack([pad_window(f) for f in feats])
    frames = [f.shape[1] for f in feats]
    dec = base.decoder
    eager = dec.decode(mel, frames, words=True)
    dec.graphs = WhisperGraphs(dec, mode, capture=False)
    try:
        static = dec.decode(mel, frames, words=True)
    finally:
        dec.graphs = WhisperGraphs(dec)
    assert [[w[:3] for w in r.words] for r in static] == [[w[:3] for w in r.words] for r in eager]
    for s, e in zip(static, eager):  # probabilities: the step's log-softmax over other shapes
        assert [w[3] for w in s.words] == pytest.approx([w[3] for w in e.words], abs=1e-4)
    assert all(r.words for r in eager)


def test_cli_json_has_whisper_words_and_txt_skips_the_alignment(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from engines.whisper_engine import PIECE_SECONDS
    from transcribe.segmenting import split_long

    import engines.loader
    from transcribe.cli import main_app

    try:
        bundled_base_dir()
    except WhisperWeightsError as e:
        pytest.skip(str(e))
    asked = []
    load = engines.loader.load_engine
    monkeypatch.setattr(engines.loader, "load_engine",
                        lambda *a, **k: (asked.append(k.get("word_timestamps")), load(*a, **k))[1])
    audio = SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"  # 72 s: 3+ pieces
    runner = CliRunner()
    done = runner.invoke(main_app, [str(audio), "--out", str(tmp_path / "j"), "--model", "whisper-base",
                               "--format", "json", "--workers", "1", "--no-progress"])
    assert done.exit_code == 0, done.output
    doc = json.loads(next((tmp_path / "j").rglob("*.json")).read_text())
    ws = doc["words"]
    assert len(ws) > 20 and "".join(w["word"] for w in ws) == doc["text"].replace(" ", "")
    assert all(0 <= w["start"] <= w["end"] and 0 < w["probability"] <= 1 for w in ws)
    assert all(a["start"] <= b["start"] for a, b in zip(ws, ws[1:]))  # file-relative, across pieces
    assert ws[-1]["end"] > 30.0
    k = 0
    for s in doc["segments"]:  # the words spell the segments in order, each near its segment
        mine = ""
        while len(mine) < len(s["text"].replace(" ", "")):
            # OpenAI's rule for a first word stretched over a pause may start it up to a median
            # word (at most MAX_MEDIAN_WORD_SECONDS) before the segment's own start, and so on
            # at the end: the numbers of the batch decide whether it does ("And" 13.92 s,
            # its segment 14.2 s in a batch of four files; 13.6 and 13.6 alone).
            assert s["start"] - MAX_MEDIAN_WORD_SECONDS - 1e-3 <= ws[k]["start"]
            assert ws[k]["end"] <= s["end"] + MAX_MEDIAN_WORD_SECONDS + 1e-3
            mine, k = mine + ws[k]["word"], k + 1
        assert mine == s["text"].replace(" ", "")
    assert k == len(ws)
    # A later piece begins at a cut in a pause: its first word no longer starts at the cut,
    # before the speech (31.735 and 55.71 s here, with the words at 32.1 and 56.0 s).
    cuts = [offset for offset, _ in split_long(sf.read(audio, dtype="float32")[0], 16000, 30.0, PIECE_SECONDS)[1:]]
    assert len(cuts) >= 3 and not [(w["word"], c) for w in ws for c in cuts if abs(w["start"] - c) < 0.01]
    done = runner.invoke(main_app, [str(SPEECH / "jfk" / "jfk.flac"), "--out", str(tmp_path / "t"), "--model", "whisper-base",
                               "--format", "txt", "--workers", "1", "--no-progress"])
    assert done.exit_code == 0, done.output
    assert asked == [True, False]
