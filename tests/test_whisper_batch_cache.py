"""The Whisper decoder's greedy-pass cache on reused buffers (engines/whisper.py,
`TextDecoder.batch_cache`): a batch's cache takes the pages of the batch before (a fresh one
faults in ~300 MB of cross K/V per 16 windows of base, about a quarter of the decode's time on a
2-core VM), grows when a batch has more windows, and decoding batch after batch gives what each
batch gives alone. The cross K/V are projected a few windows at a time (`window_blocks`)."""
from __future__ import annotations

import torch
from whisper_random import assert_same_results, random_audio, random_decoder, random_whisper

from engines import whisper
from engines.whisper import _heads
from engines.whisper_decoding import DecodeOptions

# As tests/test_whisper_fallback.py: short windows, a fallback with samples, word times.
OPTS = DecodeOptions(max_length=60, compression_ratio_threshold=1.3, loop_check_every=8,
                     temperatures=(0.0, 0.5, 1.0), best_of=3)


def whole_projection(model: whisper.Whisper, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's cross K/V of the whole batch in one GEMM each: [layers, n, heads, T_a, dh]."""
    dec = model.decoder
    h = dec.layers[0].n_head
    ks, vs = zip(*(layer.cross.kv(audio).chunk(2, dim=-1) for layer in dec.layers))
    return (torch.stack([_heads(k, h) for k in ks]).to(dec.cache_dtype),
            torch.stack([_heads(v, h) for v in vs]).to(dec.cache_dtype))


def test_batch_cache_reuses_its_buffers_grows_for_more_windows_and_holds_the_projection():
    model = random_whisper()
    dec = model.decoder
    with torch.inference_mode():
        first = dec.batch_cache(random_audio(model, 3, seed=1), 60)
        storage = first.cross_k.untyped_storage().data_ptr()
        audio = random_audio(model, 5 if whisper.BLOCK_WINDOWS < 5 else 2 * whisper.BLOCK_WINDOWS + 1, seed=2)
        grown = dec.batch_cache(audio, 60)
        assert grown.cross_k.shape[1] == audio.shape[0]
        assert grown.cross_k.untyped_storage().data_ptr() != storage  # more windows: new buffers
        want_k, want_v = whole_projection(model, audio)
        torch.testing.assert_close(grown.cross_k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grown.cross_v, want_v, atol=1e-5, rtol=1e-5)
        storage = grown.cross_k.untyped_storage().data_ptr()
        audio = random_audio(model, 2, seed=3)
        again = dec.batch_cache(audio, 60)
        assert again.cross_k.untyped_storage().data_ptr() == storage  # fewer windows: the same pages
        assert again.self_k.untyped_storage().data_ptr() == grown.self_k.untyped_storage().data_ptr()
        assert again.cross_k.shape[1] == again.self_k.shape[1] == 2 and again.length == 0
        torch.testing.assert_close(again.cross_k, whole_projection(model, audio)[0], atol=1e-5, rtol=1e-5)
        dec.cache_dtype = torch.bfloat16  # another cache dtype: new buffers in it
        assert dec.batch_cache(audio, 60).cross_k.dtype == torch.bfloat16


def test_decoding_batch_after_batch_on_kept_buffers_equals_each_batch_alone():
    model = random_whisper()
    batches = [random_audio(model, n, seed=n) for n in (4, 2, 6, 3)]
    alone = []
    for audio in batches:
        model.decoder.kept = None  # fresh buffers for each batch
        alone.append(random_decoder(model, OPTS).decode_audio(audio, words=True))
    model.decoder.kept = None
    dec = random_decoder(model, OPTS)
    for audio, want in zip(batches, alone):
        assert_same_results(dec.decode_audio(audio, words=True), want)
    assert model.decoder.kept[0].shape[1] == 6
