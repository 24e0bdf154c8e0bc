"""Input discovery, output naming, manifests and shards."""
import json
from pathlib import Path

import pytest

from transcribe.inputs import InputError, discover, output_stems, parse_shard, read_manifest, shard


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")
    return p


def test_directory_is_walked_recursively_and_mirrored(tmp_path):
    _touch(tmp_path / "talks" / "a.flac")
    _touch(tmp_path / "talks" / "deep" / "b.MP3")
    _touch(tmp_path / "notes.txt")
    _touch(tmp_path / ".hidden.wav")
    _touch(tmp_path / ".Trash-1000" / "files" / "old.wav")  # deleted audio
    _touch(tmp_path / "talks" / ".AppleDouble" / "a.flac")  # a resource file named as the audio
    files = discover([str(tmp_path)])
    assert [f.rel for f in files] == [Path("talks/a.flac"), Path("talks/deep/b.MP3")]
    assert [f.rel for f in discover([str(tmp_path / ".Trash-1000")])] == [Path("files/old.wav")]  # named: searched
    assert all(f.path.is_absolute() for f in files)
    stems = output_stems(files)
    assert stems[files[0].path] == Path("talks/a") and stems[files[1].path] == Path("talks/deep/b")


def test_same_stem_in_one_folder_keeps_audio_extension(tmp_path):
    _touch(tmp_path / "a.flac")
    _touch(tmp_path / "a.wav")
    _touch(tmp_path / "sub" / "a.wav")
    stems = output_stems(discover([str(tmp_path)]))
    assert sorted(map(str, stems.values())) == ["a.flac", "a.wav", "sub/a"]


def test_manifest_paths_are_relative_to_the_manifest(tmp_path):
    _touch(tmp_path / "d" / "x.flac")
    m = tmp_path / "m.jsonl"
    # With the byte-order mark Windows editors put first, and CRLF line ends.
    m.write_bytes(b"\xef\xbb\xbf" + json.dumps({"audio_filepath": "d/x.flac", "text": "HELLO", "duration": 1.5}).encode()
                  + b"\r\n\r\n")
    (f,) = discover([str(m)])
    assert f.problem is None
    assert f.path == (tmp_path / "d" / "x.flac").resolve() and f.rel == Path("d/x.flac")
    assert f.reference == "HELLO" and f.duration == 1.5


def test_a_manifest_line_that_cannot_be_read_fails_alone_with_its_line_and_reason(tmp_path):
    """Each broken line becomes an input that fails with `manifest:line: reason` (under its
    audio path when it names one); the lines around it are read as usual."""
    _touch(tmp_path / "good.flac")
    m = tmp_path / "m.jsonl"
    lines = [
        json.dumps({"audio_filepath": "good.flac", "text": "FINE"}),
        '{"audio_filepath": "cut.flac", "te',
        json.dumps({"text": "no path"}),
        json.dumps(["a", "list"]),
        json.dumps({"audio_filepath": 7}),
        json.dumps({"audio_filepath": "d.flac", "duration": "long"}),
        json.dumps({"audio_filepath": "t.flac", "text": 5}),
        json.dumps({"audio_filepath": "n.flac", "duration": -1}),
    ]
    m.write_bytes(("\n".join(lines) + "\n").encode() + b'{"audio_filepath": "caf\xe9.flac"}\n')
    got = read_manifest(m)
    assert len(got) == 9
    _touch(tmp_path / "m.flac")  # its stem is the failing lines' too: it still writes m.json
    assert output_stems(discover([str(m), str(tmp_path / "m.flac")]))[(tmp_path / "m.flac").resolve()] == Path("m")
    assert got[0].problem is None and got[0].reference == "FINE"
    where = str(m.resolve())
    reasons = {
        2: (f"{where}:2", "not valid JSON"), 3: (f"{where}:3", "no audio_filepath"),
        4: (f"{where}:4", "not a JSON object"), 5: (f"{where}:5", "audio_filepath 7 is not a path"),
        6: (str(tmp_path.resolve() / "d.flac"), "duration 'long' is not a number"),
        7: (str(tmp_path.resolve() / "t.flac"), "text 5 is not a string"),
        8: (str(tmp_path.resolve() / "n.flac"), "duration -1 is not a number"),
        9: (f"{where}:9", "not UTF-8"),
    }
    for line, (path, reason) in reasons.items():
        f = got[line - 1]
        assert str(f.path) == path and f.problem.startswith(f"{where}:{line}: {reason}"), (line, f)


def test_a_broken_line_repeating_a_path_fails_under_its_own_line(tmp_path):
    """A line with a bad duration naming the same file as a good line was dropped as its
    duplicate, with no word; placed first, it dropped the good line and failed the file."""
    _touch(tmp_path / "a.flac")
    for order in ((0, 1), (1, 0)):
        rows = [{"audio_filepath": "a.flac", "text": "x"}, {"audio_filepath": "a.flac", "duration": "ten"}]
        m = tmp_path / "m.jsonl"
        m.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
        got = {str(f.path): f for f in discover([str(m)])}
        bad_line = f"{m.resolve()}:{order.index(1) + 1}"
        assert set(got) == {str((tmp_path / "a.flac").resolve()), bad_line}, order
        assert got[str((tmp_path / "a.flac").resolve())].problem is None
        assert got[bad_line].problem.startswith(f"{bad_line}: duration 'ten' is not a number")


def test_a_manifest_line_naming_its_own_folder_or_the_root_fails_alone(tmp_path):
    """`audio_filepath` "." (or "../m", "/") names a folder with no name of its own to make an
    output name from: discover raised ValueError ("PosixPath('.') has an empty name"), a
    traceback that stopped the whole job. Such a line fails under its own line instead."""
    _touch(tmp_path / "m" / "good.flac")
    m = tmp_path / "m" / "list.jsonl"
    m.write_text("".join(json.dumps({"audio_filepath": a}) + "\n" for a in ("good.flac", ".", "../m", "/")))
    got = {str(f.path): f for f in discover([str(m)])}
    where = m.resolve()
    assert got[str(where.parent / "good.flac")].problem is None
    for line, path in ((2, "."), (3, "../m"), (4, "/")):
        assert got[f"{where}:{line}"].problem == f"{where}:{line}: audio_filepath {path!r} is a folder, not an audio file"
    assert output_stems(list(got.values()))[where.parent / "good.flac"] == Path("good")


def test_a_manifest_path_holding_a_nul_fails_alone(tmp_path):
    """A NUL (`"a\\u0000b.wav"`, a damaged manifest) is in no file name: every look at the path
    raised ValueError ("embedded null byte"), and the run died with a traceback once the model had
    loaded. The line fails under its own line instead, and the path it names is never opened."""
    from transcribe.resume import file_identity

    _touch(tmp_path / "ok.wav")
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"audio_filepath": "ok.wav"}) + "\n" + json.dumps({"audio_filepath": "a\0b.wav"}) + "\n")
    got = {str(f.path): f for f in discover([str(m)])}
    bad = f"{m.resolve()}:2"
    assert set(got) == {str((tmp_path / "ok.wav").resolve()), bad}
    assert got[bad].problem == f"{bad}: audio_filepath 'a\\x00b.wav' holds a NUL character, which no file name can"
    assert all(file_identity(f.path) for f in got.values())  # what the run does first with every input


def test_a_missing_input_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        discover([str(tmp_path / "nothing")])
    # Audio files that all do not exist (a shell glob that matched nothing) are no inputs;
    # one missing among others fails alone in results.jsonl.
    with pytest.raises(InputError, match=r"\*\.wav: no such file"):
        discover([str(tmp_path / "*.wav")])
    _touch(tmp_path / "here.wav")
    assert [f.path.name for f in discover([str(tmp_path / "gone.wav"), str(tmp_path / "here.wav")])] == [
        "gone.wav", "here.wav"]


def test_a_missing_folder_or_a_path_that_cannot_be_looked_at_fails_alone(tmp_path):
    """A cron job naming a folder that is not there today, or a path the system will not stat
    (a name over 255 bytes; a folder without permission), fails with its reason in
    results.jsonl, and the other inputs are still transcribed (it stopped the whole job, one
    with a traceback)."""
    _touch(tmp_path / "here.wav")
    long = tmp_path / ("b" * 300 + ".flac")
    files = discover([str(tmp_path / "incoming"), str(long), str(tmp_path / "here.wav")])
    problems = {f.path.name: f.problem for f in files}
    assert problems == {"incoming": f"{tmp_path / 'incoming'}: no such file or directory",
                        long.name: f"{long}: cannot look at it (File name too long)", "here.wav": None}
    with pytest.raises(InputError, match="incoming: no such file"):  # nothing else: no job
        discover([str(tmp_path / "incoming")])


def test_a_manifest_that_cannot_be_read_fails_alone(tmp_path, monkeypatch):
    """A manifest without read permission (or an I/O error reading it) raised PermissionError
    out of discover: a traceback, and no job for the other inputs. It fails alone, naming it."""
    import transcribe.inputs as inputs
    from conftest import refusing_open

    _touch(tmp_path / "here.wav")
    m = tmp_path / "locked.jsonl"
    m.write_text(json.dumps({"audio_filepath": "here.wav"}) + "\n")
    monkeypatch.setattr(inputs, "open", refusing_open(m), raising=False)
    files = discover([str(m), str(tmp_path / "here.wav")])
    assert {f.path.name: f.problem for f in files} == {
        "locked.jsonl": f"{m}: cannot read this manifest (Permission denied)", "here.wav": None}


def test_links_back_up_the_tree_are_walked_once(tmp_path):
    """`up -> ..` and `again -> ../a` inside `a/` made os.walk(followlinks=True) revisit the
    tree at every level: discovery ran for minutes (exponential in the depth it reached)."""
    _touch(tmp_path / "a" / "x.wav")
    _touch(tmp_path / "b" / "y.flac")
    (tmp_path / "a" / "up").symlink_to("..")
    (tmp_path / "a" / "again").symlink_to("../a")
    (tmp_path / "b" / "to_a").symlink_to("../a")
    got = discover([str(tmp_path)])
    assert sorted(str(f.rel) for f in got) == ["a/x.wav", "b/y.flac"]


def test_inputs_that_share_a_relative_path_get_distinct_outputs(tmp_path):
    """`transcribe a/ b/` with a/x.flac and b/x.flac, or a manifest of absolute paths
    /d/spk1/001.wav and /d/spk2/001.wav, once wrote both to the same OUT/x.json: the second
    overwrote the first."""
    for folder in ("a", "b", "d/spk1", "d/spk2"):
        _touch(tmp_path / folder / ("x.flac" if len(folder) == 1 else "001.wav"))
    _touch(tmp_path / "b" / "x.wav")
    m = tmp_path / "lists" / "m.jsonl"
    m.parent.mkdir()
    m.write_text("".join(json.dumps({"audio_filepath": str(tmp_path / f"d/spk{i}/001.wav")}) + "\n" for i in (1, 2)))
    files = discover([str(tmp_path / "a"), str(tmp_path / "b"), str(m)])
    stems = output_stems(files)
    assert len(set(stems.values())) == len(files) == 5
    assert stems[(tmp_path / "a" / "x.flac").resolve()] == Path("a/x")
    assert stems[(tmp_path / "d/spk2/001.wav").resolve()] == Path("spk2/001")
    # b/x.wav goes with its folder, beside b/x.flac, and both keep their extensions.
    assert stems[(tmp_path / "b" / "x.wav").resolve()] == Path("b/x.wav")
    assert stems[(tmp_path / "b" / "x.flac").resolve()] == Path("b/x.flac")
    assert all(not s.is_absolute() for s in stems.values())
    # Every shard names a file as the whole run does (b/x.flac and b/x.wav keep their audio
    # extension even in a shard that holds one of them).
    for i in (1, 2):
        part = shard(files, (i, 2))
        assert output_stems(part) == {f.path: stems[f.path] for f in part}
    b = tmp_path / "b"
    assert sorted(str(s) for i in (1, 2) for s in output_stems(shard(discover([str(b)]), (i, 2))).values()) == [
        "x.flac", "x.wav"]


def test_a_folder_argument_stays_one_tree_when_another_root_clashes_with_it(tmp_path):
    """r1/talks/a.flac clashing with r2/talks/a.flac took r1's a.flac alone into `r1/talks/`:
    its neighbours a.wav and a.flac.mp3, left in `talks/`, lost the extension the shared stem
    gives them (a.flac.mp3 became `talks/a.flac`, a.flac's name in a run of r1 alone)."""
    for name in ("a.flac", "a.wav", "a.flac.mp3", "b.FLAC"):
        _touch(tmp_path / "r1" / "talks" / name)
    _touch(tmp_path / "r2" / "talks" / "a.flac")
    stems = {f.path.relative_to(tmp_path).as_posix(): f.stem.as_posix()
             for f in discover([str(tmp_path / "r1"), str(tmp_path / "r2")])}
    assert stems == {"r1/talks/a.flac": "r1/talks/a.flac", "r1/talks/a.wav": "r1/talks/a.wav",
                     "r1/talks/a.flac.mp3": "r1/talks/a.flac.mp3", "r1/talks/b.FLAC": "r1/talks/b",
                     "r2/talks/a.flac": "r2/talks/a"}


def test_duplicates_are_listed_once(tmp_path):
    a = _touch(tmp_path / "a.wav")
    assert len(discover([str(a), str(tmp_path)])) == 1


def test_a_repeated_input_keeps_its_manifest_reference_and_a_second_text_fails_under_its_line(tmp_path):
    """The first mention of a file is the one transcribed: a folder naming it before a manifest
    must not drop the manifest's `text` (WER would skip the file, saying nothing); a line giving
    a file a second, different text fails under that line; a plain repeat is dropped."""
    a, b = _touch(tmp_path / "d" / "a.wav"), _touch(tmp_path / "d" / "b.wav")
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join(json.dumps(r) for r in [
        {"audio_filepath": "d/a.wav", "text": "A ONE"},
        {"audio_filepath": "d/b.wav"},
        {"audio_filepath": "d/a.wav", "text": "A ONE"},
        {"audio_filepath": "d/a.wav", "text": "A TWO"},
    ]) + "\n")
    for order in ([str(tmp_path / "d"), str(m)], [str(m), str(tmp_path / "d")], [str(a), str(m)]):
        got = {str(f.key): f for f in discover(order)}
        assert got[str(a)].reference == "A ONE" and got[str(a)].problem is None, order
        assert got[str(b)].reference is None and got[str(b)].problem is None
        assert set(got) == {str(a), str(b), f"{m}:4"}, order
        assert got[f"{m}:4"].problem == f"{m}:4: names {a} again, with a different `text` (the reference " \
                                        f"of its first mention is used)"
        assert got[f"{m}:4"].reference is None  # bench scored "A TWO" too, as a failed file's deletions


def test_shards_partition_the_inputs(tmp_path):
    for i in range(10):
        _touch(tmp_path / f"{i}.wav")
    files = discover([str(tmp_path)])
    parts = [shard(files, parse_shard(f"{i}/3")) for i in (1, 2, 3)]
    assert sorted(f.path for p in parts for f in p) == sorted(f.path for f in files)
    assert all(parts) and all(p == sorted(p, key=lambda f: str(f.key)) for p in parts)
    assert shard(files, None) == files
    for bad in ("4/3", "0/2", "1/0", "a/b", "1-2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_segments_of_a_file_are_inputs_of_their_own(tmp_path):
    """NeMo manifests cut long recordings with `offset` + `duration`: each line is its own
    input (named for its times, told apart by `key`), the `offset: 0` segment of a cut file
    too; a lone `offset: 0` line is the whole file as before, read to its `duration` at most
    (NeMo reads it so); a bad offset fails its line."""
    _touch(tmp_path / "long.flac")
    _touch(tmp_path / "whole.flac")
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in [
        {"audio_filepath": "long.flac", "offset": 0, "duration": 15.0, "text": "ONE"},
        {"audio_filepath": "long.flac", "offset": 15.5, "duration": 12.625, "text": "TWO"},
        {"audio_filepath": "long.flac", "offset": 15.5, "duration": 12.625, "text": "TWO"},  # a repeat
        {"audio_filepath": "long.flac", "offset": 40},  # to the end of the file
        {"audio_filepath": "whole.flac", "offset": 0.0, "duration": 3.0, "text": "ALL"},
        {"audio_filepath": "long.flac", "offset": "soon"},
    ]))
    one, two, _, rest, whole, bad = read_manifest(m)
    assert (one.offset, one.duration, one.reference, one.span) == (0.0, 15.0, "ONE", (0.0, 15.0))
    assert (two.offset, two.duration, two.reference) == (15.5, 12.625, "TWO")
    assert rest.span == (40.0, None) and whole.offset is None and whole.span == (0.0, 3.0)
    assert bad.problem.startswith(f"{m}:6: offset 'soon' is not a number")
    files = discover([str(m)])
    assert [f.key for f in files] == [Path(f"{tmp_path}/long.flac@0.0"), Path(f"{tmp_path}/long.flac@15.5"),
                                      Path(f"{tmp_path}/long.flac@40.0"), tmp_path / "whole.flac",
                                      tmp_path / "long.flac"]  # the bad line, under its path
    assert [str(f.stem) for f in files[:4]] == ["long_0.00-15.00", "long_15.50-28.12", "long_40.00-end", "whole"]


def test_segments_whose_times_print_alike_get_names_of_their_own(tmp_path):
    """Two segments 3 ms apart printed as `long_1.00-4.00` both: the second's outputs were
    written over the first's. Those print their times to the ms; the others keep 10 ms. Times
    alike to the us (float noise) print in full."""
    _touch(tmp_path / "long.flac")
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"audio_filepath": "long.flac", "offset": o, "duration": 3.0}) + "\n"
                         for o in (1.001, 1.004, 9.0, 20.0, 20.0000001)))
    assert [str(f.stem) for f in discover([str(m)])] == ["long_1.001-4.001", "long_1.004-4.004", "long_9.00-12.00",
                                                         "long_20.0-23.0", "long_20.0000001-23.0000001"]


def test_segments_asking_for_huge_times_get_names_a_file_system_takes(tmp_path):
    """`"duration": 1e300` (to the end, in effect) printed in full made a 300-digit name, and
    that segment failed to write: times of 1e9 s and more print in exponent form."""
    _touch(tmp_path / "long.flac")
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"audio_filepath": "long.flac", "offset": o, "duration": d}) + "\n"
                         for o, d in ((1.0, 1e300), (1e300, 1.0), (1.000001e300, 1.0))))
    assert [str(f.stem) for f in discover([str(m)])] == [
        "long_1.00-1.00e+300", "long_1.000000e+300-1.000000e+300", "long_1.000001e+300-1.000001e+300"]


def test_an_extension_kept_for_a_shared_stem_never_meets_another_files_stem(tmp_path):
    """`a.flac` and `a.wav` keep their extensions (`a.flac`, `a.wav`), and `a.flac.mp3`'s own
    stem would be `a.flac`: it keeps its full name too, so no output overwrites another."""
    for name in ("a.flac", "a.wav", "a.flac.mp3", "b.wav"):
        _touch(tmp_path / name)
    stems = output_stems(discover([str(tmp_path)]))
    assert sorted(map(str, stems.values())) == ["a.flac", "a.flac.mp3", "a.wav", "b"]


def test_linked_files_and_folders_keep_the_names_the_user_gave(tmp_path):
    """A dataset of links (git-annex, the Hugging Face cache: `snap/utt1.flac -> ../blobs/5f3a`)
    is listed under the links' names, which its outputs carry too; a manifest's relative path
    through a linked folder keeps that folder in its output name."""
    blob = _touch(tmp_path / "blobs" / "5f3a9c")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "utt1.flac").symlink_to(blob)
    (f,) = discover([str(tmp_path / "snap")])
    assert f.path == tmp_path / "snap" / "utt1.flac" and f.stem == Path("utt1")
    (tmp_path / "ml").mkdir()
    (tmp_path / "ml" / "data").symlink_to(tmp_path / "snap")
    m = tmp_path / "ml" / "m.jsonl"
    m.write_text(json.dumps({"audio_filepath": "data/utt1.flac"}) + "\n")
    (f,) = discover([str(m)])
    assert f.path == tmp_path / "ml" / "data" / "utt1.flac" and f.stem == Path("data/utt1")


def test_a_folder_that_cannot_be_listed_is_a_failed_input_not_skipped_silently(tmp_path):
    """os.walk skips a folder it cannot list: one at a path over the system's 4096 bytes (deep
    trees of long names), or one without read permission. Its audio was simply missing from the
    job, with no line and no message; now the folder is an input that fails with the reason."""
    import os

    (tmp_path / "a.wav").write_bytes(b"")
    fd = os.open(tmp_path, os.O_RDONLY)
    for i in range(22):  # 22 x 200-byte names: the innermost folders' paths pass 4096 bytes
        name = f"{i:02d}" + "L" * 198
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("deep.wav", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    files = discover([str(tmp_path)])
    assert [f.rel for f in files if f.problem is None] == [Path("a.wav")]
    failed = [f for f in files if f.problem is not None]
    assert failed and all("cannot list this folder (File name too long)" in f.problem for f in failed)
    assert all(f.problem.startswith(str(f.path)) for f in failed)


def test_a_file_arriving_between_shard_tasks_moves_no_other_file(tmp_path):
    """The tasks of an array job start minutes apart: a file written into the input folder
    between two starts must not move the others between shards (taking every N-th file of the
    sorted list shifted every file after it: files ran twice and others in no shard). Shards
    go by output name, so a copy of the data mounted elsewhere splits the same way."""
    for i in range(200):
        _touch(tmp_path / "a" / f"{i:03d}.wav")
    before = [shard(discover([str(tmp_path / "a")]), (i, 4)) for i in (1, 2, 3, 4)]
    _touch(tmp_path / "a" / "000a.wav")  # sorts near the start
    after = [shard(discover([str(tmp_path / "a")]), (i, 4)) for i in (1, 2, 3, 4)]
    names = [{f.stem for f in p} for p in before]
    assert all(names[i] <= {f.stem for f in after[i]} for i in range(4))
    assert sum(map(len, after)) == 201 and all(35 <= len(p) <= 65 for p in before)
    (tmp_path / "a").rename(tmp_path / "b")  # another mount point of the same data
    assert [{f.stem for f in shard(discover([str(tmp_path / "b")]), (i, 4))} for i in (1, 2, 3, 4)] == [
        {f.stem for f in p} for p in after]


def test_a_utf16_manifest_and_a_json_array_are_read(tmp_path):
    """PowerShell's `>` writes UTF-16 with a BOM, and a `.json` may hold one pretty-printed
    array: either gave one "not valid JSON" row per line, the model loaded for nothing."""
    rows = [{"audio_filepath": "a.wav", "text": "one"}, {"audio_filepath": "b.wav", "text": "twö"}]
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "b.wav").write_bytes(b"")
    for codec in ("utf-16", "utf-32"):
        path = tmp_path / f"m_{codec}.jsonl"
        path.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode(codec))
        got = read_manifest(path)
        assert [(f.path.name, f.reference, f.problem) for f in got] == [("a.wav", "one", None), ("b.wav", "twö", None)]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(rows, indent=2))
    got = read_manifest(path)
    assert [(f.path.name, f.reference, f.problem) for f in got] == [("a.wav", "one", None), ("b.wav", "twö", None)]
    path.write_text(json.dumps([rows[0], "nonsense"], indent=2))  # its entries fail alone, by number
    assert [f.problem for f in read_manifest(path)] == [None, f"{path}:2: not a JSON object"]


def test_a_lone_offset_0_lines_cap_holds_when_a_folder_names_the_file_first(tmp_path):
    """`bench dir/ m.jsonl`: the folder's mention came first and was kept, taking the line's
    15 s text but not its 15 s cap: the whole 72 s file was scored against it again."""
    _touch(tmp_path / "d" / "long.flac")
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"audio_filepath": "d/long.flac", "offset": 0, "duration": 15.0, "text": "ONE"}) + "\n")
    for order in ([str(tmp_path / "d"), str(m)], [str(m), str(tmp_path / "d")]):
        (f,) = discover(order)
        assert (f.reference, f.cap, f.span) == ("ONE", 15.0, (0.0, 15.0)), order
