"""The assembled Parakeet engine on real audio reproduces NeMo's greedy output end to end."""
import pytest

from conftest import Reference, needs_shared
from engines.parakeet import ParakeetEngine
from transcribe.audio import load_audio


@pytest.fixture(scope="module")
def engine_and_ref(reference: Reference):
    return ParakeetEngine.from_nemo(reference.nemo, "cpu"), reference


def test_batched_engine_matches_nemo(engine_and_ref):
    engine, ref = engine_and_ref
    pieces = [load_audio(ref.audio_path(i), 16000) for i in range(len(ref.files))]
    results = engine.transcribe(pieces)  # one padded batch of every file
    for f, r in zip(ref.files, results):
        assert r.tokens == f["tokens"], f["audio"]
        assert r.text == f["transcribe_text"], f["audio"]
        assert [(w.word, w.start, w.end) for w in r.words] == [(w["word"], w["start"], w["end"]) for w in f["words"]]
    assert set(engine.stage_seconds) >= {"features", "encoder", "decoder"}


@needs_shared
def test_hybrid_ctc_head_decodes():
    import numpy as np

    reference = Reference("tdt_ctc_tiny")
    engine = ParakeetEngine.from_nemo(reference.nemo, "cpu", decoding="ctc")
    results = engine.transcribe([load_audio(reference.audio_path(i), 16000) for i in range(len(reference.files))])
    for i, r in enumerate(results):  # every file, batched and padded
        lp = reference.array("ctc_logprobs", i)
        ids = lp.argmax(-1)
        blank = lp.shape[-1] - 1
        expected = [int(t) for k, t in enumerate(ids) if t != blank and (k == 0 or t != ids[k - 1])]
        assert r.tokens == expected and np.isfinite(lp).all(), i


@needs_shared
def test_consumed_state_builds_the_same_encoder_and_is_emptied():
    import torch

    from engines.checkpoint import NemoArchive, pop_sub_state_dict, sub_state_dict
    from engines.conformer import ConformerEncoder, EncoderConfig

    ref = Reference("tdt_tiny")
    with NemoArchive(ref.nemo) as a:
        cfg, state = EncoderConfig.from_nemo(a.config["encoder"]), a.state_dict()
    kept = ConformerEncoder.from_state(cfg, sub_state_dict(state, "encoder"))
    taken = pop_sub_state_dict(state, "encoder")
    assert taken and not any(k.startswith("encoder.") for k in state)  # popped out of the full dict
    consumed = ConformerEncoder.from_state(cfg, taken, consume=True)
    assert taken == {}
    feats = torch.from_numpy(ref.array("features", 0))[None]
    with torch.inference_mode():
        assert torch.equal(kept(feats, torch.tensor([feats.shape[2]]))[0], consumed(feats, torch.tensor([feats.shape[2]]))[0])


@needs_shared
def test_loading_models_does_not_import_torch_dynamo():
    """Building on the meta device must not run nn.Embedding's normal_ init, whose meta kernel
    imports torch._dynamo: that import cost 1.3-2.5 s of every model load. A fresh interpreter
    loads a Parakeet fixture and the bundled Whisper, then looks."""
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import sys\n"
            "from engines.parakeet import ParakeetEngine\n"
            "from engines.whisper_engine import WhisperEngine\n"
            f"ParakeetEngine.from_nemo({str(Reference('tdt_tiny').nemo)!r}, 'cpu')\n"
            "WhisperEngine.from_bundled()\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


@needs_shared
def test_a_batch_built_in_the_reused_host_buffer_holds_its_pieces_and_the_pad_value_alone():
    """`_batch` writes each row through numpy into the buffer earlier batches used (as on
    CUDA): a piece's frames, then the features' pad value up to the batch width, whatever an
    earlier, wider batch left there; audio pieces (features on the device) pad with zeros."""
    from dataclasses import replace

    import torch

    engine = ParakeetEngine.from_nemo(Reference("tdt_tiny").nemo, "cpu")
    engine.feature_cfg = replace(engine.feature_cfg, pad_value=-3.0)
    n_mels = engine.feature_cfg.features
    engine._host = torch.full((4 * n_mels * 400,), 7.0)  # left over from an earlier batch
    pieces = [torch.randn(n_mels, n) for n in (50, 120, 33)]
    x, lengths = engine._batch([p[:, :] for p in pieces[:1]] + [pieces[1].t().contiguous().t()] + pieces[2:])
    width = engine._width(120)
    assert x.shape == (3, n_mels, width) and lengths.tolist() == [50, 120, 33]
    assert x.data_ptr() == engine._host.data_ptr()  # the buffer's front, not a fresh tensor
    for row, p in zip(x, pieces):
        assert torch.equal(row[:, : p.shape[1]], p)
        assert (row[:, p.shape[1]:] == -3.0).all()

    engine.logmel = object()  # features on the device: pieces are audio [1, T], padded with 0
    audio = [torch.randn(1, 900), torch.randn(1, 1600)]
    x, lengths = engine._batch(audio)
    assert x.shape == (2, 1, 1600) and lengths.tolist() == [900, 1600]
    assert torch.equal(x[0, :, :900], audio[0]) and (x[0, :, 900:] == 0).all() and torch.equal(x[1], audio[1])


def test_the_python_api_refuses_audio_it_would_misread_naming_the_piece(engine_and_ref):
    """`transcribe` takes mono float samples: NaN (which spreads over the batch), integer PCM
    (read 32768 times too loud) or a [channels, T] array raise ValueError naming the piece,
    before any work; an empty list is an empty answer; a float64 piece is taken as float32."""
    import numpy as np

    engine, ref = engine_and_ref
    audio = load_audio(ref.audio_path(0), 16000)
    bad = {"NaN or infinite": np.where(np.arange(audio.size) == 7, np.nan, audio).astype(np.float32),
           "int16": (audio * 32767).astype(np.int16),
           r"mono samples \[T\], got shape \(2,": np.stack([audio, audio])}
    for why, piece in bad.items():
        with pytest.raises(ValueError, match=f"piece 1: .*{why}"):
            engine.transcribe([audio, piece])
    assert engine.transcribe([]) == []
    assert engine.transcribe([audio.astype(np.float64)]) == engine.transcribe([audio])
    with pytest.raises(ValueError, match="decoding must be one of auto, ctc, got 'bogus'"):
        ParakeetEngine.from_nemo(ref.nemo, "cpu", decoding="bogus")


def test_whisper_refuses_the_same_audio():
    """Whisper's `transcribe` checks its pieces the same way (`checked_pieces`)."""
    import numpy as np

    from conftest import bundled_whisper_fp32

    engine = bundled_whisper_fp32(batch_size=1)
    with pytest.raises(ValueError, match="piece 0: audio contains NaN"):
        engine.transcribe([np.full(16000, np.nan, np.float32)])
    with pytest.raises(ValueError, match="piece 0: audio must be float samples"):
        engine.transcribe([np.zeros(16000, np.int16)])
    assert engine.transcribe([]) == []
