"""What every encoder backend (eager torch, torch.compile, CUDA graphs, TensorRT) shares: the
call signature, the shape buckets it is built for, and padding a batch up to a bucket.

A backend is called exactly like `ConformerEncoder.forward`: features float32 [B, n_mels, W]
and lengths int64 [B] -> (encoded [B, d_model, T'], encoded lengths [B] int64). Its shape
buckets (`BucketProfile`) are the batch widths it was built or captured for; the batcher's
length edges (`bucket_edges_s`, seconds) are read from them, so every batch the pipeline forms
lands in a captured graph or a TensorRT profile.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from engines.choices import DEFAULT_BATCH_SECONDS, DEFAULT_MAX_BATCH, ENCODER_BACKENDS, DeviceError

# Length edges (s) of the batch buckets. Steps of about 1.25x keep padding within a batch small;
# the last edge is the longest piece the pipeline cuts (DEFAULT_MAX_PIECE_SECONDS).
DEFAULT_EDGES_S = (2.0, 4.0, 6.0, 8.0, 10.0, 12.5, 15.0, 17.5, 20.0, 25.0, 30.0, 35.0, 40.0)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketProfile:
    """One shape bucket: batches of up to `max_batch` rows whose width W (feature frames) lies in
    [min_frames, frames]; `frames` is the batch width of a piece of `seconds` (the batcher's
    edge). CUDA graphs are captured at W = frames; TensorRT builds one profile over the range."""

    seconds: float
    frames: int
    max_batch: int
    min_frames: int = 1

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"bucket seconds must be positive, got {self.seconds!r}")
        if self.max_batch < 1:
            raise ValueError(f"bucket max_batch must be >= 1, got {self.max_batch!r}")
        if not 1 <= self.min_frames <= self.frames:
            raise ValueError(f"bucket frames must satisfy 1 <= min_frames <= frames, got {self.min_frames}, {self.frames}")

    def fits_width(self, frames: int) -> bool:
        return self.min_frames <= frames <= self.frames


class EncoderBackend(Protocol):
    """The encoder as the engine calls it; see the module docstring."""

    name: str
    profiles: tuple[BucketProfile, ...]
    bucket_edges_s: tuple[float, ...]

    def __call__(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]: ...

    def reserve(self, max_items: int) -> None: ...  # startup work (graph capture); may do nothing


def make_profiles(width_of: Callable[[float], int], edges_s: Sequence[float] = DEFAULT_EDGES_S,
                  max_batch: int = DEFAULT_MAX_BATCH,
                  batch_seconds: float = DEFAULT_BATCH_SECONDS) -> tuple[BucketProfile, ...]:
    """One profile per length edge: width `width_of(edge)` (the engine's batch width for a
    longest piece of that many seconds), rows min(max_batch, batch_seconds // edge), and widths
    from just above the previous bucket's, so the profiles tile 1..last width."""
    if not edges_s or list(edges_s) != sorted(set(edges_s)) or edges_s[0] <= 0:
        raise ValueError(f"bucket edges must be increasing positive seconds, got {list(edges_s)}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tile_profiles([(edge, width_of(edge), max(1, min(max_batch, int(batch_seconds // edge))))
                          for edge in edges_s])


def tile_profiles(buckets: Sequence[tuple[float, int, int]]) -> tuple[BucketProfile, ...]:
    """(seconds, width in frames, rows) per bucket, widths increasing -> profiles whose width
    ranges tile 1 .. the last width, each from just above the previous one's."""
    out: list[BucketProfile] = []
    lo = 1
    for seconds, frames, rows in buckets:
        if frames < lo:
            raise ValueError(f"bucket edge {seconds} s gives width {frames} frames, not above the previous bucket's")
        out.append(BucketProfile(float(seconds), frames, rows, lo))
        lo = frames + 1
    return tuple(out)


def bucket_edges(profiles: Sequence[BucketProfile]) -> tuple[float, ...]:
    """The batcher's length edges (s): the profiles' seconds, increasing."""
    return tuple(sorted({p.seconds for p in profiles}))


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch buckets of one length bucket, as nano-vllm captures them: 1, 2, 4, 8, then steps
    of 16 (padding a batch by at most 15 rows), then max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return tuple(sizes + [max_batch])


def pick_profile(profiles: Sequence[BucketProfile], frames: int) -> BucketProfile | None:
    """The narrowest profile whose width range holds `frames`; None past the widest."""
    for p in sorted(profiles, key=lambda p: p.frames):
        if p.fits_width(frames):
            return p
    return None


def pick_bucket(profiles: Sequence[BucketProfile], batch: int, frames: int) -> tuple[int, int] | None:
    """The smallest (batch, width) bucket holding a [batch, n_mels, frames] input: the narrowest
    profile that fits, then its smallest batch size >= batch. None when the width is beyond
    every profile or the batch beyond that profile's max_batch (callers split the batch)."""
    p = pick_profile(profiles, frames)
    if p is None or batch > p.max_batch:
        return None
    return next(b for b in batch_sizes(p.max_batch) if b >= batch), p.frames


def fill_bucket(dst_features: Tensor, dst_lengths: Tensor, features: Tensor, lengths: Tensor, pad_value: float) -> None:
    """Copy a [B, n_mels, W] batch into bucket buffers [b, n_mels, w] (b >= B, w >= W): the
    extra frames and rows hold `pad_value`, the extra rows length 0 (all their frames masked,
    so nothing of them reaches the real rows); real rows keep their lengths."""
    b, _, w = features.shape
    dst_features.fill_(pad_value)
    dst_features[:b, :, :w].copy_(features, non_blocking=True)
    dst_lengths.zero_()
    dst_lengths[:b].copy_(lengths, non_blocking=True)


# Self-checks of the GPU backends against the eager encoder on a seeded batch (relative L2 error
# over valid frames). A captured graph replays the kernels its eager warm-up ran, on the same
# shapes: equal up to summation order. A TensorRT engine computes in its own kernels and
# precision: fp32 builds may use TF32 (~1e-3); fp16 / bf16 with fp32 normalization stay near
# 1e-2 (bf16's encoder error on the CPU is 0.9-1.1 %). A broken engine or capture is far off.
# Fused kernels (torch.compile's Inductor, the streaming pool's Triton kernel) compute the same
# math in another order and fusion: near 1e-6 in fp32, a rounding per fused op in fp16 / bf16.
GRAPH_CHECK_RTOL = 1e-3
ENGINE_CHECK_RTOL = {"fp32": 1e-2, "fp16": 5e-2, "bf16": 5e-2}
FUSED_CHECK_RTOL = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}


def fill_check_batch(features: Tensor, lengths: Tensor, seed: int = 0) -> None:
    """Buffers [b, n_mels, W], [b] <- a seeded check batch: N(0, 1) features (normalized
    log-mel's scale) and row lengths from W down to W / 2, so the masks matter."""
    gen = torch.Generator(device=features.device).manual_seed(seed)
    features.normal_(generator=gen)
    w = features.shape[-1]
    lengths.copy_(torch.linspace(w, (w + 1) // 2, lengths.shape[0]).round().long())


def disagreement(got: Tensor, got_lengths: Tensor, want: Tensor, want_lengths: Tensor,
                 rtol: float = GRAPH_CHECK_RTOL) -> str | None:
    """A backend's encoded [B, D, T'] and lengths [B] against eager's on the same batch, over
    each row's valid frames -> why they differ (NaN and inf included), or None."""
    if not torch.equal(got_lengths.cpu(), want_lengths.cpu()):
        return f"output lengths {got_lengths.tolist()} against eager's {want_lengths.tolist()}"
    valid = torch.arange(want.shape[-1], device=want.device)[None, None, :] < want_lengths[:, None, None]
    err = relative_error(got, want, valid)
    return None if err <= rtol else f"relative error {err:.2e} against eager (tolerance {rtol:.0e})"


def relative_error(got: Tensor, want: Tensor, valid: Tensor | None = None) -> float:
    """||got - want|| / ||want|| in fp32 over the elements where `valid` (broadcast; None: all);
    NaN or inf in either gives NaN or inf, which no tolerance passes."""
    diff, ref = got.float() - want.float(), want.float()
    if valid is not None:
        diff, ref = torch.where(valid, diff, 0.0), torch.where(valid, ref, 0.0)
    return float(diff.norm() / (ref.norm() + 1e-12))


def check_profiles(run: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]], encoder,
                   profiles: Sequence[BucketProfile], rtol: float) -> str | None:
    """Each profile's seeded check batch (2 rows, or 1, at its full width) through
    `run(profile index, features, lengths)` against the eager encoder -> the first
    disagreement, naming the profile, or None."""
    device = encoder.pos_enc.pe.device
    for i, p in enumerate(profiles):
        features = torch.empty(min(2, p.max_batch), encoder.cfg.feat_in, p.frames, device=device)
        lengths = torch.empty(features.shape[0], dtype=torch.int64, device=device)
        fill_check_batch(features, lengths)
        why = disagreement(*run(i, features, lengths), *encoder(features, lengths), rtol=rtol)
        if why is not None:
            return f"profile {i} ({p.seconds:g} s): {why}"
    return None


def output_frames(encoder, frames: int) -> int:
    """Encoder frames T' of a batch `frames` wide (host arithmetic, no device sync)."""
    return int(encoder.output_lengths(torch.tensor([frames]))[0])


def run_padded(encoder, features: Tensor, lengths: Tensor, bucket: tuple[int, int], pad_value: float,
               static: bool = True) -> tuple[Tensor, Tensor]:
    """Eager reference of a bucket replay: pad the batch to `bucket` (batch, width), run the
    encoder, slice the rows and frames of the unpadded batch back. The CUDA-graph backend does
    exactly this with static buffers; on the CPU it shows the padding leaves results intact."""
    b, n_mels, w = features.shape
    rows, width = bucket
    feats = torch.empty(rows, n_mels, width, dtype=features.dtype, device=features.device)
    lens = torch.empty(rows, dtype=torch.int64, device=features.device)
    fill_bucket(feats, lens, features, lengths, pad_value)
    enc, elen = encoder(feats, lens, static=static)
    return enc[:b, :, : output_frames(encoder, w)], elen[:b]


def in_chunks(call: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], features: Tensor, lengths: Tensor,
              rows: int) -> tuple[Tensor, Tensor]:
    """Run a batch larger than a bucket's max_batch as chunks of `rows` rows, concatenated."""
    if features.size(0) <= rows:
        return call(features, lengths)
    encs, lens = [], []
    for i in range(0, features.size(0), rows):
        enc, elen = call(features[i : i + rows], lengths[i : i + rows])
        # A backend's output may alias its static buffer, which the next chunk overwrites.
        encs.append(enc.clone())
        lens.append(elen.clone())
    return torch.cat(encs, 0), torch.cat(lens, 0)


def length_blocks(lengths: Sequence[int], width_of: Callable[[int], int], budget: int) -> list[list[int]]:
    """Rows of a batch in blocks for the encoder: longest first, each block as many rows as fit
    `budget` once padded to its own longest (rows x width_of(longest) <= budget; one row at
    least) -> the row indices of each block, blocks longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    blocks: list[list[int]] = []
    for i in order:
        if blocks and (len(blocks[-1]) + 1) * width_of(lengths[blocks[-1][0]]) <= budget:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    return blocks


def turned_off(label: str, why: str) -> str:
    """A backend whose startup check or capture failed: log it once (the caller keeps the
    backend off from then on) -> `why`, for the backend's `off`."""
    log.warning("%s: %s; the encoder runs in eager torch from now on", label, why)
    return why


class FallbackLog:
    """Logs, once per backend, that a shape went to the eager encoder and why."""

    def __init__(self, backend: str):
        self.backend, self.done = backend, False

    def __call__(self, shape: Sequence[int], why: str) -> None:
        if not self.done:
            self.done = True
            log.warning("%s encoder: input %s %s; running it (and any like it) in eager torch",
                        self.backend, list(shape), why)


@dataclass(frozen=True)
class BackendOptions:
    """How to build the encoder backend. `max_batch` / `batch_seconds` shape the profiles (use
    the same values for `transcribe export-engine` so its engine is found in the cache);
    `precision`, `cache_dir` and `nemo_path` (model identity and ONNX source) are TensorRT's."""

    max_batch: int = DEFAULT_MAX_BATCH
    batch_seconds: float = DEFAULT_BATCH_SECONDS
    precision: str = "fp16"
    cache_dir: str | None = None
    nemo_path: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not self.batch_seconds > 0:
            raise ValueError(f"batch_seconds must be positive, got {self.batch_seconds}")
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"TensorRT precision {self.precision!r} is not supported (supported: fp32, fp16, bf16)")


def resolve_backend(name: str, device: str) -> str:
    """`auto` -> cuda-graphs on CUDA, torch on the CPU; others are checked against the device."""
    if name not in ENCODER_BACKENDS:
        raise ValueError(f"encoder backend {name!r} is not supported (supported: {', '.join(ENCODER_BACKENDS)})")
    cuda = device.startswith("cuda")
    if name == "auto":
        return "cuda-graphs" if cuda else "torch"
    if name in ("cuda-graphs", "tensorrt") and not cuda:
        raise DeviceError(f"encoder backend {name!r} needs a CUDA device, got device {device!r}")
    return name


def feature_width(frames: int, pad_to: int) -> int:
    """Batch time axis (feature frames) for a longest piece of `frames` valid frames: what a
    batched `LogMel` gives, one more than the valid frames rounded up to `pad_to`."""
    width = frames + 1
    return -(-width // pad_to) * pad_to if pad_to > 0 else width


def feature_profiles(fcfg, options: BackendOptions = BackendOptions(),
                     edges_s: Sequence[float] = DEFAULT_EDGES_S) -> tuple[BucketProfile, ...]:
    """The profiles of a model whose features follow `fcfg` (`transcribe.features.FeatureConfig`):
    an edge's width is the batch width (feature_width) of a piece lasting that many seconds."""
    def width(seconds: float) -> int:
        frames = int(fcfg.frame_count(torch.tensor([int(seconds * fcfg.sample_rate)]))[0])
        return feature_width(frames, fcfg.pad_to)

    return make_profiles(width, edges_s, options.max_batch, options.batch_seconds)


def make_backend(name: str, encoder, profiles: Sequence[BucketProfile], pad_value: float,
                 options: BackendOptions = BackendOptions()) -> EncoderBackend:
    """The backend `name` (already resolved: see resolve_backend) around `encoder`."""
    if name in ("torch", "compile"):
        from engines.encoder_torch import TorchEncoder

        return TorchEncoder(encoder, profiles, compile=name == "compile")
    if name == "cuda-graphs":
        from engines.encoder_cudagraph import CudaGraphEncoder

        return CudaGraphEncoder(encoder, profiles, pad_value)
    if name == "tensorrt":
        from engines.encoder_tensorrt import TensorRTEncoder

        if options.nemo_path is None:
            raise ValueError("encoder backend 'tensorrt' needs the model's .nemo path (BackendOptions.nemo_path)")
        return TensorRTEncoder.from_nemo(options.nemo_path, encoder, profiles, options.precision, options.cache_dir)
    raise ValueError(f"encoder backend {name!r} is not supported here (resolve 'auto' first)")
