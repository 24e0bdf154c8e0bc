"""webrtcvad flags, pause runs and speech regions."""
import numpy as np
import pytest
import soundfile as sf

from conftest import SPEECH, needs_shared
from transcribe.vad import FRAME_SECONDS, runs, speech_flags, speech_regions


def test_runs_finds_every_true_stretch():
    s, e = runs(np.array([0, 1, 1, 0, 1, 0, 0, 1], dtype=bool))
    assert s.tolist() == [1, 4, 7] and e.tolist() == [3, 5, 8]
    assert [x.tolist() for x in runs(np.zeros(3, dtype=bool))] == [[], []]


def test_regions_bridge_short_pauses_and_drop_blips():
    f = np.zeros(100, dtype=bool)
    f[10:40] = True
    f[45:70] = True  # 5 frames (0.15 s) apart: one region
    f[90:92] = True  # 0.06 s: a click, not speech
    (region,) = speech_regions(f, min_silence=0.3, min_speech=0.12)
    assert region == pytest.approx((10 * FRAME_SECONDS, 70 * FRAME_SECONDS))
    assert len(speech_regions(f, min_silence=0.1, min_speech=0.12)) == 2


def test_silence_is_not_speech_and_rates_are_checked():
    assert not speech_flags(np.zeros(16000, np.float32), 16000).any()
    assert speech_flags(np.zeros(100, np.float32), 16000).shape == (0,)  # under one frame
    with pytest.raises(ValueError, match="sample rate"):
        speech_flags(np.zeros(22050, np.float32), 22050)


@needs_shared
def test_speech_is_speech():
    audio, sr = sf.read(SPEECH / "librispeech_test_other" / "1688" / "1688-142285-0000.flac", dtype="float32")
    flags = speech_flags(audio, sr)
    assert flags.mean() > 0.7 and flags.shape == (audio.shape[0] // 480,)
