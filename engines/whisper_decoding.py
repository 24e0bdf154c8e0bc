"""Batched greedy decoding for Whisper with OpenAI's logit rules (API: `whisper_engine`).

One batch = up to `batch_size` windows (<= 30 s each): the encoder runs once on all of them,
cross-attention K/V are projected once, and the decoder advances every live window by one token
per step. Rules follow OpenAI `decoding.py` at temperature 0: suppress_tokens "-1" (non-speech
symbols + control tokens), suppress_blank at the first step, and ApplyTimestampRules
(timestamps in pairs, non-decreasing, initial timestamp <= 1 s, timestamps forced when their
total probability beats every text token). Per window we also compute OpenAI's no-speech
probability and zlib compression ratio; loops (ratio > 2.4) are cut early and their repeated
tail dropped, since with temperature 0 only there is no fallback decode to switch to.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.cpu_threads import decoder_threads
from engines.whisper import Whisper
from engines.whisper_tokenizer import TIME_PRECISION, WhisperTokenizer

NEG_INF = float("-inf")


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
    loop_check_every: int = 16  # steps between repetition checks
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


class _Rules:
    """Vectorised logit filters; state is per live row: last / penultimate token kinds."""

    def __init__(self, tok: WhisperTokenizer, opts: DecodeOptions, suppress: list[int], device):
        self.tok, self.opts = tok, opts
        self.suppress = torch.tensor(suppress, dtype=torch.long, device=device)
        self.blank = torch.tensor(tok.encode_pretoken(" ") + [tok.eot], device=device) \
            if tok.merges else torch.tensor([220, tok.eot], device=device)
        self.ts0, self.eot = tok.timestamp_begin, tok.eot
        self.max_init = round(opts.max_initial_timestamp / TIME_PRECISION)

    def reset(self, n: int, device) -> None:
        self.last = torch.zeros(n, dtype=torch.bool, device=device)
        self.penult = torch.ones(n, dtype=torch.bool, device=device)
        self.ts_last = torch.full((n,), -1, dtype=torch.long, device=device)

    def keep(self, rows: Tensor) -> None:
        self.last, self.penult, self.ts_last = self.last[rows], self.penult[rows], self.ts_last[rows]

    def update(self, nxt: Tensor, step: int) -> None:
        is_ts = nxt >= self.ts0
        self.penult = torch.ones_like(self.last) if step == 0 else self.last
        self.last = is_ts
        self.ts_last = torch.where(is_ts, nxt - self.ts0, self.ts_last)

    def apply(self, logits: Tensor, step: int) -> Tensor:
        """logits: [n, V] fp32, filtered in place and returned."""
        logits[:, self.suppress] = NEG_INF
        if step == 0 and self.opts.suppress_blank:
            logits[:, self.blank] = NEG_INF
        if not self.opts.timestamps:
            return logits
        ts0 = self.ts0
        logits[:, self.tok.no_timestamps] = NEG_INF
        if step == 0:
            logits[:, :ts0] = NEG_INF
            logits[:, ts0 + self.max_init + 1:] = NEG_INF
            return logits
        pair_open = self.last & ~self.penult  # just closed a segment or opened one: no text
        logits[self.last & self.penult, ts0:] = NEG_INF
        logits[pair_open, :self.eot] = NEG_INF
        lower = torch.where(pair_open, self.ts_last, self.ts_last + 1).clamp_min(0)
        cols = torch.arange(logits.shape[1] - ts0, device=logits.device)
        logits[:, ts0:].masked_fill_(cols[None, :] < lower[:, None], NEG_INF)
        # OpenAI compares log-probabilities; both sides share the normaliser, so raw logits do.
        force_ts = logits[:, ts0:].logsumexp(-1) > logits[:, :ts0].max(-1).values
        logits[force_ts, :ts0] = NEG_INF
        return logits


class GreedyDecoder:
    """Batched temperature-0 decoding of mel windows with a Whisper model."""

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, options: DecodeOptions = DecodeOptions(),
                 suppress_tokens: list[int] | None = None):
        self.model, self.tok, self.opts = model, tokenizer, options
        self.device = model.decoder.embed.weight.device
        suppress = tokenizer.suppress_tokens() if suppress_tokens is None else suppress_tokens
        self.rules = _Rules(tokenizer, options, suppress, self.device)
        self.prompt = tokenizer.sot_sequence(options.language, options.timestamps)

    @torch.inference_mode()
    def decode(self, mel: Tensor) -> list[WindowResult]:
        """mel: [B, n_mels, 3000] -> one WindowResult per window (same order)."""
        audio = self.model.encoder(mel.to(self.device, self.model.decoder.embed.weight.dtype))
        with decoder_threads(self.device, self.opts.decoder_threads):
            return self._greedy(audio)

    def _greedy(self, audio: Tensor) -> list[WindowResult]:
        """audio: encoder states [B, n_audio_ctx, d] -> results (cross K/V projected once)."""
        model, opts, tok = self.model, self.opts, self.tok
        b = audio.shape[0]
        cache = model.decoder.new_cache(audio, opts.max_length)
        del audio
        prompt = torch.tensor(self.prompt, device=self.device).expand(b, -1)
        logits = model.decoder(prompt, cache)
        no_speech = torch.zeros(b)
        if tok.no_speech >= 0:  # OpenAI reads it at the <|startoftranscript|> position
            no_speech = logits[:, 0].softmax(-1)[:, tok.no_speech].cpu()
        logits = logits[:, -1]
        self.rules.reset(b, self.device)
        rows = list(range(b))  # cache row -> window index, -1 once finished
        out: list[list[int]] = [[] for _ in range(b)]
        sum_lp, looped = [0.0] * b, [False] * b
        for step in range(opts.max_length - len(self.prompt)):
            filtered = self.rules.apply(logits, step)
            nxt = filtered.argmax(-1)
            lp = filtered.gather(1, nxt[:, None])[:, 0] - filtered.logsumexp(-1)
            self.rules.update(nxt, step)
            for r, (t, l) in enumerate(zip(nxt.tolist(), lp.tolist())):
                w = rows[r]
                if w < 0:
                    continue
                sum_lp[w] += l  # OpenAI counts the <|endoftext|> logprob too
                if t == tok.eot:
                    rows[r] = -1
                else:
                    out[w].append(t)
            if (step + 1) % opts.loop_check_every == 0:
                self._stop_loops(rows, out, looped)
            live = [r for r, w in enumerate(rows) if w >= 0]
            if not live or cache.length >= opts.max_length:
                break
            if len(live) <= 0.75 * len(rows):  # compact: finished rows stop costing compute
                keep = torch.tensor(live, device=self.device)
                cache.keep(keep)
                self.rules.keep(keep)
                nxt, rows = nxt[keep], [rows[r] for r in live]
            logits = model.decoder(nxt[:, None], cache)[:, 0]
        return [self._result(out[w], sum_lp[w], float(no_speech[w]), looped[w]) for w in range(b)]

    def _stop_loops(self, rows: list[int], out: list[list[int]], looped: list[bool]) -> None:
        """Finish rows whose text already compresses like a repetition loop."""
        thr = self.opts.compression_ratio_threshold
        if thr is None:
            return
        for r, w in enumerate(rows):
            if w >= 0 and len(out[w]) >= 32 and compression_ratio(self.tok.decode(out[w])) > thr:
                rows[r], looped[w] = -1, True

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
