"""OpenAI's logit rules for Whisper, as fixed-shape tensor ops.

suppress_tokens "-1" (non-speech symbols + control tokens), suppress_blank at the first step,
and ApplyTimestampRules: timestamps in pairs, non-decreasing, the initial timestamp <= 1 s,
timestamps forced when their total probability beats every text token. OpenAI writes these with
Python branches on the step and boolean indexing, which read the device; here every rule is a
mask over the full [n, V] logits and the state lives on the device, so one definition serves
eager decoding and the CUDA graphs (a captured step cannot branch or sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.whisper_tokenizer import TIME_PRECISION, WhisperTokenizer

if TYPE_CHECKING:
    from engines.whisper_decoding import DecodeOptions
    from engines.whisper_fallback import Sampler

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RuleState:
    """What the logit rules remember, on the decoding device and updated in place (so a CUDA
    graph replaying `Rules.next_token` sees every update)."""

    first: Tensor  # 0-dim bool: the next token is the first after the prompt
    last: Tensor  # [n] bool: the last token was a timestamp
    penult: Tensor  # [n] bool: so was the one before (True before any token, as in OpenAI)
    ts_last: Tensor  # [n] long: index of the last timestamp token, -1 before any

    @classmethod
    def new(cls, n: int, device) -> "RuleState":
        return cls(torch.ones((), dtype=torch.bool, device=device), torch.zeros(n, dtype=torch.bool, device=device),
                   torch.ones(n, dtype=torch.bool, device=device), torch.full((n,), -1, device=device))

    def reset(self) -> None:
        self.first.fill_(True)
        self.last.zero_()
        self.penult.fill_(True)
        self.ts_last.fill_(-1)

    def rows(self, n: int) -> "RuleState":
        """Views of the first n rows (what a graph for n rows captures)."""
        return RuleState(self.first, self.last[:n], self.penult[:n], self.ts_last[:n])

    def select(self, rows: Tensor) -> "RuleState":
        """A copy holding only the listed rows, in that order (eager compaction)."""
        return RuleState(self.first, self.last[rows], self.penult[rows], self.ts_last[rows])


class Rules:
    """OpenAI's logit filters as fixed-shape tensor ops: no host sync and no branch on the step
    (the first step's rules are picked by the device flag `RuleState.first`), so eager decoding
    and the CUDA-graph modes (`whisper_static.py`) run this one definition."""

    def __init__(self, tok: WhisperTokenizer, opts: DecodeOptions, suppress: list[int], n_vocab: int, device):
        self.opts, self.ts0, self.eot = opts, tok.timestamp_begin, tok.eot
        cols = torch.arange(n_vocab, device=device)
        always = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        always[torch.tensor(suppress, dtype=torch.long, device=device)] = True
        if opts.timestamps:
            always[tok.no_timestamps] = True
        first = always.clone()
        if opts.suppress_blank:
            blank = [tok.blank, tok.eot]
            first[torch.tensor(blank, device=device)] = True
        if opts.timestamps:  # the first token is a timestamp no later than max_initial_timestamp
            max_init = round(opts.max_initial_timestamp / TIME_PRECISION)
            first |= (cols < self.ts0) | (cols > self.ts0 + max_init)
        self.ban_always, self.ban_first = always, first
        self.text_cols, self.ts_cols = cols[:self.ts0], cols[:n_vocab - self.ts0]

    def apply(self, logits: Tensor, s: RuleState) -> Tensor:
        """logits: [n, V] fp32, filtered in place and returned."""
        logits.masked_fill_(torch.where(s.first, self.ban_first, self.ban_always), NEG_INF)
        if not self.opts.timestamps:
            return logits
        text, ts = logits[:, :self.ts0], logits[:, self.ts0:]
        later = s.last & ~s.first  # the rules on earlier tokens start after the first one
        pair_open = later & ~s.penult  # a lone timestamp opened (or closed) a segment: no text
        # Timestamps never decrease and a segment is never empty; none after two in a row.
        lower = torch.where(pair_open, s.ts_last, s.ts_last + 1).clamp_min_(0)
        lower = torch.where(later & s.penult, ts.shape[1], lower).masked_fill_(s.first, 0)
        ts.masked_fill_(self.ts_cols < lower[:, None], NEG_INF)
        text.masked_fill_(self.text_cols < torch.where(pair_open, self.eot, 0)[:, None], NEG_INF)
        # Force a timestamp when their total probability beats every text token. OpenAI compares
        # log-probabilities; both sides share the normaliser, so raw logits do. (On the first
        # step every text token is banned already, so this changes nothing there.)
        force = ts.logsumexp(-1) > text.max(-1).values
        text.masked_fill_(force[:, None], NEG_INF)
        return logits

    def update(self, nxt: Tensor, s: RuleState) -> None:
        is_ts = nxt >= self.ts0
        s.penult.copy_(s.last | s.first)
        s.last.copy_(is_ts)
        s.ts_last.copy_(torch.where(is_ts, nxt - self.ts0, s.ts_last))
        s.first.fill_(False)

    def next_token(self, logits: Tensor, s: RuleState, sampler: Sampler | None = None) -> tuple[Tensor, Tensor]:
        """One step: filter `logits` [n, V] in place, take the argmax (or `sampler`'s draw), its
        log-probability (filtered logit - logsumexp of the filtered row, at temperature 1 as
        OpenAI scores samples too), and advance the state."""
        self.apply(logits, s)
        nxt = logits.argmax(-1) if sampler is None else sampler.draw(logits)
        lp = logits.gather(1, nxt[:, None])[:, 0] - logits.logsumexp(-1)
        self.update(nxt, s)
        return nxt, lp
