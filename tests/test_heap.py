"""transcribe/heap.py: the C heap's free memory goes back to the system between batches."""
import platform
import time

from transcribe import heap


def test_trim_runs_at_most_once_a_second(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(heap, "_last", 0.0)
    assert heap.trim() is True and calls == [0]
    assert heap.trim() is False and calls == [0]  # within the second: not again
    monkeypatch.setattr(heap, "_last", time.monotonic() - heap.EVERY_S - 0.01)
    assert heap.trim() is True and calls == [0, 0]


def test_glibc_malloc_trim_is_found_on_linux():
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert heap._TRIM is not None
    else:
        assert heap.trim() in (True, False)  # elsewhere it may do nothing, but never raises
