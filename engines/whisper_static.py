"""Fixed-shape Whisper decoding state: one token step with no host sync, for CUDA graphs.

Every tensor a step touches is preallocated for `capacity` rows and written in place, so a
graph captured over `step(b)` (rows 0..b-1, one graph per batch bucket b) replays it exactly:

- `token` [cap, 1] (the next model input), `step_no` [1] (steps taken in this batch: the token
  chosen at step s sits at position prompt + s), `logits` [cap, V] fp32;
- `StaticCache`: self K/V [layers, cap, max_length, d] written at the position by index_copy_
  and attended over in full through the mask positions <= pos (entries past it are stale but
  finite: the buffers start zeroed), cross K/V projected once per batch;
- the rules' `RuleState`, `done` [cap] (<|endoftext|>, a loop cut by the host, or max_length);
- `tokens` / `logprobs` [n_steps + chunk, cap], step-major so the host copies the rows of a
  chunk in one contiguous read. A finished row keeps computing but writes <|endoftext|> and
  log-probability 0, which the host never reads.

A batch of n windows runs on the smallest bucket b >= n; rows n..b-1 are done from the start.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.whisper import KVCache, permute_rows
from engines.whisper_rules import RuleState

if TYPE_CHECKING:
    from engines.whisper_decoding import GreedyDecoder


def buckets(capacity: int) -> list[int]:
    """Batch sizes with a graph: powers of two below the capacity, then the capacity."""
    sizes, b = [], 1
    while b < capacity:
        sizes.append(b)
        b *= 2
    return sizes + [capacity]


class StaticCache:
    """`KVCache`'s interface (see `DecoderLayer.forward`) over fixed shapes: one new position
    per row, given by a device tensor."""

    def __init__(self, self_k: Tensor, self_v: Tensor, cross_k: Tensor, cross_v: Tensor, pos: Tensor,
                 mask: Tensor):
        self.self_k, self.self_v, self.cross_k, self.cross_v = self_k, self_v, cross_k, cross_v
        self.pos, self.mask = pos, mask

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.self_k[i].index_copy_(1, self.pos, k)
        self.self_v[i].index_copy_(1, self.pos, v)
        return self.self_k[i], self.self_v[i], self.mask

    def cross(self, i: int, n: int) -> tuple[Tensor, Tensor]:
        return self.cross_k[i], self.cross_v[i]


class StaticDecoding:
    """Static buffers and the step for batches of up to `capacity` windows of one decoder."""

    def __init__(self, decoder: "GreedyDecoder", capacity: int, chunk: int):
        model, opts = decoder.model, decoder.opts
        dims, weight = model.dims, model.decoder.embed.weight
        if opts.max_length > dims.n_text_ctx:
            raise ValueError(f"max_length {opts.max_length} exceeds n_text_ctx={dims.n_text_ctx}")
        self.text_decoder, self.capacity = model.decoder, capacity
        self.rules, self.eot, self.start = decoder.rules, decoder.tok.eot, decoder.start
        self.prompt_len, self.n_steps, self.max_len = len(decoder.prompt), decoder.n_steps, opts.max_length
        self.buckets = buckets(capacity)
        dev, dtype = weight.device, weight.dtype
        L, d, h = dims.n_text_layer, dims.n_text_state, dims.n_text_head
        self.self_k = torch.zeros(L, capacity, self.max_len, d, dtype=dtype, device=dev)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(L, capacity, h, dims.n_audio_ctx, d // h, dtype=model.decoder.cache_dtype,
                                   device=dev)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.logits = torch.zeros(capacity, dims.n_vocab, device=dev)
        self.token = torch.zeros(capacity, 1, dtype=torch.long, device=dev)
        self.step_no = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.positions = torch.arange(self.max_len, device=dev)
        self.mask = torch.zeros(1, 1, 1, self.max_len, dtype=torch.bool, device=dev)
        self.state = RuleState.new(capacity, dev)
        self.done = torch.ones(capacity, dtype=torch.bool, device=dev)
        width = self.n_steps + chunk  # an unrolled chunk may run past the last step
        self.tokens = torch.zeros(width, capacity, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(width, capacity, device=dev)
        # Full-graph mode: steps left in this chunk, and its while node's condition.
        self.left = torch.zeros((), dtype=torch.long, device=dev)
        self.go = torch.zeros((), dtype=torch.bool, device=dev)
        self.caches = {b: StaticCache(self.self_k[:, :b], self.self_v[:, :b], self.cross_k[:, :b],
                                      self.cross_v[:, :b], self.pos, self.mask) for b in self.buckets}
        self.cuda = dev.type == "cuda"
        if self.cuda:  # the host reads chunks through pinned copies and an event (no device-wide sync)
            self.host_tokens = torch.zeros(width, capacity, dtype=torch.long, pin_memory=True)
            self.host_logprobs = torch.zeros(width, capacity, pin_memory=True)
            self.event = torch.cuda.Event()
        else:
            self.host_tokens, self.host_logprobs = self.tokens, self.logprobs

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def load(self, audio: Tensor, languages: list[str | None] | None = None
             ) -> tuple[Tensor, list[str | None], list[float | None]]:
        """Start a batch: cross K/V and the prompt (run eagerly, as `_greedy` does) into the
        first n rows, fresh rule state, rows n.. done. Returns the no-speech probabilities,
        each window's language and its detection's probability (`GreedyDecoder.start`, which
        takes `languages`)."""
        n = audio.shape[0]
        cache = KVCache(self.self_k[:, :n], self.self_v[:, :n], self.cross_k[:, :n], self.cross_v[:, :n])
        self.text_decoder.project_audio(audio, cache.cross_k, cache.cross_v)
        logits, no_speech, languages, probs = self.start(cache, n, languages)
        self.logits[:n].copy_(logits)
        self.state.reset()
        self.done.fill_(True)
        self.done[:n] = False
        self.step_no.zero_()
        return no_speech, languages, probs

    def step(self, b: int) -> None:
        """One token for rows 0..b-1: rules, argmax, record, then the model on it."""
        logits, done, state = self.logits[:b], self.done[:b], self.state.rows(b)
        nxt, lp = self.rules.next_token(logits, state)
        self.tokens[:, :b].index_copy_(0, self.step_no, torch.where(done, self.eot, nxt)[None])
        self.logprobs[:, :b].index_copy_(0, self.step_no, lp.masked_fill(done, 0.0)[None])
        done.logical_or_(nxt == self.eot).logical_or_(self.step_no >= self.n_steps - 1)
        self.token[:b, 0].copy_(nxt)
        # Past the last step (the rest of an unrolled chunk) every row is done: the clamp only
        # keeps those no-op steps' writes inside the buffers.
        torch.clamp(self.step_no + self.prompt_len, max=self.max_len - 1, out=self.pos)
        torch.le(self.positions, self.pos, out=self.mask.view(-1))
        dec = self.text_decoder
        x = dec.embed(self.token[:b]) + dec.pos.index_select(0, self.pos)
        logits.copy_(dec.logits(x, self.caches[b])[:, 0])
        self.step_no.add_(1)

    def chunk_head(self, b: int, steps: int) -> None:
        """Full-graph mode, before the while node: allow `steps` more steps."""
        self.left.fill_(steps)
        self._keep_going(b)

    def chunk_body(self, b: int) -> None:
        """Full-graph mode, the while node's body: one step, then its condition again."""
        self.step(b)
        self.left.sub_(1)
        self._keep_going(b)

    def _keep_going(self, b: int) -> None:
        torch.logical_and(torch.any(~self.done[:b]), self.left > 0, out=self.go)

    def read(self, s0: int, s1: int, b: int) -> tuple[list[list[int]], list[list[float]]]:
        """Tokens and log-probabilities of steps s0..s1-1, rows 0..b-1, on the host."""
        if self.cuda:
            self.host_tokens[s0:s1].copy_(self.tokens[s0:s1], non_blocking=True)
            self.host_logprobs[s0:s1].copy_(self.logprobs[s0:s1], non_blocking=True)
            self.event.record()
            self.event.synchronize()  # waits for these copies only
        return self.host_tokens[s0:s1, :b].tolist(), self.host_logprobs[s0:s1, :b].tolist()

    def keep(self, perm: list[int], n: int, positions: int) -> None:
        """Rows perm[:n] (the live ones) continue as rows 0..n-1 of every per-row buffer; self
        K/V only up to the positions filled. Cross K/V rows are permuted whole (new row i = old
        row perm[i]), so finished windows' audio stays for the word alignment. Tokens and
        log-probabilities are already on the host."""
        permute_rows(self.cross_k, perm, 1)
        permute_rows(self.cross_v, perm, 1)
        for buf in (self.self_k[:, :, :positions], self.self_v[:, :, :positions]):
            permute_rows(buf, perm[:n], 1)
        for buf in (self.logits, self.token, self.state.last, self.state.penult, self.state.ts_last):
            permute_rows(buf, perm[:n], 0)

    def set_done(self, done: list[bool]) -> None:
        """The host's view of which rows 0..len(done)-1 are finished (loop cuts, moved rows)."""
        self.done[:len(done)].copy_(torch.tensor(done))
