"""Decoded text tokens + the window's cross-attention -> the time each token starts (OpenAI's
word-timestamp alignment, `whisper/timing.py::find_alignment`, batched).

For every window of a decoded batch, the text tokens are run once more through the decoder,
teacher-forced after the prompt `sot [lang transcribe] <|notimestamps|>` and followed by
<|endoftext|>. The cross-attention weights of the model's *alignment heads* (the heads whose
attention follows the speech; listed per model, see `alignment_heads`) over the window's audio
frames are softmaxed, standardized per frame across tokens, median-filtered along time, and
averaged over heads; dynamic time warping through the negated matrix gives the monotonic
token -> frame path, and the frame where the path enters each token's row is its start (in
encoder frames of 20 ms).

Batched: one forced pass for all windows of a batch, reusing the cross K/V the greedy decode
already projected (the rows stay in the caches: `KVCache.keep` / `StaticDecoding.keep` move
finished rows behind the live ones instead of overwriting them), then DTW along anti-diagonals
for all windows at once. Each cell's cost is computed exactly as OpenAI's `dtw_cpu` computes it
(float64 sum stored in float32, the same tie-breaking), so the paths are OpenAI's.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engines.whisper import KVCache, TextDecoder, WhisperDims, _heads

FRAMES_PER_SECOND = 50  # encoder frames (OpenAI's TOKENS_PER_SECOND): 2 mel frames of 10 ms each
MEDIAN_FILTER_WIDTH = 7  # OpenAI's medfilt_width


def alignment_heads(dims: WhisperDims, folder: Path | None) -> tuple[tuple[int, int], ...]:
    """(decoder layer, head) pairs to align with: a CTranslate2 `config.json` or a Hugging Face
    `generation_config.json` beside the weights lists them; else OpenAI's default for models
    without a list, every head of the second half of the decoder layers."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name if folder is not None else None
        if path is not None and path.is_file():
            heads = json.loads(path.read_text()).get("alignment_heads")
            if heads:
                pairs = tuple((int(layer), int(head)) for layer, head in heads)
                for layer, head in pairs:
                    if not (0 <= layer < dims.n_text_layer and 0 <= head < dims.n_text_head):
                        raise ValueError(f"{path}: alignment head {(layer, head)} is outside the decoder's "
                                         f"{dims.n_text_layer} layers x {dims.n_text_head} heads")
                return pairs
    return tuple((layer, head) for layer in range(dims.n_text_layer // 2, dims.n_text_layer)
                 for head in range(dims.n_text_head))


class Aligner:
    """Forced pass + DTW over the windows of one decoded batch (see the module docstring)."""

    def __init__(self, decoder: TextDecoder, heads: tuple[tuple[int, int], ...], prompt: list[int], eot: int):
        self.decoder, self.prompt, self.eot = decoder, list(prompt), eot
        self.heads: dict[int, list[int]] = {}
        for layer, head in heads:
            self.heads.setdefault(layer, []).append(head)
        self.last_layer = max(self.heads)

    @torch.inference_mode()
    def token_starts(self, cross_k: Tensor, cross_v: Tensor, texts: list[list[int]],
                     frames: list[int], languages: list[int | None] | None = None) -> list[np.ndarray]:
        """cross_k / cross_v: [layers, B, heads, T_audio, d/heads], row r the audio of window r;
        texts: text token ids per row (no timestamps, no specials; [] skips the row); frames:
        mel frames of real audio per row (OpenAI's num_frames). -> per row, the start of each
        text token and of the <|endoftext|> after them (the end of the last one), in seconds:
        float array [len(text) + 1] ([] for skipped rows). languages: each row's language
        token, which takes the prompt's language slot (None, or no list: the prompt's own)."""
        rows = [r for r, t in enumerate(texts) if t]
        languages = languages or [None] * len(texts)
        out = [np.zeros(0)] * len(texts)
        if not rows:
            return out
        qk = self._forced_scores(cross_k, cross_v, texts[:rows[-1] + 1], languages[:rows[-1] + 1])
        p = len(self.prompt)
        matrices = []
        for r in rows:
            n = p + len(texts[r]) + 1  # prompt, text, <|endoftext|>
            w = qk[r, :, :n, :max(1, frames[r] // 2)].softmax(dim=-1)  # encoder frames of audio
            std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
            w = median_filter((w - mean) / std, MEDIAN_FILTER_WIDTH)
            # rows: <|notimestamps|> (predicting text[0]) .. text[-1] (predicting <|endoftext|>)
            matrices.append(w.mean(dim=0)[p - 1:n - 1].double().cpu().numpy())
        for r, path in zip(rows, dtw_paths([-m for m in matrices])):
            text_index, time_index = path
            jumps = np.diff(text_index, prepend=-1).astype(bool)  # first step into each token's row
            out[r] = time_index[jumps] / FRAMES_PER_SECOND
        return out

    def _forced_scores(self, cross_k: Tensor, cross_v: Tensor, texts: list[list[int]],
                       languages: list[int | None]) -> Tensor:
        """Teacher-forced pass of prompt + text + <|endoftext|> for rows 0..len(texts)-1 ->
        pre-softmax cross-attention scores of the alignment heads, float32
        [rows, n_alignment_heads, T_tokens, T_audio] (T_tokens: the longest row; shorter rows
        are padded after their <|endoftext|>, which the causal mask keeps out of their rows)."""
        dec, b = self.decoder, len(texts)
        dev = dec.embed.weight.device
        # A row's language token (multilingual models) takes the prompt's language slot.
        seqs = [(self.prompt if lang is None else [self.prompt[0], lang, *self.prompt[2:]]) + t + [self.eot]
                for t, lang in zip(texts, languages)]
        t_max = max(len(s) for s in seqs)
        tokens = torch.tensor([s + [self.eot] * (t_max - len(s)) for s in seqs], device=dev)
        n_layers, d = self.last_layer + 1, dec.embed.weight.shape[1]
        self_kv = torch.empty(n_layers, b, t_max, d, dtype=dec.dtype, device=dev)
        cache = KVCache(self_kv, torch.empty_like(self_kv), cross_k[:, :b], cross_v[:, :b])
        scores: list[Tensor] = []

        def keep_scores(layer: int):
            # The cross-attention's inputs: the normed states and this layer's cross K/V [b, H, Ta, dh].
            def hook(module, inputs, _output):
                x, k, _ = inputs
                heads = self.heads[layer]
                q = _heads(module.q(x), module.n_head)[:, heads].float()
                scores.append((q @ k[:, heads].float().transpose(-1, -2)) * q.shape[-1] ** -0.5)
            return hook

        hooks = [dec.layers[layer].cross.register_forward_hook(keep_scores(layer)) for layer in sorted(self.heads)]
        try:
            x = dec.embed(tokens) + dec.pos[:t_max]
            for i in range(n_layers):  # later layers hold no alignment head
                x = dec.layers[i](x, cache, i)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat(scores, dim=1)


def median_filter(x: Tensor, width: int) -> Tensor:
    """Median over a window of `width` (odd) along the last axis of x [heads, tokens, frames],
    reflect-padded (OpenAI's `median_filter`; x as is when the axis is not longer than
    width // 2)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    return F.pad(x, (pad, pad), mode="reflect").unfold(-1, width, 1).sort()[0][..., pad]


def dtw_paths(costs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Minimum-cost monotonic paths through each [N_i, M_i] float64 cost matrix, all matrices
    advanced together one anti-diagonal at a time -> per matrix (row indices, column indices)
    along the path from (0, 0) to (N-1, M-1). Same cells, arithmetic and ties as OpenAI's
    `dtw_cpu` + `backtrace` (cost kept in float32; diagonal only if strictly cheapest, then
    up, else left)."""
    b = len(costs)
    n_max, m_max = max(c.shape[0] for c in costs), max(c.shape[1] for c in costs)
    x = np.zeros((b, n_max + 1, m_max + 1))  # padding never reaches a cell inside a matrix
    for k, c in enumerate(costs):
        x[k, 1:c.shape[0] + 1, 1:c.shape[1] + 1] = c
    cost = np.full((b, n_max + 1, m_max + 1), np.inf, dtype=np.float32)
    cost[:, 0, 0] = 0
    trace = np.full((b, n_max + 1, m_max + 1), -1, dtype=np.int8)
    for diag in range(2, n_max + m_max + 1):
        i = np.arange(max(1, diag - m_max), min(n_max, diag - 1) + 1)
        j = diag - i
        c0, c1, c2 = cost[:, i - 1, j - 1], cost[:, i - 1, j], cost[:, i, j - 1]
        up = (c1 < c0) & (c1 < c2)
        diagonal = (c0 < c1) & (c0 < c2)
        t = np.where(diagonal, 0, np.where(up, 1, 2)).astype(np.int8)
        c = np.where(diagonal, c0, np.where(up, c1, c2))
        cost[:, i, j] = x[:, i, j] + c  # float64 sum, stored as float32 as OpenAI's array is
        trace[:, i, j] = t
    return [_backtrace(trace[k, :c.shape[0] + 1, :c.shape[1] + 1].copy()) for k, c in enumerate(costs)]


def _backtrace(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI's `backtrace`: from the far corner back to (0, 0); border cells step along it."""
    trace[0, :], trace[:, 0] = 2, 1
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    steps = trace.tolist()  # python ints: the walk below is sequential
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = steps[i][j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        elif t == 2:
            j -= 1
        else:
            raise ValueError(f"DTW trace has no step at ({i}, {j})")
    rows, cols = np.array(path[::-1]).T
    return rows, cols
