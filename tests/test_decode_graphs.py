"""Decoder modes (engines/decode_graphs.py, decode_modes.py): the static-shape driver the graphs
capture, run on CPU without capture, equals eager decoding; mode selection and fallbacks; GPU
modes (gpu marker)."""
from __future__ import annotations

import dataclasses
import logging
from functools import lru_cache

import pytest
import torch
from torch import nn

from conftest import NEMO_REF, OFFLINE_VARIANTS, Reference, needs_shared
from engines import cuda_conditional, decode_graphs, decode_modes
from engines.checkpoint import NemoArchive
from engines.decode_graphs import GraphDecoder
from engines.decode_modes import DecodeMode, select_mode
from engines.decode_stages import DecodeBuffers, label_looping_decode
from engines.transducer import TransducerDecoder, lstm_step_native


@lru_cache(maxsize=None)
def decoder_for(variant: str) -> TransducerDecoder:
    return TransducerDecoder.from_archive(NemoArchive(NEMO_REF / variant / "model.nemo"))


def projected_batch(dec: TransducerDecoder, ref: Reference, files: list[int], pad: int = 0,
                    device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """enc_proj [B, T, J] of the fixture's NeMo encoder outputs (zero-padded), lengths [B]."""
    encs = [torch.from_numpy(ref.array("encoder", i)) for i in files]
    batch = torch.zeros(len(encs), encs[0].shape[0], max(e.shape[1] for e in encs) + pad)
    for row, e in enumerate(encs):
        batch[row, :, : e.shape[1]] = e
    with torch.inference_mode():
        enc_proj = dec.joint.enc(batch.to(device).transpose(1, 2))
    return enc_proj, torch.tensor([e.shape[1] for e in encs], device=device)


def eager(dec: TransducerDecoder, enc_proj: torch.Tensor, lengths: torch.Tensor):
    with torch.inference_mode():
        return label_looping_decode(enc_proj, lengths, dec.prediction, dec.joint, dec.config)


@needs_shared
@pytest.mark.parametrize("variant", OFFLINE_VARIANTS)
def test_static_driver_equals_eager_with_padding_rows_and_regrow(variant):
    ref, dec = Reference(variant), decoder_for(variant)
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.UNROLLED, capture=False)
    graphs.reserve(1, 1)
    # (files, extra padded frames): fits -> fewer rows (padding) -> regrow -> small again (stale rows)
    plan = [([2, 3], 0), ([4], 0), (list(range(len(ref.files))), 9), ([5, 2], 0)]
    sizes = []
    for files, pad in plan:
        enc_proj, lengths = projected_batch(dec, ref, files, pad)
        with torch.inference_mode():
            got = graphs.decode(enc_proj, lengths)
        sizes.append((graphs.static.max_batch, graphs.static.max_frames))
        assert graphs.mode is DecodeMode.UNROLLED  # no fallback, which would return eager's tokens
        assert got == eager(dec, enc_proj, lengths), f"{variant} files {files}"
        for hyp, i in zip(got, files):
            assert hyp.tokens == ref.files[i]["tokens"], f"{variant} file {i}"
            assert hyp.frames == ref.array("token_frames", i).tolist(), f"{variant} file {i}"
            assert len(hyp.durations) == (len(hyp.tokens) if dec.config.is_tdt else 0)
    assert sizes == [(2, 64), (2, 64), (8, 256), (8, 256)]  # frames grow in FRAME_QUANTUM steps
    assert graphs.captures == 2


@needs_shared
def test_padding_rows_never_emit():
    ref, dec = Reference("tdt_tiny"), decoder_for("tdt_tiny")
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.FULL_GRAPH, capture=False)
    graphs.reserve(4, 200)
    enc_proj, lengths = projected_batch(dec, ref, [0, 1, 6, 7])
    with torch.inference_mode():
        graphs.decode(enc_proj, lengths)
        one = projected_batch(dec, ref, [3])
        assert graphs.decode(*one) == eager(dec, *one)
    state = graphs.static.state
    assert state.count[1:].tolist() == [0, 0, 0]  # rows 1-3 held a longer batch before: length 0 now
    assert not state.active.any()


@needs_shared
@pytest.mark.parametrize("variant", ["tdt_tiny", "rnnt_tiny"])
def test_eager_with_larger_reserved_buffers_equals_unreserved(variant):
    """Eager decoding in buffers reserved for more rows than the batch has: the state views
    h[:, :B] are strided (L = 2 layers); the tokens equal an unreserved decode."""
    ref, dec = Reference(variant), decoder_for(variant)
    assert dec.config.pred_rnn_layers >= 2  # else h[:, :B] is contiguous and this pins nothing
    enc_proj, lengths = projected_batch(dec, ref, [2, 3])
    w = dec.joint.pred.weight
    buffers = DecodeBuffers(8, enc_proj.shape[1], dec.config, w.shape[0], w.dtype, w.device)
    assert not buffers.h[:, :2].is_contiguous()
    with torch.inference_mode():
        got = label_looping_decode(enc_proj, lengths, dec.prediction, dec.joint, dec.config, buffers)
    assert got == eager(dec, enc_proj, lengths)


@pytest.mark.parametrize("layers", [1, 2])
def test_native_lstm_step_equals_torch_lstm(layers):
    """The CUDA decoders' LSTM step (torch's LSTM cell per layer, never cuDNN's RNN, which fails
    inside a conditional-node capture) against nn.LSTM over one time step, from strided state
    views as reserved buffers give."""
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 16, layers)
    x = torch.randn(3, 16)
    h = torch.randn(layers, 5, 16)[:, :3]
    c = torch.randn(layers, 5, 16)[:, :3]
    assert layers == 1 or not h.is_contiguous()
    with torch.inference_mode():
        want_out, (want_h, want_c) = lstm(x.unsqueeze(0), (h.contiguous(), c.contiguous()))
        got_out, (got_h, got_c) = lstm_step_native(lstm, x, (h, c))
    torch.testing.assert_close(got_out, want_out.squeeze(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_c, want_c, atol=1e-6, rtol=1e-5)


def test_select_mode_on_cpu_and_unknown_name():
    assert select_mode("auto", "cpu") == (DecodeMode.EAGER, "device is cpu")
    assert select_mode("full-graph", torch.device("cpu"))[0] is DecodeMode.EAGER
    assert select_mode("eager", "cuda") == (DecodeMode.EAGER, "requested")
    assert select_mode("unrolled", "cuda") == (DecodeMode.UNROLLED, "requested")
    with pytest.raises(ValueError):
        select_mode("fast", "cpu")


def _missing_cuda_python():
    raise ImportError(f"cuda-python is not installed: {cuda_conditional.INSTALL_HINT}")


def test_missing_cuda_python_selects_unrolled_naming_the_extra(monkeypatch, caplog):
    monkeypatch.setattr(cuda_conditional, "import_cuda_python", _missing_cuda_python)
    mode, reason = select_mode("full-graph", "cuda")
    assert mode is DecodeMode.UNROLLED
    assert "cuda-python" in reason and "transcribe[cuda]" in reason
    graphs = GraphDecoder(None, None, None)  # selection alone touches no module
    with caplog.at_level(logging.WARNING, logger="transcribe"):
        for _ in range(3):
            assert graphs.set_mode("full-graph", "cuda") is DecodeMode.UNROLLED
    lines = [r for r in caplog.records if r.name == "transcribe"]
    assert len(lines) == 1 and "transcribe[cuda]" in lines[0].getMessage()


def test_auto_on_cuda_is_full_graph_where_conditional_nodes_are_supported(monkeypatch, caplog):
    """"auto" picks the full graph where it can run (not a fallback: no log), and unrolled,
    logged once with the reason, where it cannot."""
    monkeypatch.setattr(decode_modes, "full_graph_unsupported", lambda: None)
    assert select_mode("auto", "cuda") == (DecodeMode.FULL_GRAPH, "auto")
    assert select_mode("full-graph", "cuda") == (DecodeMode.FULL_GRAPH, "requested")
    graphs = GraphDecoder(None, None, None)
    with caplog.at_level(logging.WARNING, logger="transcribe"):
        assert graphs.set_mode("auto", "cuda") is DecodeMode.FULL_GRAPH
    assert not [r for r in caplog.records if r.name == "transcribe"]
    monkeypatch.setattr(cuda_conditional, "import_cuda_python", _missing_cuda_python)
    monkeypatch.setattr(decode_modes, "full_graph_unsupported", lambda: "cuda-python is missing")
    assert select_mode("auto", "cuda") == (DecodeMode.UNROLLED, "cuda-python is missing")
    with caplog.at_level(logging.WARNING, logger="transcribe"):
        for _ in range(2):
            assert graphs.set_mode("auto", "cuda") is DecodeMode.UNROLLED
    lines = [r.getMessage() for r in caplog.records if r.name == "transcribe"]
    assert len(lines) == 1 and "cuda-python is missing" in lines[0], lines


def test_old_cuda_python_is_a_reason():
    api = cuda_conditional.CudaPython(None, None, None, (12, 3))
    assert "12.3 < 12.4" in cuda_conditional.unsupported_reason(api)
    assert not api.edge_data and cuda_conditional.CudaPython(None, None, None, (13, 0)).edge_data
    assert cuda_conditional._major_minor("12.6.2") == (12, 6)
    assert cuda_conditional._major_minor("13.0.1rc1") == (13, 0)


class _FakeCapture:
    """cuda-python's runtime and driver, as far as `WhileLoops.while_loop` calls them, over
    streams whose capture status a test sets: the body stream's capture can be invalidated."""

    ACTIVE, INVALIDATED = "active", "invalidated"

    def __init__(self, body_status: str):
        from types import SimpleNamespace as NS
        self.body_status, self.ended, self.launches = body_status, [], 0
        rt = NS(cudaStreamCaptureStatus=NS(cudaStreamCaptureStatusActive=self.ACTIVE),
                cudaStreamCaptureMode=NS(cudaStreamCaptureModeGlobal=0, cudaStreamCaptureModeThreadLocal=1,
                                         cudaStreamCaptureModeRelaxed=2),
                cudaStreamUpdateCaptureDependenciesFlags=NS(cudaStreamSetCaptureDependencies=1))
        rt.cudaStreamGetCaptureInfo = lambda stream: (0, self.ACTIVE if stream == "root" else self.body_status, 1,
                                                      "graph", ["dep"], 1)
        rt.cudaGraphConditionalHandleCreate = lambda graph, value, flags: (0, NS(getPtr=lambda: 0))
        rt.cudaStreamUpdateCaptureDependencies = lambda *a: (0,)
        rt.cudaStreamBeginCaptureToGraph = lambda *a: (0,)
        rt.cudaStreamEndCapture = lambda stream: (self.ended.append(stream), (0, "body graph"))[1]
        drv = NS(CUgraphNodeType=NS(CU_GRAPH_NODE_TYPE_CONDITIONAL=1),
                 CUgraphConditionalNodeType=NS(CU_GRAPH_COND_TYPE_WHILE=1),
                 CUgraphNodeParams=lambda: NS(type=None, conditional=NS(phGraph_out=["body graph"])),
                 cuCtxGetCurrent=lambda: (0, "ctx"), cuGraphAddNode=lambda *a: (0, "node"),
                 cuLaunchKernel=self._launch)
        self.api = cuda_conditional.CudaPython(rt, drv, None, (13, 0))

    def _launch(self, *args):
        self.launches += 1
        return (0,)

    def loops(self, monkeypatch) -> "cuda_conditional.WhileLoops":
        from types import SimpleNamespace as NS
        import contextlib
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: NS(cuda_stream="root"))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: NS(cuda_stream="body"))
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        loops = cuda_conditional.WhileLoops.__new__(cuda_conditional.WhileLoops)  # no GPU: no kernel to compile
        loops.api, loops.device, loops._mode, loops._kernel = self.api, "cuda", 1, "kernel"
        loops._args, loops._root, loops._depth = [], None, 0
        return loops


class _CudaFlag:
    dtype, is_cuda = torch.bool, True

    def numel(self):
        return 1

    def data_ptr(self):
        return 0


def test_a_failed_while_body_is_reported_before_any_capture_ends(monkeypatch, capsys):
    """The CUDA driver segfaults when a capture ends after one of its conditional bodies'
    captures was invalidated (NVIDIA/cuda-python#2918): the first GPU run died in torch's
    capture_end with no word of the cause. The body's error is now on stderr before the body's
    capture ends, and a body whose capture a library invalidated silently raises too."""
    fake = _FakeCapture(_FakeCapture.ACTIVE)
    loops = fake.loops(monkeypatch)
    with pytest.raises(RuntimeError, match="operation not permitted"):
        with loops.while_loop(_CudaFlag()):
            assert capsys.readouterr().err == ""
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    err = capsys.readouterr().err
    assert "while-loop body failed" in err and "operation not permitted" in err and "unrolled" in err
    assert fake.ended == ["body"] and loops._depth == 0

    fake = _FakeCapture(_FakeCapture.INVALIDATED)
    loops = fake.loops(monkeypatch)
    with pytest.raises(cuda_conditional.CudaPythonError, match="no longer active"):
        with loops.while_loop(_CudaFlag()):
            pass  # e.g. a library swallowed the error of the call that invalidated the capture
    assert "no longer active" in capsys.readouterr().err and fake.ended == ["body"]
    assert fake.launches == 1  # the loop-entry condition only: no end-of-body one was captured

    fake = _FakeCapture(_FakeCapture.ACTIVE)
    loops = fake.loops(monkeypatch)
    with loops.while_loop(_CudaFlag()):
        pass
    assert capsys.readouterr().err == "" and fake.launches == 2 and fake.ended == ["body"]


def test_bindings_newer_than_the_driver_are_a_reason(monkeypatch):
    """CUDA 13 bindings (what `pip install cuda-python` gives now) on a 12.x driver fail every
    runtime call with cudaErrorInsufficientDriver: say so up front, not at the first capture."""
    class Driver:
        def __init__(self, version):
            self.version = version

        def cuDriverGetVersion(self):
            return 0, self.version

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    api = cuda_conditional.CudaPython(None, Driver(12080), None, (13, 0))
    assert "needs a CUDA 13 driver, found 12.8" in cuda_conditional.unsupported_reason(api)
    assert "<13" in cuda_conditional.unsupported_reason(api)
    assert cuda_conditional.unsupported_reason(cuda_conditional.CudaPython(None, Driver(13000), None, (13, 0))) is None
    assert cuda_conditional.unsupported_reason(cuda_conditional.CudaPython(None, Driver(12080), None, (12, 9))) is None
    assert "driver 12.2 < 12.4" in cuda_conditional.unsupported_reason(
        cuda_conditional.CudaPython(None, Driver(12020), None, (12, 9)))


@needs_shared
def test_transducer_decoder_modes_on_cpu(caplog):
    dec = TransducerDecoder(decoder_for("rnnt_tiny").config, decoder_for("rnnt_tiny").prediction,
                            decoder_for("rnnt_tiny").joint)
    assert dec.mode == "eager"  # without set_mode: exactly the old path
    with caplog.at_level(logging.WARNING, logger="transcribe"):
        assert dec.set_mode() == "eager"
        assert dec.set_mode("unrolled") == "eager"
        assert dec.set_mode("eager") == "eager"
    messages = [r.getMessage() for r in caplog.records if r.name == "transcribe"]
    # "auto" on the CPU is not a fallback (eager is the best there): only the explicit request logs.
    assert messages == ["decoder mode eager (requested unrolled): device is cpu"]
    assert dec.mode == "eager"


class _FailingRunner:
    def __init__(self, static, pool):
        raise RuntimeError("capture is not permitted here")


@needs_shared
def test_capture_failure_falls_back_once(monkeypatch, caplog):
    ref, dec = Reference("rnnt_tiny"), decoder_for("rnnt_tiny")
    monkeypatch.setitem(decode_graphs._RUNNERS, DecodeMode.FULL_GRAPH, _FailingRunner)
    monkeypatch.setitem(decode_graphs._RUNNERS, DecodeMode.UNROLLED, decode_graphs.DirectRunner)
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.FULL_GRAPH)
    enc_proj, lengths = projected_batch(dec, ref, [0, 3])
    with caplog.at_level(logging.WARNING, logger="transcribe"), torch.inference_mode():
        assert graphs.decode(enc_proj, lengths) == eager(dec, enc_proj, lengths)
    assert graphs.mode is DecodeMode.UNROLLED
    lines = [r.getMessage() for r in caplog.records if r.name == "transcribe"]
    assert lines == ["decoder mode full-graph capture failed (capture is not permitted here); falling back to unrolled"]
    # a failing unrolled capture ends in eager, still decoding correctly
    monkeypatch.setitem(decode_graphs._RUNNERS, DecodeMode.UNROLLED, _FailingRunner)
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.UNROLLED)
    with torch.inference_mode():
        assert graphs.decode(enc_proj, lengths) == eager(dec, enc_proj, lengths)
    assert graphs.mode is DecodeMode.EAGER and graphs.static is None


def _dropping_last_token(rows: set[int]):
    """StaticState.result that loses the last token of the given rows: a broken capture."""
    result = decode_graphs.StaticState.result

    def broken(self, batch):
        hyps = result(self, batch)
        for r in rows & set(range(batch)):
            h = hyps[r]
            hyps[r] = dataclasses.replace(h, tokens=h.tokens[:-1], frames=h.frames[:-1], durations=h.durations[:-1])
        return hyps
    return broken


@needs_shared
def test_a_capture_whose_first_batch_differs_from_eager_falls_back(monkeypatch, caplog):
    """A new capture's first batch is decoded eagerly too: when more than a quarter of its rows
    (below 4 rows: any) differ, eager's tokens are returned and the mode falls back, logged once;
    the next mode's capture is checked in turn. One differing row of 8 is tolerated (a near-tie
    flip), and later batches are not checked."""
    ref, dec = Reference("tdt_tiny"), decoder_for("tdt_tiny")
    enc_proj, lengths = projected_batch(dec, ref, [0, 3])
    want = eager(dec, enc_proj, lengths)
    monkeypatch.setattr(decode_graphs.StaticState, "result", _dropping_last_token({1}))
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.FULL_GRAPH, capture=False)
    with caplog.at_level(logging.WARNING, logger="transcribe"), torch.inference_mode():
        assert graphs.decode(enc_proj, lengths) == want
        assert graphs.mode is DecodeMode.UNROLLED and graphs.static is None
        assert graphs.decode(enc_proj, lengths) == want  # unrolled: captured, checked, differs too
    assert graphs.mode is DecodeMode.EAGER
    assert [r.getMessage() for r in caplog.records if r.name == "transcribe"] == [
        "decoder mode full-graph gave other tokens than eager in 1 of 2 rows of its first batch; "
        "falling back to unrolled",
        "decoder mode unrolled gave other tokens than eager in 1 of 2 rows of its first batch; "
        "falling back to eager"]

    files = list(range(8))
    enc_proj, lengths = projected_batch(dec, ref, files)
    want = eager(dec, enc_proj, lengths)
    assert all(h.tokens for h in want)
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.UNROLLED, capture=False)
    with torch.inference_mode():
        got = graphs.decode(enc_proj, lengths)
        assert graphs.mode is DecodeMode.UNROLLED and not graphs.unverified
        assert [g == w for g, w in zip(got, want)] == [r != 1 for r in files]  # tolerated, kept
        monkeypatch.setattr(decode_graphs.StaticState, "result", _dropping_last_token(set(files)))
        assert graphs.decode(enc_proj, lengths) != want  # checked once per capture only
    assert graphs.mode is DecodeMode.UNROLLED


@needs_shared
def test_a_replay_error_falls_back_and_decodes_the_batch(monkeypatch, caplog):
    ref, dec = Reference("rnnt_tiny"), decoder_for("rnnt_tiny")
    enc_proj, lengths = projected_batch(dec, ref, [1, 2, 5])
    run = decode_graphs.DirectRunner.run
    failures = []

    def refused(self):
        if not failures:
            failures.append(1)
            raise RuntimeError("CUDA error: operation not permitted")
        run(self)

    monkeypatch.setattr(decode_graphs.DirectRunner, "run", refused)
    graphs = GraphDecoder(dec.prediction, dec.joint, dec.config, mode=DecodeMode.FULL_GRAPH, capture=False)
    with caplog.at_level(logging.WARNING, logger="transcribe"), torch.inference_mode():
        assert graphs.decode(enc_proj, lengths) == eager(dec, enc_proj, lengths)
    assert graphs.mode is DecodeMode.UNROLLED and graphs.static is not None  # unrolled decoded it
    assert [r.getMessage() for r in caplog.records if r.name == "transcribe"] == [
        "decoder mode full-graph replay failed (CUDA error: operation not permitted); falling back to unrolled"]

    def out_of_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory")

    # running out of memory is the batch's size, not the mode's fault: it reaches the pipeline
    monkeypatch.setattr(decode_graphs.DirectRunner, "run", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError), torch.inference_mode():
        graphs.decode(enc_proj, lengths)
    assert graphs.mode is DecodeMode.UNROLLED


# ---- GPU: real capture and replay -------------------------------------------------------------

def _cuda_decoder(variant: str) -> TransducerDecoder:
    """A fresh decoder moved to CUDA (the cached CPU ones stay on CPU)."""
    return TransducerDecoder.from_archive(NemoArchive(NEMO_REF / variant / "model.nemo")).to("cuda")


@pytest.mark.gpu
@needs_shared
@pytest.mark.parametrize("variant", OFFLINE_VARIANTS)
@pytest.mark.parametrize("mode", ["full-graph", "unrolled"])
def test_gpu_modes_equal_eager(variant, mode):
    if mode == "full-graph" and (why := decode_modes.full_graph_unsupported()) is not None:
        pytest.skip(f"full-graph unavailable: {why}")
    ref, dec = Reference(variant), _cuda_decoder(variant)
    assert dec.set_mode(mode) == mode
    dec.graphs.reserve(2, 1)
    plan = [([2, 3], 0), ([4], 0), (list(range(len(ref.files))), 9), ([5, 2], 0)]
    pools = []
    for files, pad in plan:
        enc_proj, lengths = projected_batch(dec, ref, files, pad, device="cuda")
        with torch.inference_mode():
            got = dec.graphs.decode(enc_proj, lengths)
        assert dec.mode == mode, "no fallback expected"
        assert got == eager(dec, enc_proj, lengths), f"{variant} {mode} files {files}"
        pools.append(dec.graphs.pool)
    assert dec.graphs.captures == 2
    # the regrow captured into a fresh pool: the dropped graphs' pool is never captured into again
    assert pools[0] == pools[1] and len(set(pools)) == 2
    # and through the public entry point (encoder layout [B, D, T])
    encs = [torch.from_numpy(ref.array("encoder", i)) for i in (0, 1)]
    raw = torch.zeros(2, dec.config.enc_hidden, max(e.shape[1] for e in encs))
    for row, e in enumerate(encs):
        raw[row, :, : e.shape[1]] = e
    lengths = torch.tensor([e.shape[1] for e in encs])
    assert dec.decode(raw.cuda(), lengths) == _cuda_decoder(variant).decode(raw.cuda(), lengths)


@pytest.mark.gpu
@needs_shared
@pytest.mark.parametrize("variant", OFFLINE_VARIANTS)
def test_gpu_eager_with_larger_reserved_buffers_equals_unreserved(variant):
    """Eager mode on CUDA after reserve() for more rows than the batch: the LSTM step gets the
    strided views h[:, :B] of the [L, max_batch, H] buffers (cuDNN's LSTM rejected them: "rnn:
    hx is not contiguous"). Tokens must equal an eager decode without buffers."""
    ref, dec = Reference(variant), _cuda_decoder(variant)
    assert dec.set_mode("eager") == "eager"
    files = [2, 3]
    encs = [torch.from_numpy(ref.array("encoder", i)) for i in files]
    frames = max(e.shape[1] for e in encs)
    raw = torch.zeros(len(files), dec.config.enc_hidden, frames)
    for row, e in enumerate(encs):
        raw[row, :, : e.shape[1]] = e
    lengths = torch.tensor([e.shape[1] for e in encs])
    dec.reserve(8, frames + 16)
    assert dec.buffers is not None and dec.buffers.max_batch == 8
    got = dec.decode(raw.cuda(), lengths)
    assert dec.mode == "eager"
    assert got == _cuda_decoder(variant).decode(raw.cuda(), lengths)  # no buffers: fresh [L, B, H] state
    # and the unreserved eager decode of the same rows through the stage driver
    enc_proj, lens = projected_batch(dec, ref, files, device="cuda")
    assert got == eager(dec, enc_proj, lens)


@pytest.mark.gpu
@needs_shared
def test_gpu_full_graph_capture_failure_falls_back_to_unrolled(monkeypatch, caplog):
    if (why := decode_modes.full_graph_unsupported()) is not None:
        pytest.skip(f"full-graph unavailable: {why}")

    def broken_while_loop(self, flag):
        raise cuda_conditional.CudaPythonError("simulated conditional-node failure")

    monkeypatch.setattr(cuda_conditional.WhileLoops, "while_loop", broken_while_loop)
    ref, dec = Reference("tdt_tiny"), _cuda_decoder("tdt_tiny")
    assert dec.set_mode("full-graph") == "full-graph"
    enc_proj, lengths = projected_batch(dec, ref, [0, 1, 2], device="cuda")
    with caplog.at_level(logging.WARNING, logger="transcribe"), torch.inference_mode():
        got = dec.graphs.decode(enc_proj, lengths)
    assert dec.mode == "unrolled"
    assert got == eager(dec, enc_proj, lengths)
    lines = [r.getMessage() for r in caplog.records if r.name == "transcribe"]
    assert len(lines) == 1 and "simulated conditional-node failure" in lines[0]


@pytest.mark.gpu
def test_gpu_missing_cuda_python_still_decodes_unrolled(monkeypatch):
    monkeypatch.setattr(cuda_conditional, "import_cuda_python", _missing_cuda_python)
    mode, reason = select_mode("full-graph", "cuda")
    assert mode is DecodeMode.UNROLLED and "transcribe[cuda]" in reason


def test_graph_capture_keeps_the_garbage_collector_off_until_the_capture_ends(monkeypatch):
    """A collection during a capture can tear down an object whose CUDA calls are illegal while
    a stream captures (an abort on the H100 in a Whisper full-graph capture). Checked on the CPU
    with torch.cuda.graph replaced by a recorder: off inside, restored after, also on error."""
    import contextlib
    import gc

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, **kwargs):
        seen.append(("enter", gc.isenabled(), kwargs))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with decode_modes.graph_capture("g", pool=1):
        assert not gc.isenabled()
    assert gc.isenabled() and seen == [("enter", False, {"pool": 1}), ("exit", False)]
    with pytest.raises(RuntimeError), decode_modes.graph_capture("g"):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with decode_modes.graph_capture("g"):
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()
