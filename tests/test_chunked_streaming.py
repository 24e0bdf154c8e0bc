"""Chunked streaming of offline-trained TDT / RNN-T models: equal to offline when the context
covers the file, decoding state (TDT overshoot included) carried exactly across chunks with
limited context, batched streams equal to each stream alone, and the slot pool."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import NEMO_REF, needs_shared
from engines.chunked_pool import MAX_WINDOW_BATCH, ChunkContext, ChunkWindow, window_profiles
from engines.decode_stages import label_looping_decode
from engines.loader import OptionError
from engines.encoder_backend import in_chunks, pick_bucket, pick_profile, run_padded
from engines.slot_pool import PoolExhausted
from transcribe.bench import edit_distance
from transcribe.streaming.scheduler import Scheduler, SchedulerConfig, StreamingModel
from transcribe.streaming.session import SessionState
from streaming_fixtures import drive_staggered, stream_alone, updates_of

pytestmark = needs_shared
WHOLE_FILE_MS = 100_000  # left/right context longer than every fixture file


def _files(variant: str) -> list[dict]:
    meta = json.loads((NEMO_REF / variant / "reference.json").read_text())
    out = []
    for f in meta["files"]:
        audio, sr = sf.read(str((NEMO_REF / f["audio"]).resolve()), dtype="float32")
        assert sr == 16000
        out.append({**f, "samples": audio})
    return out


@pytest.fixture(scope="module", params=["tdt_tiny", "rnnt_tiny"])
def variant(request) -> tuple[str, list[dict]]:
    return request.param, _files(request.param)


def _model(name: str, chunk_ms: float, left_ms: float, right_ms: float) -> StreamingModel:
    return StreamingModel.from_nemo(NEMO_REF / name / "model.nemo", chunk_ms=chunk_ms, left_ms=left_ms,
                                    right_ms=right_ms)


def _offline(model: StreamingModel, audio: np.ndarray):
    """Offline greedy hypothesis (tokens, frames, durations) of the whole file."""
    e = model.engine
    feats = torch.from_numpy(e.frontend(audio))[None]
    enc, enc_len = e.encoder(feats, torch.tensor([feats.shape[2]]))
    return e.decoder.decode(enc, enc_len)[0]


def _stream(model: StreamingModel, audio: np.ndarray, piece: int = 3333, after_step=None):
    return stream_alone(model, audio, piece, after_step)


def _whole_file_chunks(model: StreamingModel, audio: np.ndarray, chunk: int, after_step=None):
    """Pool steps whose window is always the whole file (left + right context cover it) and
    whose chunk is `chunk` encoder frames at a time: (tokens, frames, durations, steps)."""
    pool = model.new_pool(1)
    slot, n = pool.acquire(), int(model.engine.encoder.output_lengths(
        torch.tensor([model.engine.frontend.frames(audio.shape[0])]))[0])
    tokens, frames, durations, steps = [], [], [], 0
    for k in range(0, n, chunk):
        (hyp,) = pool.step([ChunkWindow(slot, torch.from_numpy(audio), k, chunk if k + chunk < n else None)])
        tokens += hyp.tokens
        frames += hyp.frames
        durations += hyp.durations
        steps += 1
        if after_step is not None:
            after_step(pool)
    return tokens, frames, durations, steps


@pytest.mark.parametrize("chunk", [1, 3])
def test_whole_file_context_equals_offline(variant, chunk):
    """Windows covering the file have the offline encodings; decoding them `chunk` frames
    (80 / 240 ms) at a time, continuing the state, must give the offline tokens, frames and
    durations exactly. Through a session, a chunk as long as the file is one offline step."""
    name, files = variant
    model = _model(name, WHOLE_FILE_MS, 0, 0)
    for f in files[2:6]:  # the 2.8-5.1 s files: every step re-encodes the whole file
        off = _offline(model, f["samples"])
        assert off.tokens == f["tokens"]  # NeMo's offline reference
        tokens, frames, durations, steps = _whole_file_chunks(model, f["samples"], chunk)
        assert steps > 10
        assert (tokens, frames, durations) == (off.tokens, off.frames, off.durations)
        s, texts = _stream(model, f["samples"])
        assert s.steps == 1 and (s.tokens, s.token_frames, s.token_durations) == (off.tokens, off.frames, off.durations)
        assert texts == [model.engine.tokenizer.text(off.tokens)]


def test_tdt_overshoot_is_carried_into_the_next_chunk():
    """One-frame chunks of whole-file windows: a TDT duration > 1 jumps past the chunk's end;
    the pool carries the overshoot (time_jump > 0 happens, up to 3 frames) and the result
    equals offline. Dropping the carry (each chunk decoded from its first frame) does not."""
    files = _files("tdt_tiny")
    model = _model("tdt_tiny", WHOLE_FILE_MS, 0, 0)
    jumps: list[int] = []
    dropped_differs = 0
    for f in files[2:5]:
        off = _offline(model, f["samples"])
        tokens, *_ = _whole_file_chunks(model, f["samples"], 1, lambda pool: jumps.append(int(pool.dec.time_jump[0])))
        assert tokens == off.tokens
        dropped, *_ = _whole_file_chunks(model, f["samples"], 1, lambda pool: pool.dec.time_jump.zero_())
        dropped_differs += dropped != off.tokens
    assert max(jumps) >= 2 and sum(j > 0 for j in jumps) > 10
    assert dropped_differs == 3


def _stitched_reference(model: StreamingModel, audio: np.ndarray, ctx: ChunkContext) -> list[int]:
    """Independent re-implementation of the chunk schedule: encode each [left|chunk|right]
    window alone (features normalised over the window), keep its chunk's frames, concatenate
    all chunks' encodings and decode them in ONE offline label-looping pass."""
    e, fs = model.engine, model.frame_samples
    chunk, left, right = ctx.chunk * fs, ctx.left * fs, ctx.right * fs
    parts, c, n = [], 0, audio.shape[0]
    while True:
        last = n - c <= chunk + right
        start = max(c - left, 0)
        window = audio[start: n if last else c + chunk + right]
        feats = torch.from_numpy(e.frontend(window))[None]
        enc, enc_len = e.encoder(feats, torch.tensor([feats.shape[2]]))
        lo = (c - start) // fs
        parts.append(enc[0, :, lo: int(enc_len[0]) if last else lo + ctx.chunk])
        if last:
            break
        c += chunk
    enc = torch.cat(parts, dim=1)[None]
    with torch.inference_mode():
        proj = e.decoder.joint.enc(enc.transpose(1, 2))
        hyp = label_looping_decode(proj, torch.tensor([enc.shape[2]]), e.decoder.prediction, e.decoder.joint,
                                   e.decoder.config)[0]
    return hyp.tokens


@pytest.mark.parametrize("context_ms", [(2000, 10000, 2000), (480, 1600, 320)])
def test_limited_context_decodes_the_stitched_chunks_exactly(variant, context_ms):
    """With limited context the encodings differ from offline, so the tokens may too; what must
    hold exactly is that streaming = one offline decoding pass over the stitched chunk
    encodings (decoder state, TDT overshoot and frame bookkeeping lose nothing at chunk
    boundaries). A file no longer than chunk + right is a single window: offline exactly."""
    name, files = variant
    model = _model(name, *context_ms)
    for f in files:
        s, _ = _stream(model, f["samples"], piece=1600)
        assert s.tokens == _stitched_reference(model, f["samples"], model.context)
        if f["samples"].shape[0] <= (model.context.chunk + model.context.right) * model.frame_samples:
            assert s.steps == 1 and s.tokens == f["tokens"]


def test_limited_context_stays_close_to_offline(variant):
    """NeMo's default 2 s chunk / 10 s left / 2 s right on the fixture models: token error rate
    against offline is measured at 0.17 (TDT) and 0.18 (RNN-T) -- these tiny fixture models
    were trained briefly and are far more context-sensitive than Parakeet; bound it at 0.25."""
    name, files = variant
    model = _model(name, 2000, 10000, 2000)
    errors = total = 0
    for f in files:
        s, _ = _stream(model, f["samples"])
        errors += edit_distance(s.tokens, f["tokens"])
        total += len(f["tokens"])
    assert errors / total < 0.25


def test_a_window_taken_before_the_last_ones_tokens_are_back_changes_no_update(variant):
    """As the server pipelines steps (the next window taken before the last one's tokens are
    added): the same transcripts and covered seconds (right context excluded) after every
    update, and the final only after the last window's tokens, with the offline-trained
    chunking whose last window holds the stream's end."""
    name, files = variant
    model = _model(name, 480, 1600, 320)
    for f in files:
        want = updates_of(model, f["samples"], 3333, pipelined=False)
        assert updates_of(model, f["samples"], 3333, pipelined=True) == want
        assert [final for _, _, final, _ in want] == [False] * (len(want) - 1) + [True]


def test_batched_at_different_positions_equals_alone(variant):
    """Streams open at different ticks and send audio at different paces, some wait for a slot;
    each step batches whoever has a window (different lengths, first windows beside later
    ones). Tokens, frames and partial texts equal each stream streamed alone."""
    name, files = variant
    _assert_batched_equals_alone(_model(name, 480, 1600, 320), files)


def _assert_batched_equals_alone(model: StreamingModel, files: list[dict], alone_model: StreamingModel | None = None
                                 ) -> None:
    """The files streamed together on 3 slots (staggered opens and paces, some waiting) give
    each file's tokens, frames and partial texts streamed alone (through `alone_model`, default
    the same model); steps were 3 wide and mixed first windows with later ones; the pool is
    whole after."""
    alone = {i: _stream(alone_model or model, f["samples"]) for i, f in enumerate(files)}
    sched = Scheduler(model, SchedulerConfig(max_streams=3, max_waiting=8))
    paces = [3000, 5000, 2000, 8000, 4000, 6000, 2500, 7000]
    seen = {"widest": 0, "mixed": False}

    def inspect(windows):
        seen["widest"] = max(seen["widest"], len(windows))
        seen["mixed"] |= len({w.left_frames == 0 for w in windows}) == 2

    sessions, texts = drive_staggered(sched, [f["samples"] for f in files], paces, inspect)
    for i, s in sessions.items():
        ref, ref_texts = alone[i]
        assert s.state == SessionState.DONE
        assert (s.tokens, s.token_frames, s.token_durations) == (ref.tokens, ref.token_frames, ref.token_durations)
        assert texts[i] == ref_texts
    assert seen["widest"] == 3 and seen["mixed"]
    assert sched.pool.free_slots == 3 and not sched.active and not sched.waiting


def _windows(model: StreamingModel, samples: int) -> list[ChunkWindow]:
    """Every window one session of `samples` samples (all pushed, then ended) runs, in order."""
    s = model.new_session("w")
    s.slot = 0
    s.push_audio(np.zeros(samples, dtype=np.float32))
    s.end()
    out = []
    while (w := s.next_chunk()) is not None:
        out.append(w)
    return out


@pytest.mark.parametrize("context_ms", [(2000, 10000, 2000), (480, 1600, 320), (80, 2000, 0)])
def test_window_profiles_hold_every_window_a_stream_runs(context_ms):
    """The encoder's buckets (CUDA graphs on a GPU, captured at startup) cover every window of
    streams of any length: regular windows land on a bucket of their exact width while there
    are few widths (no padding), the last ones in the next bucket up, none past the widest."""
    model = _model("tdt_tiny", *context_ms)
    fcfg, sr = model.engine.feature_cfg, model.sample_rate
    profiles = window_profiles(model.context, model.frame_samples, fcfg, max_streams=200)
    assert 1 <= len(profiles) <= 8 and all(p.max_batch == MAX_WINDOW_BATCH for p in profiles)
    assert window_profiles(model.context, model.frame_samples, fcfg, max_streams=3)[0].max_batch == 3
    c = model.context
    widest = int(fcfg.frame_count(torch.tensor([(c.left + c.chunk + c.right) * model.frame_samples]))[0])
    assert profiles[-1].frames == widest and profiles[0].min_frames == 1
    exact = {p.frames for p in profiles}
    regular_widths = set()
    for seconds in (0.3, 1.0, 2.71, 4.5, 9.99, 13.37, 21.0):
        for w in _windows(model, int(seconds * sr)):
            frames = int(fcfg.frame_count(torch.tensor([w.audio.shape[0]]))[0])
            assert pick_profile(profiles, frames) is not None, (context_ms, seconds, frames)
            if w.frames is not None:
                regular_widths.add(frames)
    if len(regular_widths) <= 8:
        assert regular_widths <= exact, (regular_widths, exact)
    else:  # (80, 2000, 0): 26 widths share 8 buckets
        assert len(regular_widths) == 26 and len(profiles) == 8


class _PaddedToBuckets:
    """The eager encoder fed exactly what the CUDA-graph backend feeds its graphs: each batch
    padded to its (rows, width) bucket (extra rows of length 0, extra frames of pad value), the
    outputs sliced back. Counts the batches that were padded."""

    def __init__(self, encoder, profiles, pad_value: float):
        self.encoder, self.profiles, self.pad_value, self.padded = encoder, profiles, pad_value, 0

    def __call__(self, features, lengths):
        return in_chunks(self._one, features, lengths, self.profiles[0].max_batch)

    def _one(self, features, lengths):
        bucket = pick_bucket(self.profiles, features.shape[0], features.shape[2])
        self.padded += bucket != (features.shape[0], features.shape[2])
        return run_padded(self.encoder, features, lengths, bucket, self.pad_value)


def test_windows_padded_to_their_buckets_decode_as_unpadded(variant):
    """What the CUDA graphs change about a chunked step, checked on the CPU: every batch of
    windows padded to its bucket (rows and width). Streams batched at different positions
    still give each stream's tokens, frames and partial texts streamed alone, unpadded."""
    name, files = variant
    plain, padded = _model(name, 480, 1600, 320), _model(name, 480, 1600, 320)
    e = padded.engine
    backend = _PaddedToBuckets(e.encoder, window_profiles(padded.context, padded.frame_samples, e.feature_cfg, 3),
                               e.feature_cfg.pad_value)
    padded._window_encoder = lambda max_streams: backend
    _assert_batched_equals_alone(padded, files, alone_model=plain)
    assert backend.padded > 0


def test_pool_slots_reset_and_context_validation():
    model = _model("tdt_tiny", 480, 1600, 320)
    pool = model.new_pool(2)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(PoolExhausted):
        pool.acquire()
    s = model.new_session("x")
    s.slot = a
    s.push_audio(_files("tdt_tiny")[2]["samples"][:40000])
    t0 = time.perf_counter()
    pool.step([s.next_chunk()])
    wall = time.perf_counter() - t0
    assert int(pool.dec.frames[a]) == model.context.chunk
    # each step's seconds by stage, summed (the server's "stats" message reports them)
    assert set(pool.stage_seconds) == {"features", "encoder", "decoder"}
    assert min(pool.stage_seconds.values()) > 0 and sum(pool.stage_seconds.values()) <= wall
    pool.release(a)
    pool.release(a)  # idempotent
    assert int(pool.dec.frames[a]) == 0 and int(pool.dec.time_jump[a]) == 0
    assert torch.equal(pool.dec.h[:, a], pool.dec.h[:, b]) and torch.equal(pool.dec.pred_out[a], pool.dec.pred_out[b])
    assert ChunkContext.from_ms(2000, 10000, 2000, 1280, 16000) == ChunkContext(125, 25, 25)
    with pytest.raises(ValueError, match="chunk"):
        ChunkContext.from_ms(40, 0, 0, 1280, 16000)
    with pytest.raises(ValueError, match="left context"):
        ChunkContext.from_ms(1000, -1, 0, 1280, 16000)


def test_a_stream_shorter_than_one_analysis_window_has_an_empty_final():
    """Under 400 samples (25 ms) in all, as offline refuses such a file and the cache-aware
    session ends it: the padded features decoded into made-up tokens ("g" from 255 samples)."""
    model = _model("tdt_tiny", 2000, 10000, 2000)
    audio = _files("tdt_tiny")[2]["samples"]
    for n in (1, 255, 399):
        session, texts = _stream(model, audio[8000:8000 + n])
        assert texts == [""] and session.tokens == [], (n, texts)
    session, _ = _stream(model, audio[:16000])
    assert session.decoded_seconds == 1.0  # a second is decoded as before


def test_cache_aware_checkpoint_keeps_its_own_chunking():
    path = NEMO_REF / "rnnt_streaming_tiny" / "model.nemo"
    assert StreamingModel.from_nemo(path).mode == "cache-aware"
    with pytest.raises(ValueError, match="cache-aware"):
        StreamingModel.from_nemo(path, chunk_ms=1000)
    assert _model("tdt_tiny", 2000, 10000, 2000).mode == "chunked"
    # the window encoder's backend: chunked streaming's to choose; one this machine has
    with pytest.raises(OptionError, match="cache-aware"):
        StreamingModel.from_nemo(path, encoder_backend="cuda-graphs")
    with pytest.raises(OptionError, match="streaming takes one of auto, torch, cuda-graphs"):
        StreamingModel.from_nemo(NEMO_REF / "tdt_tiny" / "model.nemo", encoder_backend="tensorrt")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            StreamingModel.from_nemo(NEMO_REF / "tdt_tiny" / "model.nemo", encoder_backend="cuda-graphs")
    assert _model("tdt_tiny", 2000, 10000, 2000).new_pool(1).encoder.name == "torch"  # auto on the CPU


@pytest.mark.gpu
def test_on_cuda_window_features_run_there_and_streams_batched_equal_alone():
    """On CUDA the windows' log-mel runs on the GPU (it was the host's biggest cost of a step):
    features within 1e-3 of the CPU's, and streams batched at different positions still give
    each stream's tokens alone, on that device."""
    from engines.parakeet import ParakeetEngine

    files = _files("tdt_tiny")
    engine = ParakeetEngine.from_nemo(NEMO_REF / "tdt_tiny" / "model.nemo", "cuda", encoder_backend="torch",
                                      decoder_mode="eager")
    model = StreamingModel(engine, chunk_ms=480, left_ms=1600, right_ms=320, encoder_backend="torch")
    window = torch.from_numpy(files[2]["samples"][:40000])
    on_gpu, on_cpu = model.new_pool(1).features(window), _model("tdt_tiny", 480, 1600, 320).new_pool(1).features(window)
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-3, rtol=1e-3)
    _assert_batched_equals_alone(model, files)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tdt_tiny", "rnnt_tiny"])
def test_on_cuda_window_encoder_and_decoder_graphs_are_built_at_startup_and_decode_as_eager(name):
    """The chunked pool's defaults on CUDA: the window encoder as CUDA graphs, one per (batch,
    window width) bucket up to the pool's streams, and the decoder as one full graph (the
    resumed start captured too: `engines.slot_decode`), all built when the pool is made, so a
    step never pays a capture or a first-of-its-shape launch; streams batched at different
    positions through them give each stream's tokens alone through eager torch."""
    from engines.decode_modes import DecodeMode
    from engines.parakeet import ParakeetEngine

    files = _files(name)
    engine = ParakeetEngine.from_nemo(NEMO_REF / name / "model.nemo", "cuda", encoder_backend="torch",
                                      decoder_mode="eager")
    graphs = StreamingModel(engine, chunk_ms=480, left_ms=1600, right_ms=320)
    eager = StreamingModel(engine, chunk_ms=480, left_ms=1600, right_ms=320, encoder_backend="torch")
    eager_pool = eager.new_pool

    def eager_decoder(max_streams):
        pool = eager_pool(max_streams)
        pool.dec.graphs.set_mode("eager", "cuda")
        return pool

    eager.new_pool = eager_decoder
    pool = graphs.new_pool(3)
    assert pool.encoder.name == "cuda-graphs" and pool.encoder.off is None
    profiles = window_profiles(graphs.context, graphs.frame_samples, engine.feature_cfg, 3)
    assert set(pool.encoder.graphs) == {(b, p.frames) for p in profiles for b in (1, 2, 3)}
    assert pool.dec.graphs.mode is DecodeMode.FULL_GRAPH and pool.dec.graphs.captures == 1
    _assert_batched_equals_alone(graphs, files, alone_model=eager)
