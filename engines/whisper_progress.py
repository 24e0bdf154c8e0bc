"""A batch's decoded tokens as the host tracks them, and the repetition-loop measures.

`Progress` maps buffer rows to windows while the token loops (`whisper_decoding`) compact or
move rows; `compression_ratio` and `trim_repetition` are how a loop is recognised and cut.
"""
from __future__ import annotations

import zlib


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
    """The host's view of one batch: buffer row -> live window (`rows`, -1 once finished),
    buffer row -> window whose audio (cross K/V) it holds (`order`, -1: padding), each window's
    tokens, their log-probabilities and sum, and whether a repetition loop cut it."""

    def __init__(self, n: int, rows: int | None = None, languages: list[str | None] | None = None,
                 language_probs: list[float | None] | None = None):
        self.rows = list(range(n)) + [-1] * ((rows or n) - n)  # extra rows: padding, never live
        self.languages = list(languages) if languages is not None else [None] * n  # per window
        # per window: the detection's probability where it detected its language (else None)
        self.language_probs = list(language_probs) if language_probs is not None else [None] * n
        self.order = list(self.rows)
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
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
                    self.lps[w].append(lp)

    def live(self) -> list[int]:
        return [r for r, w in enumerate(self.rows) if w >= 0]

    def keep(self, live: list[int], width: int) -> list[int]:
        """Rows `live` move to the front, `width` rows stay in use. Each live row past the front
        swaps with a finished row inside it and every other row stays where it is, so a
        compaction copies two cache rows per swap: moving the live rows up in order moved every
        row after the first finished one (the cross K/V, 18 MB a row for whisper-base, are the
        bulk: 4.3 s of test-other's 19.8 s of decoding). Finished rows keep their audio for the
        fallback and the word alignment. -> the permutation: new row i holds old row perm[i]
        (len(order) rows; perm[:len(live)] are the live rows, in no particular order)."""
        n, live_set = len(live), set(live)
        holes = [r for r in range(n) if r not in live_set]
        movers = [r for r in live if r >= n]
        perm = list(range(len(self.order)))
        for h, m in zip(holes, movers):
            perm[h], perm[m] = m, h
        self.order = [self.order[r] for r in perm]
        self.rows = [self.rows[r] for r in perm[:n]] + [-1] * (width - n)
        return perm
