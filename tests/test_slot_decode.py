"""Streaming steps decoded in the graph modes' pieces (`engines.slot_decode`): on the CPU the
pieces run directly (`capture=False`: what full-graph and unrolled capture and replay), and
must resume every stream exactly as eager decoding does: NeMo's cache-aware partials, TDT
overshoot carried across one-frame chunks, streams batched at different positions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import NEMO_REF, needs_shared
from engines.chunked_pool import ChunkWindow
from engines.decode_modes import DecodeMode
from engines.slot_decode import ResumingState, SlotGraphDecoder
from transcribe.streaming.scheduler import StreamingModel
from streaming_fixtures import files, stream_alone  # noqa: F401  (files: a fixture)

import test_chunked_streaming as chunked
import test_streaming as cache_aware

pytestmark = needs_shared


def _with_graph_pieces(m: StreamingModel, mode: DecodeMode = DecodeMode.FULL_GRAPH) -> list[SlotGraphDecoder]:
    """Every pool `m` makes from now on decodes through the pieces of `mode`, run directly
    and built at the pool's making, as on CUDA. Returns the decoders made, to inspect."""
    made, new_pool = [], m.new_pool

    def pool_with_pieces(max_streams: int):
        pool = new_pool(max_streams)
        d = pool.dec
        d.graphs = SlotGraphDecoder(d.decoder.prediction, d.decoder.joint, d.decoder.config, mode=mode, capture=False)
        d.graphs.prepare(max_streams, 8, d.dtype, d.device)
        made.append(d.graphs)
        return pool

    m.new_pool = pool_with_pieces
    return made


def _checked(made: list[SlotGraphDecoder], mode: DecodeMode) -> None:
    """Each decoder stayed in its mode, resumed over ResumingState, and its first batch was
    checked against eager (which would have fallen back on a disagreement)."""
    assert made and all(g.mode is mode and isinstance(g.static, ResumingState) and not g.unverified for g in made)


@pytest.mark.parametrize("mode", [DecodeMode.FULL_GRAPH, DecodeMode.UNROLLED])
def test_cache_aware_partials_match_nemo_through_the_graph_pieces(mode, files):  # noqa: F811
    m = StreamingModel.from_nemo(NEMO_REF / "rnnt_streaming_tiny" / "model.nemo")
    made = _with_graph_pieces(m, mode)
    cache_aware.test_partial_texts_match_nemo_exact_features(m, files)
    cache_aware.test_batched_at_different_positions_equals_alone(m, files)
    _checked(made, mode)


def test_tdt_overshoot_is_carried_through_the_graph_pieces():
    """One-frame chunks of whole-file windows (TDT durations jump past a chunk's end): the
    resumed start must carry time_jump, and the tokens, frames and durations equal offline."""
    files = chunked._files("tdt_tiny")
    m = chunked._model("tdt_tiny", chunked.WHOLE_FILE_MS, 0, 0)
    made = _with_graph_pieces(m)
    jumps: list[int] = []
    for f in files[2:5]:
        off = chunked._offline(m, f["samples"])
        got = chunked._whole_file_chunks(m, f["samples"], 1, lambda pool: jumps.append(int(pool.dec.time_jump[0])))
        assert got[:3] == (off.tokens, off.frames, off.durations)
    assert max(jumps) >= 2
    _checked(made, DecodeMode.FULL_GRAPH)


@pytest.mark.parametrize("name", ["tdt_tiny", "rnnt_tiny"])
def test_chunked_streams_batched_through_the_graph_pieces_equal_eager_alone(name):
    files = chunked._files(name)
    eager, pieces = chunked._model(name, 480, 1600, 320), chunked._model(name, 480, 1600, 320)
    made = _with_graph_pieces(pieces)
    chunked._assert_batched_equals_alone(pieces, files, alone_model=eager)
    _checked(made, DecodeMode.FULL_GRAPH)
    # A step longer than the static frames regrows them (rebuilt once, then checked again).
    pool = pieces.new_pool(1)
    graphs, slot = made[-1], pool.acquire()
    audio = np.concatenate([f["samples"] for f in files[2:5]])  # over 64 encoder frames (5.12 s)
    assert audio.shape[0] > 64 * pieces.frame_samples
    (hyp,) = pool.step([ChunkWindow(slot, torch.from_numpy(audio), 0, None)])
    assert graphs.static.max_frames > 64 and graphs.captures == 2 and not graphs.unverified
    assert hyp.tokens == chunked._offline(pieces, audio).tokens


def test_eager_is_the_mode_on_the_cpu_and_a_failed_capture_falls_back(monkeypatch, caplog):
    m = chunked._model("tdt_tiny", 480, 1600, 320)
    assert m.new_pool(2).dec.graphs.mode is DecodeMode.EAGER  # auto, on the CPU
    graphs = SlotGraphDecoder(m.engine.decoder.prediction, m.engine.decoder.joint, m.engine.decoder.config,
                              mode=DecodeMode.FULL_GRAPH, capture=False)

    def refused(*args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(ResumingState, "__init__", refused)
    graphs.prepare(2, 8, torch.float32, "cpu")
    assert graphs.mode is DecodeMode.EAGER and graphs.static is None
    assert "full-graph capture failed (capture refused)" in caplog.text


@pytest.mark.parametrize("name", ["rnnt_streaming_tiny", "tdt_tiny"])
def test_streaming_decode_runs_with_the_decoders_cpu_threads(name, monkeypatch):
    """A step's token loop runs with the decoder's measured CPU thread count (1 until measured),
    as offline decoding does, not with all of torch's threads: in `serve` the event loop shares
    the cores, and a tiny decoder's many small ops each ending in an OpenMP barrier made the
    100-stream CPU load's decoder stage 1.25x slower and its final p50 1.4x longer. The
    encoder keeps every thread."""
    import engines.slot_decode as slot_decode

    m = (StreamingModel.from_nemo(NEMO_REF / name / "model.nemo") if name == "rnnt_streaming_tiny"
         else chunked._model(name, 1000, 2000, 500))
    seen, run = [], slot_decode.run_label_looping

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run(*args, **kwargs)

    monkeypatch.setattr(slot_decode, "run_label_looping", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m.engine.decoder.cpu_threads = 1  # what it is until measured (DECODER_THREADS)
        audio = np.random.default_rng(0).standard_normal(48000).astype(np.float32) * 0.1
        stream_alone(m, audio, 1600)
        assert torch.get_num_threads() == 2  # restored after each decode
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_cache_aware_encoder_steps_run_with_the_measured_threads(monkeypatch):
    """The cache-aware pool measures its encoder step's CPU threads once, on scratch caches
    (the pool's own stay zero), and every step's encoder runs with that count, restored after."""
    from engines.streaming_encoder import CacheAwareEncoder
    from engines.stream_pool import encoder_step_threads

    m = StreamingModel.from_nemo(NEMO_REF / "rnnt_streaming_tiny" / "model.nemo")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = m.new_pool(2)
        assert pool.encoder_threads in (1, 2) and encoder_step_threads(m.encoder, "cpu", batch=1) in (1, 2)
        assert not pool.att.any() and not pool.conv.any() and not pool.att_len.any()
        seen, step = [], CacheAwareEncoder.step

        def recording(self, *args, **kwargs):
            seen.append(torch.get_num_threads())
            return step(self, *args, **kwargs)

        monkeypatch.setattr(CacheAwareEncoder, "step", recording)
        monkeypatch.setattr(m, "new_pool", lambda max_streams: pool)
        pool.encoder_threads = 1
        audio = np.random.default_rng(1).standard_normal(32000).astype(np.float32) * 0.1
        stream_alone(m, audio, 1600)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
