"""Temperature fallback for the Whisper windows greedy decoding got wrong (OpenAI's
`transcribe.decode_with_fallback`; faster-whisper's choice when every temperature fails).

A window is decoded again when its text compresses like a loop (ratio > 2.4, or the loop
check cut it) or its average log-probability is below -1, unless it is silence (no-speech
probability > 0.6 with that low a log-probability: the window is dropped as OpenAI drops it).
It is then sampled at 0.2, 0.4, ... 1.0, `best_of` samples per temperature; the sample with the
best mean token log-probability wins (OpenAI's ranker without length penalty; a sample the loop
check cut ranks after every other) and the window stops at the first temperature whose winner
passes. When none passes: the attempt, greedy included, with the highest average
log-probability among those that did not loop, else among all (faster-whisper).

Each sample draws from its own generator, seeded from the window's greedy tokens, the
temperature and the sample's index: a window's text does not depend on which windows shared its
batch, in what order, or on the run, so transcripts stay reproducible. The samples reuse the
greedy pass's cross K/V, one copy per window for all its samples (their queries attend together,
`whisper.CrossAttention`), and run in the eager loop whatever the decoder mode: fallback is
rare (15 of 307 windows over the 235 files of our speech set).
"""
from __future__ import annotations

import zlib
from array import array
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.whisper import KVCache

if TYPE_CHECKING:
    from engines.whisper_decoding import DecodeOptions, GreedyDecoder, WindowResult

SEED_MASK = (1 << 63) - 1


def needs_fallback(res: WindowResult, opts: DecodeOptions) -> bool:
    """OpenAI's test: too repetitive or too unlikely, and not silence."""
    unlikely = opts.logprob_threshold is not None and res.avg_logprob < opts.logprob_threshold
    if unlikely and opts.no_speech_threshold is not None and res.no_speech_prob > opts.no_speech_threshold:
        return False  # silence
    return res.looped or unlikely  # looped: ratio > compression_ratio_threshold, or cut by the loop check


def last_resort(attempts: list[WindowResult]) -> WindowResult:
    """Every temperature failed: the most likely attempt that did not loop, else the most likely."""
    return max([a for a in attempts if not a.looped] or attempts, key=lambda a: a.avg_logprob)


def sample_seed(tokens: tuple[int, ...], temperature_index: int, sample: int) -> int:
    """A generator seed from what identifies a sample: the window's greedy tokens (its content),
    the temperature's index and the sample's index."""
    window = zlib.crc32(array("q", tokens).tobytes())
    return (window * 1_000_003 + temperature_index * 1009 + sample) & SEED_MASK


class Sampler:
    """Per-row seeded draws from softmax(logits / temperature): one uniform number per row and
    step from the row's own generator, inverted through the row's cumulative distribution (a
    noise draw per vocabulary entry cost 6 % of the fallback's time)."""

    def __init__(self, temperature: float, seeds: list[int], device: torch.device | str):
        if temperature <= 0:
            raise ValueError(f"sampling needs a temperature > 0, got {temperature!r}")
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def draw(self, logits: Tensor) -> Tensor:
        """logits [n, V] (filtered: banned tokens at -inf) -> one token id per row [n]."""
        cdf = (logits.double() / self.temperature).softmax(-1).cumsum_(-1)
        u = torch.cat([torch.rand(1, generator=g, device=g.device, dtype=torch.float64) for g in self.generators])
        # The first entry whose cumulative probability exceeds u * total: never a banned token
        # (its entry equals the one before it), u < 1 keeps it inside the row.
        picked = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)[:, 0]
        return picked.clamp_max_(logits.shape[1] - 1)


class Fallback:
    """Re-decodes one batch's failed windows (see the module doc) with `decoder`'s eager loop."""

    def __init__(self, decoder: GreedyDecoder):
        self.decoder = decoder

    def redecode(self, results: list[WindowResult], cross_k: Tensor, cross_v: Tensor,
                 order: list[int]) -> list[WindowResult]:
        """results: one batch's greedy results; row r of cross_k / cross_v [layers, rows, heads,
        T_audio, d / heads] holds window order[r]'s audio -> results with fallbacks applied."""
        opts = self.decoder.opts
        todo = [w for w, r in enumerate(results) if needs_fallback(r, opts)]
        if not todo or len(opts.temperatures) < 2:
            return results
        row_of = {w: r for r, w in enumerate(order) if w >= 0}
        tried = {w: [results[w]] for w in todo}
        per_batch = max(1, len(order) // opts.best_of)  # about the greedy batch's rows at once
        for ti, temperature in enumerate(opts.temperatures[1:], 1):
            for s in range(0, len(todo), per_batch):
                group = todo[s:s + per_batch]
                seeds = [sample_seed(results[w].tokens, ti, k) for w in group for k in range(opts.best_of)]
                sampler = Sampler(temperature, seeds, cross_k.device)
                tried_now = self._best_samples(cross_k, cross_v, [row_of[w] for w in group], sampler,
                                               [results[w].language for w in group])
                for w, best in zip(group, tried_now):
                    tried[w].append(best)
            todo = [w for w in todo if needs_fallback(tried[w][-1], opts)]
            if not todo:
                break
        out = list(results)
        for w, attempts in tried.items():
            best = attempts[-1] if not needs_fallback(attempts[-1], opts) else last_resort(attempts)
            # The samples ran in the greedy pass's language, given: its detection's probability stays.
            out[w] = replace(best, language_probability=results[w].language_probability)
        return out

    def _best_samples(self, cross_k: Tensor, cross_v: Tensor, rows: list[int], sampler: Sampler,
                      languages: list[str | None]) -> list[WindowResult]:
        """Decode `best_of` samples of each window whose audio is in cross row `rows[i]`, in
        `languages[i]` (the greedy pass's), with `sampler` -> each window's winner. A window's
        samples share its cross K/V row."""
        dec, k = self.decoder, self.decoder.opts.best_of
        idx = torch.tensor(rows, device=cross_k.device)
        layers, _, heads, _, d_head = cross_k.shape
        self_shape = (layers, len(rows) * k, dec.opts.max_length, heads * d_head)
        # The self K/V in the decoder's compute dtype, which the cross K/V's may differ from.
        self_kv = {"dtype": dec.model.decoder.dtype, "device": cross_k.device}
        cache = KVCache(torch.empty(self_shape, **self_kv), torch.empty(self_shape, **self_kv),
                        cross_k.index_select(1, idx), cross_v.index_select(1, idx), group=k)
        languages = [lang for lang in languages for _ in range(k)]  # each window's, for its k samples
        progress, no_speech = dec.token_loop(cache, len(rows) * k, sampler, languages)
        score = [(not cut, lp / max(1, len(out))) for out, lp, cut in zip(progress.out, progress.sum_lp, progress.looped)]
        best = [max(range(s, s + k), key=score.__getitem__) for s in range(0, len(rows) * k, k)]
        return [dec.window_result(progress.out[j], progress.lps[j], progress.sum_lp[j], float(no_speech[j]),
                                  progress.looped[j], sampler.temperature, progress.languages[j]) for j in best]
