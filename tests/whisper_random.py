"""A seeded random-weight Whisper and what the decoder-mode tests compare with it, so that
`test_whisper_graph_random.py` (its GPU tests included) needs no downloaded model: the bundled
base weights (145 MB) are too big to carry to a lent GPU machine.

The model has Whisper's real context sizes (1500 audio frames, 448 text positions: the static
buffers of `whisper_static.py` get their real shapes), a small width and depth, and a vocabulary
built here: printable ASCII and a few words, the special tokens, 1501 timestamps. The tests
decode encoder states drawn directly (`random_audio`), so the one encoder layer never runs.
Random weights
alone make a decoder that repeats one token; a larger positional table and wider layers make the
tokens depend on the history, and a per-token logit offset (through the final LayerNorm's bias:
logits are tied to the embedding) sets how often <|endoftext|> and timestamps win, so windows
end at many different steps: by <|endoftext|>, by the loop check or at max_length.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from unittest import mock

import torch

from engines import whisper_decoding
from engines.decode_modes import DecodeMode
from engines.whisper import Whisper, WhisperDims, build_whisper
from engines.whisper_decoding import DecodeOptions, GreedyDecoder, WindowResult
from engines.whisper_progress import Progress
from engines.whisper_tokenizer import WhisperTokenizer

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
# Logit offsets (the logits spread ~7 across the vocabulary): timestamps win now and then (a few
# per hundred tokens), <|endoftext|> often ends a window within its first 40 steps; most others
# run to max_length or into the loop check.
EOT_BIAS, TIMESTAMP_BIAS = 3.0, -6.0


@lru_cache(maxsize=None)
def random_vocab() -> WhisperTokenizer:
    text = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    return WhisperTokenizer(tuple(text + SPECIALS + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]))


def random_suppress(tok: WhisperTokenizer) -> list[int]:
    """The control tokens of OpenAI's suppress list (this vocabulary has no merges to find the
    non-speech symbols with)."""
    return [tok.ids[n] for n in ("<|translate|>", "<|transcribe|>", "<|startoftranscript|>", "<|startofprev|>",
                                 "<|startoflm|>", "<|nocaptions|>")]


def random_dims(width: int = 256, heads: int = 4, text_layers: int = 2) -> WhisperDims:
    return WhisperDims(n_mels=80, n_vocab=len(random_vocab().tokens), n_audio_ctx=1500, n_audio_state=width,
                       n_audio_head=heads, n_audio_layer=1, n_text_ctx=448, n_text_state=width, n_text_head=heads,
                       n_text_layer=text_layers)


def _draw(key: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=g)
    if key.endswith("ln.weight"):
        return 1 + 0.1 * noise
    if key.endswith(".bias"):
        return 0.1 * noise
    if key == "decoder.embed.weight":
        return 0.25 * noise
    if key == "decoder.pos":
        return 2 * noise
    # twice the usual 1/sqrt(fan_in): the layers' outputs outweigh the token's own embedding
    return 2 * noise / math.sqrt(math.prod(shape[1:]))


@lru_cache(maxsize=None)
def random_state(dims: WhisperDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights (fp32, CPU) in `build_whisper`'s names, from a generator seeded with `seed`."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Whisper(dims).state_dict().items() if k not in ("decoder.head.weight",
                                                                                     "encoder.pos")}
    g = torch.Generator().manual_seed(seed)
    state = {k: _draw(k, shape, g) for k, shape in sorted(shapes.items())}
    # logits = (w * norm(x) + b) . E[v]: with b = gain * u, a row of E whose component along u is
    # c / gain gets c added to its logit (plus noise of c / gain times one normalised channel).
    gain, tok = 8.0, random_vocab()
    u = torch.randn(dims.n_text_state, generator=g)
    u /= u.norm()
    state["decoder.ln.bias"] += gain * u
    offset = torch.zeros(dims.n_vocab)
    offset[tok.timestamp_begin:], offset[tok.eot] = TIMESTAMP_BIAS, EOT_BIAS
    emb = state["decoder.embed.weight"]
    emb += torch.outer(offset / gain - emb @ u, u)
    return state


def random_whisper(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                   dims: WhisperDims | None = None) -> Whisper:
    dims = dims or random_dims()
    state = {k: v.clone() for k, v in random_state(dims, seed).items()}  # the model may own its tensors
    return build_whisper(dims, state, device, dtype)


def random_audio(model: Whisper, n: int, seed: int = 1) -> torch.Tensor:
    """Encoder states [n, n_audio_ctx, d] in the model's dtype and device: noise plus an offset
    per window (cross-attention averages the noise away; the offsets make windows differ)."""
    dims, g = model.dims, torch.Generator().manual_seed(seed)
    audio = torch.randn(n, dims.n_audio_ctx, dims.n_audio_state, generator=g)
    audio += torch.randn(n, 1, dims.n_audio_state, generator=g)
    return audio.to(model.decoder.embed.weight.device, model.decoder.dtype)


def random_decoder(model: Whisper, opts: DecodeOptions) -> GreedyDecoder:
    tok = random_vocab()
    return GreedyDecoder(model, tok, opts, random_suppress(tok))


@dataclass
class Decoded:
    """One decode_audio call: the results, and per window its token stream as decoded (before
    the repetition trim; <|endoftext|> included when it ended the window), whether the loop
    check cut it and, for eager decoding, the top-2 logit margin after the rules at each step."""

    results: list[WindowResult]
    streams: list[list[int]]
    looped: list[bool]
    margins: list[list[float]] | None = None

    def ends(self, eot: int) -> list[str]:
        """How each window ended: "eot", "loop" (cut by the loop check) or "max" (max_length)."""
        return ["loop" if cut else "eot" if s and s[-1] == eot else "max" for s, cut in zip(self.streams, self.looped)]


def decode_recorded(dec: GreedyDecoder, audio: torch.Tensor, margins: bool = False,
                    falls_back: bool = False) -> Decoded:
    """dec.decode_audio(audio), recording the streams; margins=True (eager mode only) also
    records each window's margins. The decoder must keep its mode unless `falls_back`: a
    static path that fell back to eager would be compared with eager as eager."""
    mode = dec.graphs.mode
    seen: list[Progress] = []
    per_window: list[list[float]] | None = None
    results = dec.results

    def keep_progress(progress: Progress, no_speech: torch.Tensor) -> list[WindowResult]:
        seen.append(progress)
        return results(progress, no_speech)

    dec.results = keep_progress
    try:
        if margins:
            assert dec.mode == "eager", "margins are recorded in eager mode (one step per host read)"
            with _recording_margins(dec) as per_window:
                out = dec.decode_audio(audio)
        else:
            out = dec.decode_audio(audio)
    finally:
        del dec.results
    if not falls_back:
        assert dec.graphs.mode is mode, f"the decoder fell back from {mode.value} to {dec.graphs.mode.value}"
    # A new static build's first batch is decoded twice: by its own steps, then by eager as
    # the check (`decode_audio`). Its own pass is what it returns, unless it fell back to
    # eager: the last pass is eager's then.
    progress = seen[0] if dec.graphs.mode is not DecodeMode.EAGER else seen[-1]
    eot, n_steps = dec.tok.eot, dec.n_steps
    streams = [toks + [eot] if not cut and len(toks) < n_steps else list(toks)
               for toks, cut in zip(progress.out, progress.looped)]
    if per_window is not None:
        assert [len(m) for m in per_window] == [len(s) for s in streams], "a margin per decoded token"
    return Decoded(out, streams, list(progress.looped), per_window)


@contextmanager
def _recording_margins(dec: GreedyDecoder) -> Iterator[list[list[float]]]:
    """While active, eager decoding's margins go to a list per window: the rules' next_token
    leaves the filtered logits in place, and `_greedy`'s Progress (patched) maps rows to windows."""
    per_window: list[list[float]] = []
    pending: list[float] = []
    next_token = dec.rules.next_token

    def recording(logits: torch.Tensor, state, sampler=None):
        assert sampler is None, "margins are recorded for the greedy pass (temperatures=(0.0,))"
        out = next_token(logits, state)
        top = logits.topk(2, dim=-1).values.float()
        pending[:] = (top[:, 0] - top[:, 1]).tolist()  # inf when the rules left one token
        return out

    class MarginProgress(Progress):
        def __init__(self, n: int, rows: int | None = None, languages=None, language_probs=None):
            super().__init__(n, rows, languages, language_probs)
            per_window[:] = [[] for _ in range(n)]

        def record(self, tokens, logprobs, eot):
            assert len(tokens) == 1, "one step per record"
            for r, w in enumerate(self.rows):
                if w >= 0:
                    per_window[w].append(pending[r])
            super().record(tokens, logprobs, eot)

    dec.rules.next_token = recording
    try:
        with mock.patch.object(whisper_decoding, "Progress", MarginProgress):
            yield per_window
    finally:
        del dec.rules.next_token


# Where eager's top-2 margin (after the rules) is below EPS, the graph path may pick the other
# token, and from there that window goes its own way: it computes each step with other kernels
# (attention over all 448 positions through a mask, other batch sizes), so its logits differ in
# the last bits, and random weights make many near ties (a trained model's top token usually
# leads by far). Measured on the CPU (eager vs the static step, 12 seeds x 8 windows, logits up
# to ~20 where a bf16 ulp is 0.125 and an fp16 one 0.016): the margin between the same two
# tokens differed by at most 0.19 in bf16, 0.023 in fp16 (an unpacked fp16 model) and 1.6e-5
# in fp32. EPS is 2x that in bf16, 4x in fp16; fp32 must match exactly (the smallest eager
# margin in these windows is 1.7e-3, 100x its differences).
EPS = {torch.float32: 0.0, torch.float16: 0.1, torch.bfloat16: 0.375}


def assert_follows(got: Decoded, want: Decoded, eps: float) -> tuple[int, int]:
    """`got`'s token streams equal eager's (`want`, with margins) up to each window's first step
    whose eager top-2 margin is below `eps`; a window without such a step must match in full,
    loop cut included. eps=0 demands identical streams. Returns (steps compared, steps)."""
    assert want.margins is not None, "the reference needs margins (decode_recorded(margins=True))"
    compared = total = 0
    for w, (g, e, m) in enumerate(zip(got.streams, want.streams, want.margins, strict=True)):
        tie = next((i for i, x in enumerate(m) if x < eps), len(e))
        if g != e:
            same = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
            if tie == len(e) or same < tie:
                margin = f"{m[same]:.4g}" if same < len(m) else "none (eager had ended)"
                near = slice(max(0, same - 3), same + 3)
                raise AssertionError(f"window {w} diverges from eager at step {same} (eager's margin there {margin}; "
                                     f"first below eps={eps}: step {tie} of {len(e)}): got {g[near]}, eager {e[near]}")
        if tie == len(e):
            assert got.looped[w] == want.looped[w], f"window {w}: loop cut {got.looped[w]}, eager {want.looped[w]}"
        compared, total = compared + tie, total + len(e)
    return compared, total


def assert_same_results(got: list[WindowResult], want: list[WindowResult], lp_tol: float = 1e-5) -> None:
    """fp32: the same windows, log-probabilities within `lp_tol` (eager attends over the filled
    positions, the static step over all of them through a mask: other kernels)."""
    for g, w in zip(got, want, strict=True):
        assert (g.tokens, g.text, g.segments, g.looped) == (w.tokens, w.text, w.segments, w.looped)
        assert abs(g.avg_logprob - w.avg_logprob) <= lp_tol
        assert g.no_speech_prob == w.no_speech_prob and g.compression_ratio == w.compression_ratio
