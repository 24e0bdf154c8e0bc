"""Long audio: streamed cutting at pauses, VAD boundaries against known utterance offsets,
file-relative times end to end, and bounded memory for an hour of audio.

The long-form files join LibriSpeech test-other utterances with 0.5 s of silence between them,
and their manifest gives each utterance's offset. With the random-weight `tdt_tiny` model the
words are meaningless, so what is checked against the offsets is our segmentation itself:
  * VAD boundaries: file start plus the middle of every pause between two `speech_regions`
    (webrtcvad mode 2, pauses >= 0.3 s) over the whole decoded file; at least 90 % of the 200
    utterance offsets must have one within 0.5 s;
  * piece cuts: where the pipeline cuts files longer than the engine's 40 s pieces (the same
    `PieceCutter` the workers run); at least 90 % of the cuts must fall between two utterances
    (from the end of one, per the manifest, to the offset of the next, each widened by 0.5 s).
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import ROOT, SPEECH, Reference, needs_shared
from transcribe.decode import AudioStream
from transcribe.segmenting import PieceCutter, split_long
from transcribe.vad import speech_flags, speech_regions

LONGFORM = SPEECH / "longform"
MAX_PIECE_S = 40.0  # engines.parakeet.DEFAULT_MAX_PIECE_SECONDS


def _librispeech_longform() -> list[tuple[np.ndarray, list[dict]]]:
    out = []
    for line in (LONGFORM / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["audio_filepath"].startswith("librispeech"):
            with AudioStream(LONGFORM / row["audio_filepath"], 16000) as s:
                out.append((np.concatenate(list(s.blocks())), row["segments"]))
    return out


@pytest.fixture(scope="module")
def longform():
    if not LONGFORM.is_dir():
        pytest.skip("shared long-form data missing")
    return _librispeech_longform()


def test_streamed_cutting_is_the_same_for_any_block_size():
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(16000 * 95) * 0.1).astype(np.float32)
    for k in range(0, 95, 7):
        audio[k * 16000: k * 16000 + 6000] = 0.0  # pauses
    whole = split_long(audio, 16000, 20.0)
    for block in (1000, 16000 * 3 + 17, 16000 * 30):
        cutter = PieceCutter(16000, 20.0)
        pieces = [p for i in range(0, audio.shape[0], block) for p in cutter.push(audio[i: i + block])]
        pieces += cutter.finish()
        assert [(o / 16000, p.shape[0]) for o, p in pieces] == [(o, p.shape[0]) for o, p in whole]
    assert all(p.shape[0] <= 20 * 16000 for _, p in whole)
    assert np.array_equal(np.concatenate([p for _, p in whole]), audio)  # tiled: nothing lost or repeated


@needs_shared
def test_vad_boundaries_match_utterance_offsets(longform):
    hits = total = 0
    for audio, utts in longform:
        regions = speech_regions(speech_flags(audio, 16000))
        bounds = np.array([0.0] + [(a[1] + b[0]) / 2 for a, b in zip(regions, regions[1:])])
        for u in utts:
            total += 1
            hits += np.abs(bounds - u["offset"]).min() <= 0.5
    assert total == 200 and hits / total >= 0.9, f"{hits}/{total}"


@needs_shared
def test_piece_cuts_fall_between_utterances(longform):
    between = cuts = 0
    for audio, utts in longform:
        pieces = split_long(audio, 16000, MAX_PIECE_S)
        assert all(p.shape[0] <= MAX_PIECE_S * 16000 for _, p in pieces)
        gaps = [(a["offset"] + a["duration"] - 0.5, b["offset"] + 0.5) for a, b in zip(utts, utts[1:])]
        for offset, _ in pieces[1:]:
            cuts += 1
            between += any(lo <= offset <= hi for lo, hi in gaps)
    assert cuts >= 40 and between / cuts >= 0.9, f"{between}/{cuts}"


@needs_shared
@pytest.mark.parametrize("gain", [0.25, 1.0, 4.0])
def test_cuts_in_a_real_recording_fall_in_pauses_at_any_level(gain):
    """Whisper's 20 s pieces of a real recording (MFA's michaelandsickmichael, 52 s, a normal
    then a sick voice), as loud or quiet as it comes: each cut lies in a pause that the VAD
    finds over the whole file (>= 0.3 s). The VAD adapts to the level as it goes: run cold
    from the search span's start on the 4x louder copy, it called one 30 ms frame inside
    "slow" a pause, and the word came out in both pieces."""
    from transcribe.audio import load_audio
    from transcribe.vad import PAUSE_AGGRESSIVENESS, runs

    audio = np.clip(load_audio(LONGFORM / "michaelandsickmichael.wav", 16000) * gain, -1, 1)
    starts, ends = runs(~speech_flags(audio, 16000, PAUSE_AGGRESSIVENESS))
    pauses = [(s * 0.03, e * 0.03) for s, e in zip(starts, ends) if (e - s) * 0.03 >= 0.3]
    cuts = [offset for offset, _ in split_long(audio, 16000, 30.0, 20.0)[1:]]
    assert len(cuts) >= 2 and all(any(s <= c <= e for s, e in pauses) for c in cuts), (cuts, pauses)


@needs_shared
def test_long_file_words_come_out_in_file_time(tmp_path):
    from engines.parakeet import ParakeetEngine
    from transcribe.inputs import discover
    from transcribe.pipeline import run

    path = LONGFORM / "librispeech_test-other_1998-15444_concat.flac"
    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    stats = run(engine, discover([str(path)]), tmp_path, ["json"], workers=1)
    doc = json.loads((tmp_path / (path.stem + ".json")).read_text())
    starts = [w["start"] for w in doc["words"]]
    duration = sf.info(path).duration
    assert stats.files_ok == 1 and abs(stats.audio_seconds - duration) < 1e-3
    # a TDT token may last up to 4 encoder frames (0.32 s) past the last frame it was emitted on
    assert starts == sorted(starts) and 0 <= starts[0] and doc["words"][-1]["end"] <= duration + 0.4
    assert starts[-1] > duration - MAX_PIECE_S  # later pieces' words were moved to their offsets
    # tdt_tiny's vocabulary has no . ? !: decoding the file whole, NeMo gives one segment of all
    # its words; each cut at a pause had ended one
    assert [(g["text"], g["start"], g["end"]) for g in doc["segments"]] == \
        [(" ".join(w["word"] for w in doc["words"]), starts[0], doc["words"][-1]["end"])]


def _tree_rss(pid: int) -> tuple[int, dict[int, int]]:
    """(sum of VmRSS over `pid` and its descendants, {pid: VmHWM}) in bytes."""
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text()
                kids.setdefault(int(st[st.rindex(")") + 2:].split()[1]), []).append(int(d.name))
            except OSError:
                continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    total, hwm = 0, {}
    for p in tree:
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
        except OSError:
            continue
        total += int(status.get("VmRSS", "0 kB").split()[0]) * 1024
        hwm[p] = int(status.get("VmHWM", "0 kB").split()[0]) * 1024
    return total, hwm


@needs_shared
def test_an_hour_of_audio_runs_in_under_2_gb(tmp_path):
    """A 1-hour FLAC (the 13.6 min long-form join, repeated), transcribed with tdt_tiny; the peak
    of the summed resident memory of the whole process tree (main, workers, resource tracker;
    shared pages counted in every process that touches them) must stay under 2 GB."""
    src = LONGFORM / "librispeech_test-other_100utt_concat.flac"
    hour = tmp_path / "hour.flac"
    with sf.SoundFile(hour, "w", 16000, 1, format="FLAC") as out:
        while out.frames < 3600 * 16000:
            for block in sf.blocks(src, blocksize=1 << 20, dtype="float32"):
                out.write(block[: 3600 * 16000 - out.frames])
    peak, hwm, stop = [0], {}, threading.Event()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "transcribe.cli", str(hour), "--model", str(Reference("tdt_tiny").nemo),
                          "--out", str(tmp_path / "out"), "--format", "json"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def watch():
        while not stop.is_set():
            total, h = _tree_rss(p.pid)
            peak[0] = max(peak[0], total)
            hwm.update({k: max(v, hwm.get(k, 0)) for k, v in h.items()})
            time.sleep(0.1)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.monotonic()
    _, stderr = p.communicate(timeout=1800)
    stop.set()
    t.join()
    assert p.returncode == 0, stderr
    row = json.loads((tmp_path / "out" / "results.jsonl").read_text())
    print(f"\n1-hour file: peak tree RSS {peak[0] / 2**20:.0f} MiB, per-process peaks (MiB) "
          f"{sorted(round(v / 2**20) for v in hwm.values())}, {time.monotonic() - t0:.0f} s")
    assert abs(row["duration"] - 3600) < 0.01 and row["status"] == "ok"
    assert peak[0] < 2 * 2**30
