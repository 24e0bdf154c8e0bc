"""Batched greedy decoding for Whisper with OpenAI's logit rules (API: `whisper_engine`).

One batch = up to `batch_size` windows (<= 30 s each): the encoder runs once on all of them,
cross-attention K/V are projected once, and the decoder advances every live window by one token
per step, filtered by `whisper_rules.Rules` (OpenAI `decoding.py` at temperature 0). Per window
we also compute OpenAI's no-speech probability and zlib compression ratio; loops (ratio > 2.4)
are cut early and their repeated tail dropped, since with temperature 0 only there is no
fallback decode to switch to.

Two loops share the rules, the host bookkeeping (`Progress`), the loop check and the results:
`_greedy` (eager: reads every token back, compacts finished rows away) and `_chunked` (the
CUDA-graph modes of `whisper_graph.py`: `loop_check_every` steps on the device between host
reads, the loop check at the same steps as eager).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.cpu_threads import decoder_threads
from engines.decode_graphs import DecodeMode
from engines.whisper import KVCache, Whisper
from engines.whisper_graph import Runner, WhisperGraphs
from engines.whisper_rules import RuleState, Rules
from engines.whisper_static import StaticDecoding
from engines.whisper_tokenizer import TIME_PRECISION, WhisperTokenizer


@dataclass(frozen=True)
class DecodeOptions:
    """Greedy decoding settings (OpenAI / faster-whisper defaults)."""

    language: str | None = "en"
    timestamps: bool = True
    max_length: int = 448  # decoder positions, prompt included
    suppress_blank: bool = True
    max_initial_timestamp: float = 1.0  # seconds
    compression_ratio_threshold: float | None = 2.4
    no_speech_threshold: float | None = 0.6
    logprob_threshold: float | None = -1.0
    loop_check_every: int = 16  # steps between repetition checks (the graph modes' steps per host read)
    # Token steps are many tiny ops; on a busy few-core CPU, OpenMP workers waiting on each
    # other cost more than they save (measured 8x slower per step with 2 threads under load).
    decoder_threads: int | None = 1  # None: keep torch's current setting

    def __post_init__(self) -> None:
        if not 4 <= self.max_length <= 448:
            raise ValueError(f"max_length must be in [4, 448], got max_length={self.max_length!r}")
        if self.max_initial_timestamp < 0:
            raise ValueError(f"max_initial_timestamp must be >= 0, got {self.max_initial_timestamp!r}")
        if self.decoder_threads is not None and self.decoder_threads < 1:
            raise ValueError(f"decoder_threads must be >= 1 or None, got {self.decoder_threads!r}")
        if self.loop_check_every < 1:
            raise ValueError(f"loop_check_every must be >= 1, got {self.loop_check_every!r}")


@dataclass(frozen=True)
class WindowResult:
    """One decoded window. segments: (start_s, end_s, text) relative to the window start."""

    text: str
    segments: tuple[tuple[float, float, str], ...]
    tokens: tuple[int, ...]
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    looped: bool


def compression_ratio(text: str) -> float:
    """len(utf-8) / len(zlib(utf-8)); repetitive (looping) text compresses far better."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def trim_repetition(tokens: list[int], max_period: int = 64) -> list[int]:
    """Drop a tail that repeats one block >= 3 times, keeping its first copy."""
    n = len(tokens)
    for p in range(1, min(max_period, n // 3) + 1):
        r = 1
        while (r + 1) * p <= n and tokens[n - (r + 1) * p:n - r * p] == tokens[n - p:]:
            r += 1
        if r >= 3:
            return tokens[:n - (r - 1) * p]
    return tokens


class Progress:
    """The host's view of one batch: buffer row -> window (-1 once finished), each window's
    tokens and log-probability sum, and whether a repetition loop cut it."""

    def __init__(self, n: int, rows: int | None = None):
        self.rows = list(range(n)) + [-1] * ((rows or n) - n)  # extra rows: padding, never live
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.sum_lp, self.looped = [0.0] * n, [False] * n

    def record(self, tokens: list[list[int]], logprobs: list[list[float]], eot: int) -> None:
        """Steps of tokens and log-probabilities, [step][buffer row], onto the live windows."""
        for step_tokens, step_lps in zip(tokens, logprobs):
            for r, (t, lp) in enumerate(zip(step_tokens, step_lps)):
                w = self.rows[r]
                if w < 0:
                    continue
                self.sum_lp[w] += lp  # OpenAI counts the <|endoftext|> logprob too
                if t == eot:
                    self.rows[r] = -1
                else:
                    self.out[w].append(t)

    def live(self) -> list[int]:
        return [r for r, w in enumerate(self.rows) if w >= 0]


class GreedyDecoder:
    """Batched temperature-0 decoding of mel windows with a Whisper model.

    The token loop runs eagerly (`_greedy`, the default) or, after `set_mode`, in one of the
    CUDA-graph modes of `whisper_graph.py` over the same rules, progress and result code."""

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, options: DecodeOptions = DecodeOptions(),
                 suppress_tokens: list[int] | None = None):
        self.model, self.tok, self.opts = model, tokenizer, options
        self.device = model.decoder.embed.weight.device
        self.suppress = tokenizer.suppress_tokens() if suppress_tokens is None else list(suppress_tokens)
        self.rules = Rules(tokenizer, options, self.suppress, model.dims.n_vocab, self.device)
        self.prompt = tokenizer.sot_sequence(options.language, options.timestamps)
        self.n_steps = options.max_length - len(self.prompt)  # tokens a window may get
        self.graphs = WhisperGraphs(self)  # eager until set_mode() picks a mode

    @property
    def mode(self) -> str:
        """The decoder mode in use: "full-graph", "unrolled" or "eager"."""
        return self.graphs.mode.value

    def set_mode(self, requested: str = "auto") -> str:
        """Choose the decoder mode ("auto", "full-graph", "unrolled", "eager") for the model's
        device; a fallback is logged once. Returns the mode chosen."""
        return self.graphs.set_mode(requested, self.device).value

    def reserve(self, max_batch: int) -> None:
        """Smallest batch the graph modes build their static buffers for."""
        self.graphs.reserve(max_batch)

    @torch.inference_mode()
    def decode(self, mel: Tensor) -> list[WindowResult]:
        """mel: [B, n_mels, 3000] -> one WindowResult per window (same order)."""
        return self.decode_audio(self.model.encoder(mel.to(self.device)))

    @torch.inference_mode()
    def decode_audio(self, audio: Tensor) -> list[WindowResult]:
        """Encoder states [B, n_audio_ctx, d] -> results, in the decoder mode in use. The cross
        K/V projection and the prompt run with all threads (the projection is one [B * 1500, d]
        GEMM per layer: 1.3 s with 1 thread, 0.8 s with 2 for 16 windows of base), the token
        loop with `decoder_threads`."""
        if self.graphs.mode is not DecodeMode.EAGER:
            built = self.graphs.ready(audio.shape[0])  # None once a failed capture fell back to eager
            if built is not None:
                return self._chunked(audio, *built)
        return self._greedy(audio)

    def start(self, cache: KVCache, n: int) -> tuple[Tensor, Tensor]:
        """Run the prompt for n windows into `cache` (cross K/V already there) -> the first
        step's logits [n, V] fp32 and the no-speech probabilities [n] (CPU)."""
        prompt = torch.tensor(self.prompt, device=self.device).expand(n, -1)
        logits = self.model.decoder(prompt, cache)
        no_speech = torch.zeros(n)
        if self.tok.no_speech >= 0:  # OpenAI reads it at the <|startoftranscript|> position
            no_speech = logits[:, 0].softmax(-1)[:, self.tok.no_speech].cpu()
        return logits[:, -1], no_speech

    def _greedy(self, audio: Tensor) -> list[WindowResult]:
        """audio: encoder states [B, n_audio_ctx, d] -> results (cross K/V projected once)."""
        b = audio.shape[0]
        cache = self.model.decoder.new_cache(audio, self.opts.max_length)
        del audio
        logits, no_speech = self.start(cache, b)
        state, progress = RuleState.new(b, self.device), Progress(b)
        with decoder_threads(self.device, self.opts.decoder_threads):
            for step in range(self.n_steps):
                nxt, lp = self.rules.next_token(logits, state)
                progress.record([nxt.tolist()], [lp.tolist()], self.tok.eot)  # one host sync per token
                if (step + 1) % self.opts.loop_check_every == 0:
                    self.stop_loops(progress)
                live = progress.live()
                if not live or step + 1 == self.n_steps:
                    break
                if len(live) <= 0.75 * len(progress.rows):  # compact: finished rows stop costing compute
                    keep = torch.tensor(live, device=self.device)
                    cache.keep(keep)
                    state = state.select(keep)
                    nxt, progress.rows = nxt[keep], [progress.rows[r] for r in live]
                logits = self.model.decoder(nxt[:, None], cache)[:, 0]
        return self.results(progress, no_speech)

    def _chunked(self, audio: Tensor, static: StaticDecoding, runner: Runner) -> list[WindowResult]:
        """The graph modes' loop: `runner.steps` steps on the device per chunk, then one host
        read of the chunk's tokens. The loop check runs where eager runs it (every
        `loop_check_every` steps, which chunks never straddle); when fewer live rows fit a
        smaller batch bucket, they move to the front of the static buffers and its graph runs."""
        n = audio.shape[0]
        no_speech = static.load(audio)
        b = static.bucket(n)
        progress, s0 = Progress(n, rows=b), 0
        with decoder_threads(self.device, self.opts.decoder_threads):
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
                    static.keep(live, positions=len(self.prompt) + s0)
                    progress.rows = [progress.rows[r] for r in live] + [-1] * (b - len(live))
                    changed = True
                if changed:  # loop cuts and moved rows: the device learns which rows are done
                    static.set_done([w < 0 for w in progress.rows])
        return self.results(progress, no_speech)

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
        return [self._result(out, lp, float(ns), looped)
                for out, lp, ns, looped in zip(progress.out, progress.sum_lp, no_speech, progress.looped)]

    def _result(self, tokens: list[int], sum_lp: float, no_speech: float, looped: bool) -> WindowResult:
        tok, opts = self.tok, self.opts
        avg_lp = sum_lp / (len(tokens) + 1)
        text = tok.decode(tokens)
        ratio = compression_ratio(text)
        if looped or (opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold):
            looped, tokens = True, trim_repetition(tokens)
            text = tok.decode(tokens)
        silent = (opts.no_speech_threshold is not None and no_speech > opts.no_speech_threshold
                  and not (opts.logprob_threshold is not None and avg_lp > opts.logprob_threshold))
        if silent:
            return WindowResult("", (), tuple(tokens), avg_lp, no_speech, ratio, looped)
        return WindowResult(text.strip(), self._segments(tokens), tuple(tokens), avg_lp, no_speech, ratio, looped)

    def _segments(self, tokens: list[int]) -> tuple[tuple[float, float, str], ...]:
        """Split at timestamp tokens: <|a|> text <|b|> -> (a, b, text). Unclosed text ends at 30 s."""
        ts0, segs, start, cur, prev_end = self.tok.timestamp_begin, [], None, [], 0.0
        for t in tokens:
            if t < ts0:
                cur.append(t)
                continue
            sec = (t - ts0) * TIME_PRECISION
            if cur:  # closes the open segment (or text that followed a closed one)
                segs.append((prev_end if start is None else start, sec, self.tok.decode(cur).strip()))
                start, cur, prev_end = None, [], sec
            else:
                start = sec
        if cur:
            segs.append((prev_end if start is None else start, 30.0, self.tok.decode(cur).strip()))
        return tuple(s for s in segs if s[2])
