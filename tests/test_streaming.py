"""Cache-aware streaming: NeMo's per-chunk transcripts, batching at different positions equal
to streaming alone, the slot pool and admission control."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from engines.stream_pool import ChunkInput, PoolExhausted
from engines.streaming_encoder import CacheAwareEncoder, chunk_features, chunk_plan
from conftest import NEMO_REF, needs_shared
from transcribe.streaming.scheduler import Busy, Scheduler, SchedulerConfig, StreamingModel
from transcribe.streaming.session import IncrementalLogMel, SessionState

from streaming_fixtures import RunningText, drive_staggered, files, model, stream_alone, updates_of  # noqa: F401  (fixtures)

pytestmark = needs_shared


def _full_features(model: StreamingModel, audio: np.ndarray) -> torch.Tensor:
    """LogMel over the whole file including its pad frame: what NeMo's streaming buffer holds."""
    feats, _ = model.logmel(torch.from_numpy(audio)[None], torch.tensor([audio.shape[0]]))
    return feats[0]


def test_partial_texts_match_nemo_exact_features(model, files):
    """Pool step over NeMo's own chunking of whole-file features: every partial is NeMo's."""
    pool = model.new_pool(1)
    tok = model.engine.tokenizer
    for f in files:
        feats = _full_features(model, f["samples"])
        plan = chunk_plan(feats.shape[1], model.encoder.cfg)
        assert len(plan) == f["stream_steps"]
        slot, tokens, texts = pool.acquire(), [], []
        for span in plan:
            (hyp,) = pool.step([ChunkInput(slot, chunk_features(feats, span, model.encoder.cfg), span.first)])
            tokens += hyp.tokens
            texts.append(tok.text(tokens))
        pool.release(slot)
        assert texts == f["partial_texts"]
        assert tokens == f["streaming_tokens"]


def _stream_alone(model, audio, piece=1234):
    """(partial texts, final tokens, frames) of the file streamed alone."""
    s, texts = stream_alone(model, audio, piece)
    return texts, s.tokens, s.token_frames


def test_session_partials_match_nemo_and_offline(model, files):
    """Incremental features from arbitrary pieces: NeMo's partials; final = our offline result."""
    for f in files:
        texts, tokens, frames = _stream_alone(model, f["samples"])
        assert texts == f["partial_texts"]
        offline = model.engine.transcribe([f["samples"]])[0]
        assert texts[-1] == offline.text == f["offline_text"]
        assert tokens == offline.tokens


def test_a_chunk_taken_before_the_last_ones_tokens_are_back_changes_no_update(model, files):
    """The server takes a stream's next chunk before the last one's tokens are added (its
    steps are pipelined): the same transcripts, the same covered seconds (times are cut to
    the audio the tokens cover, not the audio taken), and the final only after the last
    chunk's tokens, as NeMo's partials and the offline text."""
    for f in files:
        want = updates_of(model, f["samples"], 4000, pipelined=False)
        got = updates_of(model, f["samples"], 4000, pipelined=True)
        assert got == want
        assert [text for text, *_ in got] == f["partial_texts"]
        assert [final for _, _, final, _ in got] == [False] * (len(got) - 1) + [True]
        assert got[-1][0] == f["offline_text"]
        assert [secs for _, secs, *_ in got] == sorted({secs for _, secs, *_ in got})  # one chunk more each


def test_features_computed_ahead_of_a_step_are_the_chunks_and_leave_no_stft_to_taking(model, files):
    """The server computes a stream's next chunk's features as soon as its audio is all here
    (`Scheduler.prepare`, mostly while a step runs): taking a prepared chunk then computes no
    frames, and the partials are still NeMo's."""
    f = max(files, key=lambda f: f["samples"].shape[0])
    audio = f["samples"]
    sched = Scheduler(model, SchedulerConfig(max_streams=1))
    s = sched.open("a")
    texts, running, prepared = [], RunningText(), 0
    for i in range(0, audio.shape[0], 1234):
        s.push_audio(audio[i: i + 1234])
        sched.prepare(s)
        computed = s.features.frames
        sessions, chunks = sched.collect()
        if chunks:
            assert s.features.frames == computed  # no STFT when the chunk was taken
            prepared += 1
            texts += [running(u) for _, u in sched.apply(sessions, sched.pool.step(chunks))]
    s.end()
    while s.state == SessionState.ACTIVE:
        texts += [running(u) for _, u in sched.run_once()]
    assert texts == f["partial_texts"] and prepared >= 3


def test_batched_at_different_positions_equals_alone(model, files):
    """Streams start at different steps, send audio at different paces, and some wait for a
    slot; each step batches whoever has a chunk. Partials, tokens and frames equal alone."""
    alone = {i: _stream_alone(model, f["samples"]) for i, f in enumerate(files)}
    sched = Scheduler(model, SchedulerConfig(max_streams=3, max_waiting=8))
    paces = [3000, 5000, 2000, 8000, 4000, 6000]  # samples per tick
    seen = {"widest": 0, "mixed": False}

    def inspect(chunks):
        if chunks:
            assert len({c.slot for c in chunks}) == len(chunks)
            seen["mixed"] |= len({c.first for c in chunks}) == 2  # a first chunk beside later ones
            seen["widest"] = max(seen["widest"], len(chunks))

    sessions, texts = drive_staggered(sched, [f["samples"] for f in files], paces, inspect, max_ticks=400)
    for i, s in sessions.items():
        assert s.state == SessionState.DONE
        assert texts[i] == alone[i][0]
        assert (s.tokens, s.token_frames) == alone[i][1:]
    assert sched.pool.free_slots == 3 and not sched.active and not sched.waiting
    assert seen["mixed"] and seen["widest"] == 3


def test_pool_slots_exhaust_and_reset(model, files):
    pool = model.new_pool(2)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(PoolExhausted):
        pool.acquire()
    feats = _full_features(model, files[2]["samples"])
    span = chunk_plan(feats.shape[1], model.encoder.cfg)[0]
    pool.step([ChunkInput(a, chunk_features(feats, span, model.encoder.cfg), True)])
    assert int(pool.att_len[a]) > 0 and int(pool.dec.frames[a]) > 0
    pool.release(a)
    pool.release(a)  # idempotent
    assert pool.free_slots == 1
    assert int(pool.att_len[a]) == 0 and int(pool.dec.frames[a]) == 0
    assert not pool.att[:, a].any() and not pool.conv[:, a].any()
    assert torch.equal(pool.dec.h[:, a], pool.dec.h[:, b]) and torch.equal(pool.dec.pred_out[a], pool.dec.pred_out[b])
    with pytest.raises(ValueError):
        pool.release(7)


def test_admission_waits_then_refuses_and_pool_is_whole_after(model):
    sched = Scheduler(model, SchedulerConfig(max_streams=2, max_waiting=1))
    s1, s2, s3 = sched.open("1"), sched.open("2"), sched.open("3")
    assert s3.state == SessionState.WAITING
    with pytest.raises(Busy):
        sched.open("4")
    with pytest.raises(ValueError):
        sched.open("1")
    sched.close(s1, failed=True)
    assert sched.take_admitted() == [s3] and s3.state == SessionState.ACTIVE and s1.state == SessionState.FAILED
    sched.close(s2)
    sched.close(s3)
    assert sched.pool.free_slots == 2 and not sched.active and not sched.waiting


def test_incremental_logmel_equals_logmel(model, files):
    audio = files[3]["samples"]
    full = _full_features(model, audio)
    inc = IncrementalLogMel(model.logmel)
    rng = np.random.default_rng(0)
    parts, i = [], 0
    while i < audio.shape[0]:
        n = int(rng.integers(1, 4000))
        inc.push(audio[i: i + n])
        if rng.random() < 0.5:  # frames are taken when a chunk needs them, after any pieces
            parts.append(inc.take())
            assert inc.frames == inc.ready
        i += n
    parts.append(inc.finish())
    got = torch.cat(parts, dim=1)
    assert got.shape == full.shape
    torch.testing.assert_close(got, full, atol=1e-3, rtol=0)


def test_offline_trained_encoder_is_rejected():
    from engines.parakeet import ParakeetEngine

    engine = ParakeetEngine.from_nemo(NEMO_REF / "rnnt_tiny" / "model.nemo", device="cpu")
    with pytest.raises(ValueError, match="chunked_limited"):
        CacheAwareEncoder(engine.encoder)


def test_no_audio_gives_an_empty_final_and_times_stay_inside_the_audio(model, files):
    """A stream ended with less than one analysis window (none, 1 or 100 samples) decodes no
    padding into made-up words: its final is empty. Word times, in partials and the final,
    never pass the audio decoded (the last frame's 80 ms reaches beyond the samples)."""
    import numpy as np

    from streaming_fixtures import stream_alone

    for n in (0, 1, 100):
        session, texts = stream_alone(model, np.zeros(n, np.float32) + 0.1, piece=50)
        assert texts == [""] and session.decoded_seconds <= n / 16000
    for f in files:
        sched = Scheduler(model, SchedulerConfig(max_streams=1))
        s = sched.open("a")
        s.push_audio(f["samples"])
        s.end()
        while s.state == SessionState.ACTIVE:
            for _, u in sched.run_once():
                words = [w for r in [*u.segments, u.open, *([u.final] if u.final else [])] for w in r.words]
                assert all(w.end <= s.decoded_seconds <= f["samples"].shape[0] / 16000 for w in words)
