"""WER normalisation (OpenAI Whisper's English normaliser) and the bench report's arithmetic."""
import subprocess
import sys
from pathlib import Path

import pytest

from transcribe.bench import normalize_text, wer

# Expected outputs as openai-whisper's own EnglishTextNormalizer gives them (checked against
# openai-whisper 20250625): what a model writes and what a reference says meet in one form.
CASES = [
    ("Mr. Smith", "mister smith"), ("mister smith", "mister smith"),
    ("ten dollars", "$10"), ("$10", "$10"), ("twenty one", "21"), ("1", "one"),
    ("fifty per cent", "50%"), ("nineteen ninety five", "1995"),
    ("colour", "color"), ("He travelled to the theatre", "he traveled to the theater"),
    ("it's", "it is"), ("THERE'S IRON", "there is iron"), ("can't", "can not"), ("won't", "will not"),
    ("James's book", "james is book"),  # OpenAI's rule reads every 's as "is", possessives too
    ("Uh, I think, um, yes.", "i think yes"), ("[laughter] hello", "hello"),
    ("Hello, World!  'quoted' — ok.", "hello world quoted ok"),
    # whisper-normalizer 0.1.15's own additions, which OpenAI's normaliser does not make
    ("the cause of it", "the cause of it"), ("kinda", "kinda"), ("dunno", "dunno"),
]


@pytest.mark.parametrize("text, want", CASES)
def test_normalisation_is_openai_whisper_english(text, want):
    assert normalize_text(text) == want


def test_written_forms_of_the_same_words_are_not_errors():
    refs = ["MISTER SMITH PAID TEN DOLLARS", "the colour of it is grey", "uh it is fine"]
    hyps = ["Mr. Smith paid $10.", "The color of it's gray!", "It's fine."]
    assert wer(refs, hyps) == 0.0


def test_typographic_apostrophes_read_as_ascii_ones():
    """OpenAI's rules match contractions by "'" only: a reference's "Don’t" (U+2019, as in the
    shared sonnets and Common Voice texts) against a model's "don't" was 2 errors."""
    assert normalize_text("Don\u2019t you \u2018think\u2019 it\u2019s fine") == normalize_text("Don't you 'think' it's fine")
    assert wer(["Don\u2019t go, it\u02bcs late"], ["don't go it's late"]) == 0.0


def test_wer_counts_edits_over_reference_words():
    assert wer(["the cat sat", "a b"], ["The cat sat.", "a b"]) == 0.0
    assert abs(wer(["the cat sat on"], ["the bat sat"]) - 0.5) < 1e-9  # 1 sub + 1 del over 4
    assert abs(wer(["mister smith"], ["Dr. Smith"]) - 0.5) < 1e-9  # titles differ: still an error


def test_empty_and_all_punctuation_references_are_skipped():
    assert wer([""], ["x"]) is None
    assert wer(["...", "!!!", "uh, um"], ["x", "y", "z"]) is None  # "..." normalises to "."
    assert wer(["...", "a b"], ["x", "a b"]) == 0.0


def test_module_imports_with_the_standard_library_only():
    """The NeMo and faster-whisper peer venvs import transcribe.bench: no third-party import
    may happen at module level."""
    code = ("import sys, transcribe.bench; bad = {'jiwer', 'whisper_normalizer', 'torch', 'numpy'} "
            "& set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_edit_distance_counts_insertions_deletions_substitutions():
    from transcribe.bench import edit_distance

    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], [1, 2]) == 2 and edit_distance([1, 2], []) == 2
    assert edit_distance([5, 6, 7], [5, 6, 7]) == 0
    assert edit_distance("the cat sat".split(), "the cat sat down".split()) == 1


def _report(texts: dict, references: dict, failed: int):
    from types import SimpleNamespace

    from transcribe.bench import build_report

    stats = SimpleNamespace(texts=texts, stage_seconds={}, audio_seconds=10.0, files_ok=len(texts),
                            files_failed=failed, wall_seconds=1.0, rtfx=10.0, padding_fraction=0.0, workers_peak_bytes=0)
    files = [SimpleNamespace(key=k, reference=r) for k, r in references.items()]
    return build_report(stats, files, "m", "cpu", 0.5, 2.0)


def test_a_failed_files_reference_counts_as_deletions_and_the_summary_says_it_failed():
    """A file that fails has no hypothesis: its reference words are all deletions (as sclite
    scores a missing hypothesis), so failing hard files cannot lower the WER; and the summary
    line says how many failed, where it only counted files."""
    from transcribe.bench import summary_line

    r = _report({"a": "the cat sat"}, {"a": "the cat sat", "b": "one more word here"}, failed=1)
    assert r["files"] == 2 and r["files_failed"] == 1
    assert abs(r["wer"] - 4 / 7) < 1e-9
    assert "2 files (1 failed)," in summary_line(r)
    assert "failed" not in summary_line(_report({"a": "x"}, {"a": "x"}, failed=0))


def test_every_bench_script_prints_its_help_on_a_cpu_machine():
    """`--help` is how a user finds a benchmark's options before renting a GPU for it: each
    script under bench/ answers it, exit 0, without CUDA (the probe once asserted CUDA first)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    scripts = sorted((root / "bench").glob("*.py")) + sorted((root / "bench" / "gpu").glob("*.py"))
    assert len(scripts) > 10
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    running = [(s, subprocess.Popen([sys.executable, str(s), "--help"], cwd=root, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)) for s in scripts]
    for s, p in running:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip(), (s.name, out[-1500:])


def _bench_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_whisper_finds_our_texts_through_a_linked_folder_and_counts_failures(tmp_path):
    """results.jsonl names a manifest's audio as given (links kept); the script looked its texts
    up by the resolved path and, through a linked folder, scored our side 100 % WER unsaid."""
    import json
    import os

    cw = _bench_script("compare_whisper")
    real = tmp_path / "real"
    real.mkdir()
    (real / "manifest.jsonl").write_text(json.dumps({"audio_filepath": "a.flac", "text": "hello"}) + "\n")
    (tmp_path / "link").symlink_to(real)
    manifest = tmp_path / "link" / "manifest.jsonl"
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text(json.dumps({"audio_filepath": os.path.abspath(tmp_path / "link" / "a.flac"),
                                                   "text": "hello"}) + "\n")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"audio_seconds": 1.0, "stages": {"load_model": 0.5}, "transcribe_seconds": 0.5,
                                  "files_failed": 1}))
    got = cw.ours_result(report, out, manifest)
    assert got["texts"] == ["hello"] and got["files_failed"] == 1
    (out / "results.jsonl").write_text("")
    with pytest.raises(SystemExit, match="1 manifest files have no line in our results.jsonl"):
        cw.ours_result(report, out, manifest)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux names the CPU in /proc/cpuinfo")
def test_the_report_names_the_cpu_model():
    """A CPU report said `cpu (x86_64, 2 threads)` on an AMD EPYC and an Intel Xeon alike, whose
    figures differ 2-3x (bf16 with AMX or not): it names the model, as /proc/cpuinfo does."""
    from transcribe.bench import device_name

    model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name"))
    assert device_name("cpu").startswith(f"cpu ({model}, ")


def test_compare_whisper_lists_the_files_one_side_got_clearly_worse():
    """A made-up sentence on one 5 s file (mfa_erpause, 16 errors against faster-whisper's 3)
    moved the corpus WER of 135 files by 0.8 points and was seen by no one: the files whose
    errors differ by FILE_GAP_ERRORS or more are listed, ours worse first; a 1-word difference,
    and a reference with no words, are not."""
    cw = _bench_script("compare_whisper")
    paths = ["a.flac", "b.flac", "c.flac", "d.flac"]
    refs = ["Montreal forced aligner, I hardly know 'er", "red green blue", "cyan magenta yellow", "..."]
    ours = ["Montreal for a stiliner? I hardly know. Thanks for watching. Bye.", "red green blue", "cyan magenta", "x y z"]
    peer = ["Montreal forced aligner, I hardly know her.", "red", "cyan magenta yellow", ""]
    got = cw.file_gaps(paths, refs, ours, peer)
    assert [(g["audio_filepath"], g["ours_errors"], g["peer_errors"]) for g in got] == [("a.flac", 7, 1), ("b.flac", 0, 2)]
    assert got[0]["ours"] == ours[0] and got[0]["words"] == 7
