"""Architectures beyond the shared fixtures (striding x4, dw_striding x16 with 128 mels, tied
biases, no xscaling, biases on, pure CTC) reproduce NeMo 3.0.0's outputs end to end."""
import numpy as np
import pytest
import torch

from conftest import EXTRA_VARIANTS, NEMO_EXTRA, Reference, needs_shared
from engines.checkpoint import NemoArchive
from engines.parakeet import ParakeetEngine
from transcribe.features import LogMel
from transcribe.audio import load_audio


@pytest.fixture(scope="module", params=EXTRA_VARIANTS)
def extra(request):
    ref = Reference(request.param, NEMO_EXTRA)
    return ParakeetEngine.from_nemo(ref.nemo, "cpu"), ref


@needs_shared
def test_features_and_encoder_match_nemo(extra):
    engine, ref = extra
    with NemoArchive(ref.nemo) as archive:
        logmel = LogMel.from_archive(archive)
    for i in range(len(ref.files)):
        audio = torch.from_numpy(load_audio(ref.audio_path(i), 16000))
        with torch.inference_mode():
            feats, flen = logmel(audio[None], torch.tensor([len(audio)]))
            feats = feats[0, :, : int(flen[0])].numpy()  # [n_mels, frames]
            enc, elen = engine.encoder(torch.from_numpy(feats)[None], flen)
        want_f, want_e = ref.array("features", i), ref.array("encoder", i)
        assert feats.shape == want_f.shape and int(elen) == want_e.shape[1]
        np.testing.assert_allclose(feats, want_f, atol=1e-3)
        np.testing.assert_allclose(enc[0, :, : int(elen)].numpy(), want_e, atol=1e-3)


@needs_shared
def test_tokens_text_and_words_match_nemo(extra):
    engine, ref = extra
    results = engine.transcribe([load_audio(ref.audio_path(i), 16000) for i in range(len(ref.files))])
    for f, r in zip(ref.files, results):
        assert r.tokens == f["tokens"], f["audio"]
        assert r.text == f["transcribe_text"], f["audio"]
        assert [(w.word, w.start, w.end) for w in r.words] == [(w["word"], w["start"], w["end"]) for w in f["words"]]
