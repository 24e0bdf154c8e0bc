"""`transcribe serve`'s engine process (`transcribe/streaming/engine_process.py`): steps run
there give NeMo's partials with slots reused across streams, its load errors are raised here as
themselves, a failed step fails only that step, and an engine process that dies stops the server
with 1, each client told why."""
from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

from conftest import needs_shared
from engines.checkpoint import CheckpointError
from engines.loader import OptionError
from engines.stream_pool import ChunkInput
from transcribe.streaming import protocol as P
from transcribe.streaming.engine_process import EngineDied, RemotePool, StepFailed
from transcribe.streaming.scheduler import Scheduler, SchedulerConfig
from transcribe.streaming.server import ServerConfig
from transcribe.streaming.session import SessionState

from streaming_fixtures import VARIANT, drive_staggered, files, serve_until_it_stops  # noqa: F401  (fixtures)

pytestmark = needs_shared
MODEL = str(VARIANT / "model.nemo")


def _load(**kw) -> dict:
    return {"model": MODEL, **kw}


def test_streams_stepped_in_the_engine_process_give_nemos_partials_with_slots_reused(files):
    """Six streams over three slots (three wait, then take the slots of finished ones, which the
    engine process must reset), starting at different ticks and paces: each stream's partials
    are NeMo's, as in one process."""
    with RemotePool(_load(), 3) as pool:
        sched = Scheduler(pool.front, SchedulerConfig(max_streams=3, max_waiting=8), pool)
        widest = []
        sessions, texts = drive_staggered(sched, [f["samples"] for f in files], [3000, 5000, 2000, 8000, 4000, 6000],
                                          lambda chunks: widest.append(len(chunks)), max_ticks=400)
        assert pool.stage_seconds["encoder"] > 0 and pool.stage_seconds["decoder"] > 0  # the engine's figures
    for i, f in enumerate(files):
        assert sessions[i].state == SessionState.DONE
        assert texts[i] == f["partial_texts"], i
    assert max(widest) == 3 and pool.free_slots == 3


def test_chunked_streams_of_an_offline_trained_model_step_there_as_here(files):
    """tdt_tiny streams in chunks with context: its windows (audio, not features) cross the pipe;
    two streams at different paces give, through the engine process, what one process gives."""
    from conftest import NEMO_REF
    from transcribe.streaming.scheduler import StreamingModel

    tdt = str(NEMO_REF / "tdt_tiny" / "model.nemo")
    samples = [files[0]["samples"], files[1]["samples"]]
    here = drive_staggered(Scheduler(StreamingModel.from_nemo(tdt), SchedulerConfig(max_streams=2)), samples,
                           [4000, 6000], lambda chunks: None)[1]
    with RemotePool({"model": tdt}, 2) as pool:
        assert pool.front.mode == "chunked"
        there = drive_staggered(Scheduler(pool.front, SchedulerConfig(max_streams=2), pool), samples,
                                [4000, 6000], lambda chunks: None)[1]
    assert there == here and all(len(texts) > 1 and texts[-1] for texts in here.values()), here


def test_a_load_error_is_raised_here_as_the_engine_process_raised_it(tmp_path):
    """The CLI tells a bad model (exit 1) from an option it does not take (exit 2) by the
    exception: the engine process's reaches the server process as itself."""
    with pytest.raises(CheckpointError, match="a folder holding no checkpoint"):
        RemotePool(_load(model=str(tmp_path)), 2)
    with pytest.raises(OptionError, match="cache-aware streaming checkpoint"):
        RemotePool(_load(chunk_ms=500.0), 2)


def test_a_step_that_raises_there_is_step_failed_here_and_the_pool_steps_on(files):
    """A chunk the encoder refuses (7 mel bins too many): the step raises StepFailed naming the
    error, the engine process lives on, and the next stream in that slot gets NeMo's partials."""
    with RemotePool(_load(), 2) as pool:
        bad = ChunkInput(pool.acquire(), torch.zeros(pool.front.logmel.cfg.features + 7, 40), True)
        with pytest.raises(StepFailed, match="Error"):
            pool.step([bad])
        assert pool.process.is_alive()
        pool.release(bad.slot)
        sched = Scheduler(pool.front, SchedulerConfig(max_streams=2), pool)
        _, texts = drive_staggered(sched, [files[2]["samples"]], [4000], lambda chunks: None)
    assert texts[0] == files[2]["partial_texts"]


def test_an_engine_process_that_dies_stops_the_server_with_1(files):
    """Killed (the OOM killer, say): the step waiting for it raises EngineDied, the server stops,
    its client told why, and serve_forever returns 1 (the exit status)."""
    with socket.socket() as s:  # a free port for serve_forever, which binds its own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    with RemotePool(_load(), 2) as pool:
        os.kill(pool.process.pid, signal.SIGKILL)
        pool.process.join(10.0)

        hello = P.encode({"type": "hello", "stream_id": "a", "sample_rate": 16000, "format": "pcm16"})
        msgs, status = serve_until_it_stops(pool.front, ServerConfig(port=port, max_streams=2),
                                            hello + P.encode(P.audio_message(files[0]["samples"][:32000])), pool)
        with pytest.raises(EngineDied):
            pool.step([])
    assert status == 1
    assert msgs[-1]["code"] == "internal" and "EngineDied: the engine process exited" in msgs[-1]["message"], msgs
