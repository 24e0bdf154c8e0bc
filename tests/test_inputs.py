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
    files = discover([str(tmp_path)])
    assert [f.rel for f in files] == [Path("talks/a.flac"), Path("talks/deep/b.MP3")]
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
    m.write_text(json.dumps({"audio_filepath": "d/x.flac", "text": "HELLO", "duration": 1.5}) + "\n\n")
    (f,) = discover([str(m)])
    assert f.path == (tmp_path / "d" / "x.flac").resolve() and f.rel == Path("d/x.flac")
    assert f.reference == "HELLO" and f.duration == 1.5


def test_bad_manifest_and_missing_input_are_input_errors(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"text": "no path"}\n')
    with pytest.raises(InputError, match="m.jsonl:1: no audio_filepath"):
        read_manifest(m)
    with pytest.raises(InputError, match="no such file"):
        discover([str(tmp_path / "nothing")])


def test_duplicates_are_listed_once(tmp_path):
    a = _touch(tmp_path / "a.wav")
    assert len(discover([str(a), str(tmp_path)])) == 1


def test_shards_partition_the_inputs(tmp_path):
    for i in range(10):
        _touch(tmp_path / f"{i}.wav")
    files = discover([str(tmp_path)])
    parts = [shard(files, parse_shard(f"{i}/3")) for i in (1, 2, 3)]
    assert sorted(f.path for p in parts for f in p) == sorted(f.path for f in files)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert shard(files, None) == files
    for bad in ("4/3", "0/2", "1/0", "a/b", "1-2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
