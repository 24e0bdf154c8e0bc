"""Length buckets: placement, full buckets, taking a batch early, dropping, padding accounting."""
import pytest

from transcribe.batching import TOPUP_MAX_PADDING, Batcher, PaddingStats


def test_a_full_bucket_becomes_a_batch():
    b = Batcher([5.0, 10.0], budget_s=20.0, max_items=100)  # capacities 4 and 2
    assert b.capacity == [4, 2]
    assert b.add("a", 7.0) is None
    assert b.add("b", 3.0) is None and len(b) == 2
    assert b.add("c", 10.0) == ["a", "c"]  # 10.0 goes in the 10 s bucket (edges are inclusive)
    assert len(b) == 1 and b.padding.padded_seconds == 20.0 and b.padding.valid_seconds == 17.0


def test_max_items_caps_a_bucket():
    b = Batcher([1.0], budget_s=100.0, max_items=3)
    assert [b.add(i, 0.5) for i in range(3)] == [None, None, [0, 1, 2]]


def test_take_tops_up_with_long_pieces_from_shorter_buckets_only_while_padding_stays_small():
    b = Batcher([2.0, 4.0, 8.0], budget_s=100.0, max_items=100)
    for item, s in (("x", 8.0), ("y", 7.5), ("m", 4.0), ("n", 3.9), ("t", 1.0)):
        b.add(item, s)
    batch = b.take()
    assert batch[:2] == ["x", "y"] and "t" not in batch
    assert b.padding.fraction <= TOPUP_MAX_PADDING
    rest = []
    while len(b):
        rest += b.take()
    assert sorted(batch + rest) == ["m", "n", "t", "x", "y"] and b.take() is None


def test_drop_removes_a_failed_files_pieces():
    b = Batcher([5.0], budget_s=100.0, max_items=100)
    for i in range(4):
        b.add(i, 1.0)
    assert b.drop(lambda i: i % 2 == 0) == [0, 2] and b.take() == [1, 3]


def test_padding_fraction_and_bad_edges():
    p = PaddingStats()
    assert p.fraction == 0.0
    p.add([4.0, 2.0])
    assert p.fraction == pytest.approx(0.25)
    with pytest.raises(ValueError):
        Batcher([10.0, 5.0], 10.0, 1)
    with pytest.raises(ValueError):
        Batcher([], 10.0, 1)
