"""Batched decoding for Whisper with OpenAI's logit rules (API: `whisper_engine`).

One batch = up to `batch_size` windows (<= 30 s each): the encoder runs once on all of them,
cross-attention K/V are projected once, and the decoder advances every live window by one token
per step, filtered by `whisper_rules.Rules` (OpenAI `decoding.py`), greedily. Per window we also
compute OpenAI's no-speech probability and zlib compression ratio; loops (ratio > 2.4) are cut
early. Windows that loop or come out unlikely are then sampled at rising temperatures
(`whisper_fallback`); a loop nothing replaced keeps its first copy of the repeated tail.

Two loops share the rules, the host bookkeeping (`Progress`), the loop check and the results:
`token_loop` (eager: reads every token back, compacts finished rows away; also the fallback's
sampling loop) and `_chunked` (the CUDA-graph modes of `whisper_graph.py`: `loop_check_every`
steps on the device between host reads, the loop check at the same steps as eager).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engines.cpu_threads import DECODER_THREADS, decoder_threads, fastest_threads
from engines.decode_modes import GRAPH_ERRORS, DecodeMode
from engines.stage_times import StageTimes
from engines.whisper import KVCache, Whisper
from engines.whisper_alignment import Aligner
from engines.whisper_alignment import alignment_heads as default_alignment_heads
from engines.whisper_fallback import Fallback, Sampler
from engines.whisper_graph import Runner, WhisperGraphs
from engines.whisper_progress import Progress, compression_ratio, trim_repetition
from engines.whisper_rules import RuleState, Rules
from engines.whisper_static import StaticDecoding
from engines.whisper_tokenizer import WhisperTokenizer
from engines.whisper_words import WindowSegment, split_segments, window_words


# The eager loop compacts its rows once at most this share of them is live: each step then costs
# the live rows only, while a compaction copies a few rows' cross K/V (`Progress.keep`).
COMPACT_AT = 0.75


@dataclass(frozen=True)
class DecodeOptions:
    """Decoding settings (OpenAI / faster-whisper defaults)."""

    language: str | None = "en"  # None: each window's own, detected as OpenAI's detect_language does
    task: str = "transcribe"  # or "translate": into English (multilingual models)
    timestamps: bool = True
    max_length: int = 448  # decoder positions, prompt included
    suppress_blank: bool = True
    max_initial_timestamp: float = 1.0  # seconds
    compression_ratio_threshold: float | None = 2.4
    no_speech_threshold: float | None = 0.6
    logprob_threshold: float | None = -1.0
    # Greedy first (the batched pass); windows that fail the thresholds above are sampled at
    # the later temperatures, best_of samples each (`whisper_fallback`). (0.0,): greedy only.
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    best_of: int = 5
    loop_check_every: int = 16  # steps between repetition checks (the graph modes' steps per host read)
    # Text the decoder reads as what came before each window (OpenAI's initial_prompt): names,
    # spellings and style to follow. It goes before every window of a file, as faster-whisper's
    # batched pipeline does (OpenAI's transcribe gives it to the first window only, unless
    # carry_initial_prompt); its last n_text_ctx // 2 - 1 tokens are kept.
    initial_prompt: str | None = None

    def __post_init__(self) -> None:
        if not 4 <= self.max_length <= 448:
            raise ValueError(f"max_length must be in [4, 448], got max_length={self.max_length!r}")
        if self.max_initial_timestamp < 0:
            raise ValueError(f"max_initial_timestamp must be >= 0, got {self.max_initial_timestamp!r}")
        if self.loop_check_every < 1:
            raise ValueError(f"loop_check_every must be >= 1, got {self.loop_check_every!r}")
        t = self.temperatures
        if not t or t[0] != 0 or any(not 0 < x <= 2 for x in t[1:]):
            raise ValueError(f"temperatures must start with 0.0, then values in (0, 2], got {t!r}")
        if self.best_of < 1:
            raise ValueError(f"best_of must be >= 1, got {self.best_of!r}")


@dataclass(frozen=True)
class WindowResult:
    """One decoded window, times in seconds from its start. segments: (start, end, text);
    tokens: the decoded ids (timestamps included), token_logprobs: each one's log-probability;
    words: (start, end, word, probability), filled when decoded with words=True."""

    text: str
    segments: tuple[tuple[float, float, str], ...]
    tokens: tuple[int, ...]
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    looped: bool
    token_logprobs: tuple[float, ...] = ()
    words: tuple[tuple[float, float, str, float], ...] = ()
    temperature: float = 0.0  # > 0: the temperature fallback's sample (`whisper_fallback`)
    language: str | None = None  # the language code it was decoded in (None: an English-only model)
    language_probability: float | None = None  # the detection's, where this window detected it


def previous_text(tok: WhisperTokenizer, initial_prompt: str | None, n_text_ctx: int) -> list[int]:
    """`<|startofprev|>` and the prompt's tokens (OpenAI: " " + the stripped text, its last
    n_text_ctx // 2 - 1 tokens), or [] without a prompt (None or blank)."""
    text = (initial_prompt or "").strip()
    if not text:
        return []
    if tok.sot_prev < 0:
        raise ValueError("this model's vocabulary has no <|startofprev|> token to give a prompt with")
    return [tok.sot_prev] + tok.encode(" " + text)[-(n_text_ctx // 2 - 1):]


class GreedyDecoder:
    """Batched decoding of mel windows with a Whisper model: greedy, then the fallback.

    The greedy token loop runs eagerly (`_greedy`, the default) or, after `set_mode`, in one of the
    CUDA-graph modes of `whisper_graph.py` over the same rules, progress and result code."""

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, options: DecodeOptions = DecodeOptions(),
                 suppress_tokens: list[int] | None = None,
                 alignment_heads: tuple[tuple[int, int], ...] | None = None):
        """alignment_heads: (decoder layer, head) pairs for word times (None: OpenAI's default,
        see `whisper_alignment.alignment_heads`)."""
        self.model, self.tok, self.opts = model, tokenizer, options
        self.device = model.decoder.embed.weight.device
        self.suppress = tokenizer.suppress_tokens() if suppress_tokens is None else list(suppress_tokens)
        self.rules = Rules(tokenizer, options, self.suppress, model.dims.n_vocab, self.device)
        # [<|startofprev|> initial prompt] sot [language task] [notimestamps]; with the language
        # left to detection, "en" holds its place until `start` puts each window's own there.
        self.previous = previous_text(tokenizer, options.initial_prompt, model.dims.n_text_ctx)
        self.sot_index = len(self.previous)
        self.prompt = self.previous + tokenizer.sot_sequence(options.language, options.timestamps, options.task)
        if len(self.prompt) >= options.max_length:
            raise ValueError(f"max_length={options.max_length} leaves no room to decode after the prompt "
                             f"({len(self.prompt)} tokens)")
        self.language_ids = tokenizer.languages  # code -> token id
        self.languages = {i: code for code, i in self.language_ids.items()}  # token id -> code
        self.detect_language = options.language is None and tokenizer.is_multilingual
        # Every window's language when none is detected: the one the prompt names (None when
        # detected, where "en" only holds the slot, and for English-only models, whose prompt
        # names none). A silent piece, never decoded, takes it too (WhisperEngine).
        s = self.sot_index
        named = self.languages.get(self.prompt[s + 1]) if len(self.prompt) > s + 1 else None
        self.prompt_language = None if self.detect_language else named
        self.n_steps = options.max_length - len(self.prompt)  # tokens a window may get
        self.graphs = WhisperGraphs(self)  # eager until set_mode() picks a mode
        self.cpu_threads = DECODER_THREADS  # the token loops' threads on the CPU, until reserve() measures
        self.fallback = Fallback(self)
        # encoder, decoder (cross K/V, prompt, greedy token loop), fallback, words: see decode()
        self.stage_seconds = StageTimes(self.device)
        heads = alignment_heads or default_alignment_heads(model.dims, None)
        self.aligner = Aligner(model.decoder, heads, tokenizer.sot_sequence(options.language, False, options.task),
                               tokenizer.eot)

    @property
    def mode(self) -> str:
        """The decoder mode in use: "full-graph", "unrolled" or "eager"."""
        return self.graphs.mode.value

    def set_mode(self, requested: str = "auto") -> str:
        """Choose the decoder mode ("auto", "full-graph", "unrolled", "eager") for the model's
        device; a fallback is logged once. Returns the mode chosen."""
        return self.graphs.set_mode(requested, self.device).value

    def reserve(self, max_batch: int) -> None:
        """Startup: the smallest batch the graph modes build their static buffers for; on the
        CPU, the token loops' thread count (`engines/cpu_threads.py`)."""
        self.graphs.reserve(max_batch)
        if self.device.type == "cpu":
            self.cpu_threads = self._fastest_cpu_threads(max_batch)

    @torch.inference_mode()
    def _fastest_cpu_threads(self, max_batch: int, steps: int = 2) -> int:
        """Time the prompt and a few token steps of a batch of seeded random audio states with 1
        thread and with all (about 0.45 s for base). Threads pay when the machine is idle:
        16 windows of test-other decoded 1.3x faster with 2 threads on 2 cores, but a token step
        is many small ops, and under outside load 2 threads ran 8x slower per step."""
        dims, gen = self.model.dims, torch.Generator().manual_seed(0)
        b = min(max_batch, 4)
        audio = torch.randn(b, dims.n_audio_ctx, dims.n_audio_state, generator=gen).to(self.model.encoder.dtype)
        cache = self.model.decoder.new_cache(audio, len(self.prompt) + steps)
        prompt = torch.tensor(self.prompt).expand(b, -1)

        def run() -> None:
            cache.length = 0
            tokens = self.model.decoder(prompt, cache)[:, -1:].argmax(-1)
            for _ in range(steps):
                tokens = self.model.decoder(tokens, cache).argmax(-1)

        return fastest_threads(run, rounds=2)

    @torch.inference_mode()
    def decode(self, mel: Tensor, frames: list[int] | None = None, words: bool = False,
               languages: list[str | None] | None = None, after_pause: list[bool] | None = None,
               second_look: bool = True) -> list[WindowResult]:
        """mel: [B, n_mels, 3000] -> one WindowResult per window (same order). words: also word
        times (`whisper_alignment`), for which frames gives each window's mel frames of real
        audio (None: all 3000). languages: a window's language where it is known already (its
        file's, `start`), None where it is to be detected. after_pause: the windows that begin
        in a pause after earlier speech (`whisper_words.window_words`; None: none do).
        second_look: `_silent_when_zero_padded` (the engine's tails have stricter rules of
        their own, `whisper_engine.TAIL_NO_SPEECH`)."""
        t = time.perf_counter()
        audio = self.model.encoder(mel.to(self.device))
        self.stage_seconds.lap("encoder", t)
        return self.decode_audio(audio, frames, words, languages, after_pause, mel if second_look else None)

    @torch.inference_mode()
    def decode_audio(self, audio: Tensor, frames: list[int] | None = None, words: bool = False,
                     languages: list[str | None] | None = None, after_pause: list[bool] | None = None,
                     mel: Tensor | None = None) -> list[WindowResult]:
        """Encoder states [B, n_audio_ctx, d] -> results, in the decoder mode in use (see
        `decode` for frames, words, languages and after_pause; `mel`, the windows the states
        are of, for `_silent_when_zero_padded`). The cross K/V projection, the prompt and the word
        alignment run with all threads (the projection, [1500, d] rows per window and layer: 1.3 s
        with 1 thread, 0.8 s with 2 for 16 windows of base, measured as one GEMM a layer), the
        token loop with `cpu_threads`."""
        frames = frames or [2 * audio.shape[1]] * audio.shape[0]
        t = time.perf_counter()
        built = self.graphs.ready(audio.shape[0]) if self.graphs.mode is not DecodeMode.EAGER else None
        results = None
        if built is not None:  # None also once a failed capture fell back to eager
            try:
                results, order = self._chunked(audio, *built, languages)
                cross_k, cross_v = built[0].cross_k, built[0].cross_v
            except GRAPH_ERRORS as e:  # a replay the driver refuses: eager decodes this batch
                self.graphs.replay_failed(e)
        if results is None or self.graphs.unverified:  # eager, or a new capture's first batch
            eager, cache, eager_order = self._greedy(audio, languages)
            if results is None or not self.graphs.agrees_with_eager([r.tokens for r in results],
                                                                     [r.tokens for r in eager]):
                results, order, cross_k, cross_v = eager, eager_order, cache.cross_k, cache.cross_v
        self.stage_seconds.lap("decoder", t)
        if mel is not None:
            results = self._silent_when_zero_padded(results, mel, frames)
        return self.finish(results, cross_k, cross_v, order, frames, words, after_pause)

    def _silent_when_zero_padded(self, results: list[WindowResult], mel: Tensor, frames: list[int]
                                 ) -> list[WindowResult]:
        """Windows with text that one of OpenAI's two silence signals points at (average
        log-probability under its threshold, or no-speech probability over its own), decoded
        again with the mel after their audio set to 0, as OpenAI and faster-whisper pad it:
        silent there by OpenAI's rule (both signals), they are silent here. Our padding (the
        padded audio's own log-mel, the silence floor: `whisper_engine.WhisperFrontend`) keeps
        whisper-base's WER lower on speech, but on music or tones with no speech it gave the
        greedy pass or the fallback's samples "Thank you." or "Don't forget to subscribe"
        (no-speech 0.08-0.71), where faster-whisper gives nothing (0.71-0.77, log-probability
        under -1.2). One more greedy pass, for those windows only."""
        opts = self.opts
        if opts.no_speech_threshold is None or opts.logprob_threshold is None or self.tok.no_speech < 0:
            return results
        rows = [w for w, r in enumerate(results) if r.text and (
            r.avg_logprob < opts.logprob_threshold or r.no_speech_prob > opts.no_speech_threshold)]
        if not rows:
            return results
        t = time.perf_counter()
        padded = mel[rows].clone()
        for i, w in enumerate(rows):
            padded[i, :, frames[w]:] = 0.0
        # A fresh cache, not `batch_cache`: its kept buffers hold this batch's cross K/V, which
        # the fallback and the word alignment read next (reused here, they read these windows').
        cache = self.model.decoder.new_cache(self.model.encoder(padded.to(self.device)), self.opts.max_length)
        progress, no_speech = self.token_loop(cache, len(rows), languages=[results[w].language for w in rows])
        again = self.results(progress, no_speech)
        out = list(results)
        for w, r in zip(rows, again):
            if r.no_speech_prob > opts.no_speech_threshold and r.avg_logprob < opts.logprob_threshold:
                out[w] = replace(results[w], text="", segments=(), no_speech_prob=r.no_speech_prob)
        self.stage_seconds.lap("fallback", t)
        return out

    def finish(self, results: list[WindowResult], cross_k: Tensor, cross_v: Tensor, order: list[int],
               frames: list[int], words: bool, after_pause: list[bool] | None = None) -> list[WindowResult]:
        """The greedy results -> after the temperature fallback, and with word times when
        `words`; both read the audio from the cross K/V rows (`add_words` for the layout)."""
        t = time.perf_counter()
        results = self.fallback.redecode(results, cross_k, cross_v, order)
        t = self.stage_seconds.lap("fallback", t)
        if words:
            results = self.add_words(results, cross_k, cross_v, order, frames, after_pause)
            self.stage_seconds.lap("words", t)
        return results

    def start(self, cache: KVCache, n: int, languages: list[str | None] | None = None
              ) -> tuple[Tensor, Tensor, list[str | None], list[float | None]]:
        """Run the prompt for n windows into `cache` (cross K/V already there) -> the first
        step's logits [n, V] fp32, the no-speech probabilities [n] (CPU), each row's language
        and, for a row that detected it, its probability among the languages (else None).

        With the language left to detection, <|startoftranscript|> runs alone first and each
        row's language is the likeliest language token after it (OpenAI's `detect_language`,
        whose forward pass is this one: the same position, audio and cache), unless `languages`
        gives the row's (the fallback keeps the greedy pass's; a file's later pieces take the
        language of its first: None rows alone are detected); the rest of the prompt follows."""
        prompt = torch.tensor(self.prompt, device=self.device).expand(n, -1)
        probs: list[float | None] = [None] * n
        s = self.sot_index  # where <|startoftranscript|> sits: after the initial prompt
        if self.detect_language:
            detect = languages is None or None in languages
            # OpenAI detects from sot alone, at position 0 and without the initial prompt. Without
            # a prompt that pass is also the prompt's first position, so it runs either way.
            first = self.model.decoder(prompt[:, s:s + 1], cache) if detect or s == 0 else None
            if detect:
                ids = torch.tensor(list(self.languages), device=self.device)
                scores = first[:, 0, ids].float()
                best = scores.argmax(-1)
                top = scores.softmax(-1).gather(1, best[:, None])[:, 0]
                detected = [self.languages[i] for i in ids[best].tolist()]
                given = languages or [None] * n
                probs = [None if g else p for g, p in zip(given, top.tolist())]
                languages = [g or d for g, d in zip(given, detected)]
            chosen = torch.tensor([self.language_ids[c] for c in languages], device=self.device)
            rest = torch.cat([chosen[:, None], prompt[:, s + 2:]], 1)
            if s == 0:  # the detection's pass is the prompt's first position: keep it
                logits = torch.cat([first, self.model.decoder(rest, cache)], 1)
            else:  # the initial prompt goes first: the prompt runs (again) from position 0
                cache.length = 0
                logits = self.model.decoder(torch.cat([prompt[:, :s + 1], rest], 1), cache)
        else:
            logits = self.model.decoder(prompt, cache)
            languages = [self.prompt_language] * n
        no_speech = torch.zeros(n)
        if self.tok.no_speech >= 0:  # OpenAI reads it at the <|startoftranscript|> position
            no_speech = logits[:, s].softmax(-1)[:, self.tok.no_speech].cpu()
        return logits[:, -1], no_speech, languages, probs

    def _greedy(self, audio: Tensor, languages: list[str | None] | None = None
                ) -> tuple[list[WindowResult], KVCache, list[int]]:
        """audio: encoder states [B, n_audio_ctx, d] -> (results, the cache, the window whose
        cross K/V each cache row holds). Cross K/V are projected once. languages: `start`."""
        cache = self.model.decoder.batch_cache(audio, self.opts.max_length)
        progress, no_speech = self.token_loop(cache, audio.shape[0], languages=languages)
        return self.results(progress, no_speech), cache, progress.order

    def token_loop(self, cache: KVCache, n: int, sampler: Sampler | None = None,
                   languages: list[str | None] | None = None) -> tuple[Progress, Tensor]:
        """The eager token loop over n rows of `cache` (cross K/V filled): greedy, or with
        `sampler` drawing each token at a temperature; languages: see `start`.
        -> (progress, no-speech probabilities)."""
        logits, no_speech, languages, probs = self.start(cache, n, languages)
        state, progress = RuleState.new(n, self.device), Progress(n, languages=languages, language_probs=probs)
        with decoder_threads(self.device, self.cpu_threads):
            for step in range(self.n_steps):
                nxt, lp = self.rules.next_token(logits, state, sampler)
                progress.record([nxt.tolist()], [lp.tolist()], self.tok.eot)  # one host sync per token
                if (step + 1) % self.opts.loop_check_every == 0:
                    self.stop_loops(progress)
                live = progress.live()
                if not live or step + 1 == self.n_steps:
                    break
                # Compact: finished rows stop costing compute (not rows that share their audio).
                if len(live) <= COMPACT_AT * len(progress.rows) and cache.group == 1:
                    perm = progress.keep(live, len(live))
                    cache.keep(perm, len(live))
                    keep = torch.tensor(perm[:len(live)], device=self.device)
                    state, nxt = state.select(keep), nxt[keep]
                logits = self.model.decoder(nxt[:, None], cache)[:, 0]
        return progress, no_speech

    def _chunked(self, audio: Tensor, static: StaticDecoding, runner: Runner,
                 languages: list[str | None] | None = None) -> tuple[list[WindowResult], list[int]]:
        """The graph modes' loop: `runner.steps` steps on the device per chunk, then one host
        read of the chunk's tokens. The loop check runs where eager runs it (every
        `loop_check_every` steps, which chunks never straddle); when fewer live rows fit a
        smaller batch bucket, they move to the front of the static buffers and its graph runs.
        -> (results, the window whose cross K/V each static row holds)."""
        n = audio.shape[0]
        no_speech, languages, probs = static.load(audio, languages)
        b = static.bucket(n)
        progress, s0 = Progress(n, rows=b, languages=languages, language_probs=probs), 0
        with decoder_threads(self.device, self.cpu_threads):
            while s0 < self.n_steps:
                runner.run(b)
                s1 = min(s0 + runner.steps, self.n_steps)
                progress.record(*static.read(s0, s1, b), self.tok.eot)
                changed = s1 % self.opts.loop_check_every == 0 and self.stop_loops(progress)
                s0, live = s1, progress.live()
                if not live:
                    break
                if static.bucket(len(live)) < b:
                    b = static.bucket(len(live))
                    static.keep(progress.keep(live, b), len(live), positions=len(self.prompt) + s0)
                    changed = True
                if changed:  # loop cuts and moved rows: the device learns which rows are done
                    static.set_done([w < 0 for w in progress.rows])
        return self.results(progress, no_speech), progress.order

    def stop_loops(self, progress: Progress) -> bool:
        """Finish rows whose text already compresses like a repetition loop; True if any."""
        thr, cut = self.opts.compression_ratio_threshold, False
        if thr is None:
            return cut
        for r, w in enumerate(progress.rows):
            if w >= 0 and len(progress.out[w]) >= 32 and compression_ratio(self.tok.decode(progress.out[w])) > thr:
                progress.rows[r], progress.looped[w], cut = -1, True, True
        return cut

    def results(self, progress: Progress, no_speech: Tensor) -> list[WindowResult]:
        return [replace(self.window_result(out, lps, sum_lp, float(ns), looped, language=lang),
                        language_probability=prob)
                for out, lps, sum_lp, ns, looped, lang, prob
                in zip(progress.out, progress.lps, progress.sum_lp, no_speech, progress.looped, progress.languages,
                       progress.language_probs)]

    def window_result(self, tokens: list[int], lps: list[float], sum_lp: float, no_speech: float,
                      looped: bool, temperature: float = 0.0, language: str | None = None) -> WindowResult:
        """One window's decoded tokens and their log-probabilities -> its WindowResult (text,
        segments; a loop's repeated tail trimmed; empty when it is silence)."""
        tok, opts = self.tok, self.opts
        avg_lp = sum_lp / (len(tokens) + 1)
        text = tok.decode(tokens)
        ratio = compression_ratio(text)
        if looped or (opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold):
            looped, tokens = True, trim_repetition(tokens)
            text = tok.decode(tokens)
        lps = tuple(lps[:len(tokens)])
        silent = (opts.no_speech_threshold is not None and no_speech > opts.no_speech_threshold
                  and not (opts.logprob_threshold is not None and avg_lp > opts.logprob_threshold))
        if silent:
            return WindowResult("", (), tuple(tokens), avg_lp, no_speech, ratio, looped, lps,
                                temperature=temperature, language=language)
        return WindowResult(text.strip(), self._segments(split_segments(tokens, tok)), tuple(tokens), avg_lp,
                            no_speech, ratio, looped, lps, temperature=temperature, language=language)

    def _segments(self, segments: list[WindowSegment]) -> tuple[tuple[float, float, str], ...]:
        """(start, end, text) of the segments with text."""
        texts = [self.tok.decode(list(s.tokens)).strip() for s in segments]
        return tuple((s.start, s.end, text) for s, text in zip(segments, texts) if text)

    def add_words(self, results: list[WindowResult], cross_k: Tensor, cross_v: Tensor, order: list[int],
                  frames: list[int], after_pause: list[bool] | None = None) -> list[WindowResult]:
        """Word times for every window with text (`whisper_alignment`, `whisper_words`); row r of
        cross_k / cross_v [layers, rows, heads, T_audio, d/heads] holds window order[r]'s audio
        (-1: none); frames: mel frames of real audio per window. Segment times move to their
        words as OpenAI moves them."""
        eot = self.tok.eot
        texts = [[t for t in results[w].tokens if t < eot] if w >= 0 and results[w].text else [] for w in order]
        languages = [results[w].language if w >= 0 else None for w in order]
        starts = self.aligner.token_starts(cross_k, cross_v, texts, [frames[w] if w >= 0 else 0 for w in order],
                                           [self.language_ids[c] if c else None for c in languages])
        out = list(results)
        for r, w in enumerate(order):
            if not texts[r]:
                continue
            res = results[w]
            lps = [lp for t, lp in zip(res.tokens, res.token_logprobs) if t < eot]
            segments, words = window_words(split_segments(res.tokens, self.tok), starts[r], lps, self.tok,
                                           res.language, after_pause=bool(after_pause and after_pause[w]))
            out[w] = replace(res, segments=self._segments(segments),
                             words=tuple((x.start, x.end, x.word.strip(), x.probability) for ws in words for x in ws))
        return out
