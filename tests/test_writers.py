"""Output formats and the atomic, resumable writes."""
import json
import os

import pytest

from transcribe.results import Result, Segment, Word
from transcribe.writers import (ResultsLog, atomic_write_text, parse_formats, read_results, write_outputs,
                                write_srt, write_vtt)


def _result():
    words = [Word("hello", 0.0, 0.5), Word("world.", 0.6, 1.2), Word("again", 3661.0, 3661.5)]
    segs = [Segment("hello world.", 0.0, 1.2), Segment("again", 3661.0, 3661.5)]
    return Result(text="hello world. again", words=words, segments=segs, tokens=[])


def test_srt_and_vtt_timestamps():
    srt = write_srt(_result())
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,200\nhello world.\n")
    assert "2\n01:01:00,750 --> 01:01:01,750\nagain\n" in srt  # 0.5 s of speech shown for 1 s
    vtt = write_vtt(_result())
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.200\nhello world.\n")
    odd = Result("AT&T said x <b> --> y", segments=[Segment("AT&T said x <b> --> y", 0.0, 2.0)])
    assert write_vtt(odd).endswith("\nAT&amp;T said x &lt;b&gt; --&gt; y\n")
    # SRT has no escapes: a line holding the arrow is read as the next cue's times
    assert write_srt(odd).endswith("\nAT&T said x <b> -> y\n")
    longer = Result("a ---> b ----> c", segments=[Segment("a ---> b ----> c", 0.0, 2.0)])
    assert write_srt(longer).endswith("\na -> b -> c\n")


def test_json_output_has_segments_and_words(tmp_path):
    write_outputs(_result(), tmp_path / "sub" / "a", ["json", "txt"])
    doc = json.loads((tmp_path / "sub" / "a.json").read_text())
    assert doc["text"] == "hello world. again"
    assert doc["words"][1] == {"word": "world.", "start": 0.6, "end": 1.2}
    assert doc["segments"][1]["start"] == 3661.0
    assert (tmp_path / "sub" / "a.txt").read_text() == "hello world. again\n"


def test_parse_formats():
    assert parse_formats("txt, SRT") == ["txt", "srt"]
    assert parse_formats("all") == ["txt", "json", "srt", "vtt"]
    assert parse_formats("srt,ALL,txt") == ["txt", "json", "srt", "vtt"]  # was "unknown format(s) ['all']"
    assert parse_formats("vtt,txt,vtt") == ["vtt", "txt"]
    with pytest.raises(ValueError, match="docx"):
        parse_formats("txt,docx")


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "old\n")

    with pytest.raises(TypeError):
        atomic_write_text(p, None)  # fails inside the write
    assert p.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["a.txt"]  # no temporary left behind


def test_outputs_get_the_umask_mode_and_long_names_fit(tmp_path, monkeypatch):
    """mkstemp makes its files 0600: renamed into place, transcripts were unreadable to the
    group; they get a plain open()'s mode now. A final name of 255 bytes fits: the temporary
    name takes only the first 32 characters of it."""
    import transcribe.writers as w

    umask = os.umask(0o022)
    os.umask(umask)
    assert w.FILE_MODE == 0o666 & ~umask
    p = tmp_path / "a.txt"
    atomic_write_text(p, "x\n")
    assert p.stat().st_mode & 0o777 == w.FILE_MODE
    monkeypatch.setattr(w, "FILE_MODE", 0o640)
    atomic_write_text(p, "y\n")
    assert p.stat().st_mode & 0o777 == 0o640
    long = tmp_path / ("n" * 250 + ".json")
    atomic_write_text(long, "{}\n")
    assert long.read_text() == "{}\n" and sorted(os.listdir(tmp_path)) == sorted(["a.txt", long.name])


def test_results_log_drops_a_partial_last_line(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text('{"audio_filepath": "/a", "status": "ok"}\n{"audio_filepath": "/b", "sta')
    with ResultsLog(p) as log:
        log.append({"audio_filepath": "/c", "status": "ok"})
    assert [r["audio_filepath"] for r in read_results(p)] == ["/a", "/c"]


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    """A log rewritten by a script (`"\\n".join(lines)`) or an editor that drops the final
    newline ends in a whole record: it was read as a partial line, skipped, and cut off when the
    next run opened the log, so a file that run did not cover lost its line for good."""
    p = tmp_path / "results.jsonl"
    p.write_text('{"audio_filepath": "/a", "status": "ok"}\n{"audio_filepath": "/b", "status": "ok"}')
    assert [r["audio_filepath"] for r in read_results(p)] == ["/a", "/b"]
    with ResultsLog(p) as log:
        log.append({"audio_filepath": "/c", "status": "ok"})
    assert [r["audio_filepath"] for r in read_results(p)] == ["/a", "/b", "/c"]
    assert p.read_text().endswith("}\n")


def test_damaged_results_lines_are_skipped_with_a_note(tmp_path, capsys):
    """A log edited by hand or damaged on disk must not stop a rerun or a merge with a
    traceback: lines that are not records are skipped, naming the file and line."""
    p = tmp_path / "results.jsonl"
    p.write_bytes(b'{"audio_filepath": "/a", "status": "ok"}\ngarbage line\n[1, 2]\n{"status": "ok"}\n'
                  b'\xff\xfe\n{"audio_filepath": "/b", "status": "ok"}\n'
                  b'{"audio_filepath": "/c", "offset": "x"}\n{"audio_filepath": "/c", "offset": true}\n'
                  b'{"audio_filepath": "/c", "offset": 1.5, "status": "ok"}\n')
    assert [r["audio_filepath"] for r in read_results(p)] == ["/a", "/b", "/c"]  # a segment's offset is seconds
    err = capsys.readouterr().err
    assert all(f"{p}:{n}: not a results record, skipped" in err for n in (2, 3, 4, 5, 7, 8))


def test_staged_writes_appear_together_at_commit_and_fail_by_key(tmp_path, monkeypatch):
    """Staged files are invisible (the old ones intact) until `commit()`, which renames them
    into place; a key whose file cannot be renamed fails alone; a full disk at fsync removes
    every temporary file and raises."""
    import errno

    from transcribe import writers
    from transcribe.writers import StagedWrites

    (tmp_path / "a.txt").write_text("old a\n")
    (tmp_path / "c.txt").mkdir()  # a folder where c's transcript goes: its rename fails
    w = StagedWrites()
    for key in "abc":
        w.stage(tmp_path / f"{key}.txt", f"new {key}\n".encode(), key=key)
        w.stage(tmp_path / f"{key}.json", b"{}\n", key=key)
    assert (tmp_path / "a.txt").read_text() == "old a\n" and not (tmp_path / "b.txt").exists()
    failed = w.commit()
    assert set(failed) == {"c"} and failed["c"].errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert failed["c"].filename == str(tmp_path / "c.txt")  # the output, not the temporary name
    assert (tmp_path / "a.txt").read_text() == "new a\n" and (tmp_path / "b.json").read_text() == "{}\n"
    assert not list(tmp_path.glob(".*.tmp"))

    w.stage(tmp_path / "d.txt", b"d\n", key="d")
    w.stage(tmp_path / "a.txt", b"newer a\n", key="a")
    w.drop("d")
    assert not list(tmp_path.glob(".d.txt.*.tmp"))

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space") as stopped:
        w.commit()
    assert stopped.value.filename == str(tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_text() == "new a\n" and not (tmp_path / "d.txt").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_results_log_lines_are_flushed_at_once_and_synced_on_request(tmp_path, monkeypatch):
    from transcribe import writers

    synced = []
    monkeypatch.setattr(writers.os, "fsync", lambda fd: synced.append(fd))
    with ResultsLog(tmp_path / "results.jsonl") as log:
        log.append({"audio_filepath": "/a", "n": 1})
        log.append({"audio_filepath": "/b", "n": 2})
        assert [r["n"] for r in read_results(tmp_path / "results.jsonl")] == [1, 2]  # a reader sees them now
        assert synced == []
        log.sync()
        log.sync()  # nothing new: no second fsync
        assert len(synced) == 1
        log.append({"n": 3})
    assert len(synced) == 2  # closing syncs the rest


def test_a_line_the_full_disk_did_not_take_does_not_fail_the_close(tmp_path):
    """The append that hit ENOSPC stops the run; closing the log must not raise the same error
    again (it replaced the run's clear message with chained tracebacks)."""
    import errno
    import io

    class FullDisk(io.StringIO):
        def flush(self):
            if self.getvalue():
                raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.flush()
            super().close()

    log = ResultsLog(tmp_path / "results.jsonl")
    log._f.close()
    log._f = FullDisk()
    with pytest.raises(OSError, match="No space"):
        log.append({"audio_filepath": "/a", "status": "ok"})
    log.close()
