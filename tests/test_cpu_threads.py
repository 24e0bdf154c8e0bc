"""The CPU decoder's thread count is measured, not assumed (engines/cpu_threads.py)."""
from __future__ import annotations

import time

import pytest
import torch

from engines.cpu_threads import decoder_threads, fastest_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_keeps_all_threads_when_they_are_clearly_faster(two_threads):
    # A fake decode that takes 30 ms on one thread and 3 ms on two.
    pick = fastest_threads(lambda: time.sleep(0.03 if torch.get_num_threads() == 1 else 0.003))
    assert pick == 2
    assert torch.get_num_threads() == 2  # the caller's setting is restored


def test_prefers_one_thread_when_threads_do_not_pay(two_threads):
    # Two threads 5 % faster is inside the margin: 1 thread cannot collapse under outside load.
    assert fastest_threads(lambda: time.sleep(0.02 if torch.get_num_threads() == 1 else 0.019)) == 1
    assert fastest_threads(lambda: time.sleep(0.003 if torch.get_num_threads() == 1 else 0.03)) == 1


def test_single_thread_process_is_not_timed():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert fastest_threads(lambda: pytest.fail("must not run")) == 1
    finally:
        torch.set_num_threads(before)


def test_decoder_threads_leaves_cuda_alone(two_threads):
    with decoder_threads("cuda", 1):
        assert torch.get_num_threads() == 2
    with decoder_threads("cpu", 1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_whisper_token_loops_run_with_the_measured_thread_count(two_threads, monkeypatch):
    from engines import whisper_decoding
    from whisper_random import random_audio, random_decoder, random_whisper

    model = random_whisper()
    dec = random_decoder(model, whisper_decoding.DecodeOptions(max_length=12, temperatures=(0.0,)))
    assert dec.cpu_threads == 1  # before reserve(): the choice that cannot collapse under load
    timed: list[int] = []
    real = whisper_decoding.fastest_threads

    def spy(run, **kw):
        timed.append(real(run, **kw))  # the real measurement runs the synthetic decode
        return 1

    monkeypatch.setattr(whisper_decoding, "fastest_threads", spy)
    dec.cpu_threads = 2
    dec.reserve(16)
    assert len(timed) == 1 and timed[0] in (1, 2) and dec.cpu_threads == 1
    assert torch.get_num_threads() == 2  # restored after the measurement
    seen = []
    hook = model.decoder.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        dec.decode_audio(random_audio(model, 3, seed=1))
    finally:
        hook.remove()
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the prompt with all threads, the tokens with 1
