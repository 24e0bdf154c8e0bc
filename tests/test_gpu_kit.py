"""bench/gpu/on_device.sh is what runs the GPU tests on a lent machine, and that time is scarce
(minutes a session, some sessions none): a GPU test file the `tests` stage forgets is a check
that silently never runs (tests/test_chunked_streaming.py was missed so once). These read the
script as text; it only runs on the GPU machine."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "bench" / "gpu" / "on_device.sh").read_text()


def _stage_body(name: str) -> str:
    """The text of one `case` branch of stage(): from `NAME)` to its `;;`."""
    match = re.search(rf"^\s+{re.escape(name)}\)(.*?)^\s+;;", SCRIPT, re.S | re.M)
    assert match, f"on_device.sh has no stage {name!r}"
    return match.group(1)


def test_every_gpu_test_file_runs_in_a_gpu_stage():
    gpu_mark = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = .*pytest\.mark\.gpu)", re.M)
    marked = {p.name for p in (ROOT / "tests").glob("test_*.py") if gpu_mark.search(p.read_text())}
    assert "test_chunked_streaming.py" in marked  # the scan finds what it should
    named = set(re.findall(r"tests/(test_\w+\.py)", _stage_body("tests") + _stage_body("tests-compile")))
    named |= set(re.findall(r"tests/(test_\w+\.py)", re.search(r"^COMPILE_TEST=(\S+)", SCRIPT, re.M).group(1)))
    assert marked - named == set(), "GPU test files no on_device.sh stage runs"


def test_every_stage_is_accepted_and_listed_in_the_usage():
    branches = set(re.findall(r"^    ([a-z][a-z0-9-]*)\)", SCRIPT, re.M))
    accepted = set(re.search(r"^\s+(probe\|[a-z0-9|-]+)\) STAGES", SCRIPT, re.M).group(1).split("|"))
    usage = set(re.search(r"STAGE: ([a-z0-9|-]+)", SCRIPT).group(1).split("|"))
    assert "stream-long" in branches and "tests" in branches
    # whisper-part is handled before stage() (it keeps a carried part), the others by stage()
    assert accepted == usage == branches | {"whisper-part"}
