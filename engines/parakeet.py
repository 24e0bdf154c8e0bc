"""The Parakeet engine: a `.nemo` FastConformer model (TDT, RNN-T, hybrid or CTC) end to end.

audio piece [samples] -> `LogMelFrontend` [n_mels, F] (in a preprocessing worker) -> padded
batch [B, n_mels, F] -> ConformerEncoder [B, D, T'] -> greedy decoding (label-looping
transducer or CTC) -> tokens + frames -> `Result` (text, words, segments). The checkpoint is
read once: one state dict feeds every module.

With `features_on="device"` the workers ship the audio (`transcribe.audio_frontend`) and the
padded batch [B, 1, T] goes through `LogMel` on the engine's device before the encoder.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engines.checkpoint import NemoArchive, naming_checkpoint, pop_sub_state_dict, sub_state_dict
from engines.conformer import ConformerEncoder
from engines.ctc import CTCDecoder
from engines.decode_modes import DecodeMode
from engines.encoder_backend import (DEFAULT_EDGES_S, BackendOptions, feature_profiles, feature_width,
                                     length_blocks, make_backend, resolve_backend)
from engines.nemo_spec import NemoSpec
from engines.precision import TRT_PRECISION, resolve_dtype
from engines.stage_times import StageTimes
from engines.tokenizer import Tokenizer
from engines.transducer import TransducerDecoder
from transcribe.audio_frontend import AudioFrontend, resolve_features_on
from transcribe.engine_api import checked_pieces
from transcribe.features import FeatureConfig, LogMel
from transcribe.results import Result
from transcribe.timestamps import DEFAULT_SEGMENT_DELIMITERS, FrameTiming, build_result

# Pieces longer than this are cut at pauses by the pipeline: attention memory grows with the
# square of the length, and Parakeet models were trained on utterances up to about 30-40 s.
DEFAULT_MAX_PIECE_SECONDS = 40.0
# On the CPU the eager encoder runs a batch in blocks of rows sorted by length, each at most this
# much padded audio and cut to its own longest piece (`_encode`); the decoder still steps the
# whole batch. A CPU GEMM gains little from more rows (one 20 s piece is already 250 x 1024),
# while a wide batch costs padding (the batcher tops batches up from shorter buckets) and
# fresh memory for activations. Sweeping --batch-seconds 30/60/120/300 with the 618M model on 2
# cores found the encoder fastest at 60 s, but the decoder then 3x slower than at 300 s, its
# loop stepping fewer rows at a time (bench/README.md); blocks keep both.
CPU_BLOCK_SECONDS = 60.0
# Batch length buckets (s): the encoder backend's shape profiles are built on these edges and
# the engine's bucket_edges_s is read back from the backend (engines/encoder_backend.py).
BUCKET_EDGES_S = DEFAULT_EDGES_S
DECODINGS = ("auto", "ctc")  # from_nemo's `decoding`: the transducer where there is one, or the CTC head


def pick_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu; anything else is checked and returned.

    `cuda:N` also becomes the process's current CUDA device: graph captures, the conditional
    nodes' cuda-python context and NVRTC module, and TensorRT's builder all work on the
    current device, and a process here drives one GPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if device.startswith("cuda:"):
        try:
            index = torch.device(device).index
        except RuntimeError:
            raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(index)
    return device


class LogMelFrontend:
    """One piece of audio -> its log-mel features, exactly as `LogMel` computes them in a batch.

    Picklable (config and numpy buffers; the torch module is rebuilt on first use), so
    preprocessing workers run it. Normalisation is per utterance, so a piece's features do not
    depend on what it is batched with: the engine pads them with `pad_value` to the batch.
    """

    def __init__(self, cfg: FeatureConfig, window: np.ndarray, fb: np.ndarray, max_piece_seconds: float):
        self.cfg, self.window, self.fb = cfg, window, fb
        self.sample_rate = cfg.sample_rate
        self.n_mels = cfg.features
        self.max_piece_seconds = self.cut_seconds = max_piece_seconds  # longer files: pieces of the same
        self.max_frames = self.frames(int(max_piece_seconds * cfg.sample_rate))
        self._logmel: LogMel | None = None

    @classmethod
    def of(cls, logmel: LogMel, max_piece_seconds: float) -> "LogMelFrontend":
        """The per-piece twin of a batched `LogMel` (same config, window and filterbank)."""
        return cls(logmel.cfg, logmel.window.cpu().numpy(), logmel.fb.cpu().numpy(), max_piece_seconds)

    def frames(self, n_samples: int) -> int:
        """Valid feature frames of a piece of `n_samples` samples."""
        return int(self.cfg.frame_count(torch.tensor([n_samples]))[0])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_logmel": None}

    @torch.inference_mode()
    def __call__(self, audio: np.ndarray) -> np.ndarray:
        """float32 [T] at `sample_rate` -> float32 [n_mels, frames(T)] (a view, not a copy)."""
        if self._logmel is None:
            self._logmel = LogMel(self.cfg, torch.from_numpy(self.window), torch.from_numpy(self.fb))
        feats, flen = self._logmel(torch.from_numpy(audio)[None], torch.tensor([audio.shape[0]]))
        return feats[0, :, : int(flen[0])].numpy()


class ParakeetEngine:
    """Transcribes batches of 16 kHz float32 pieces with one loaded `.nemo` model."""

    detects_language = False  # no language prompt (v3 finds the language itself, per piece)
    sentence_delimiters = DEFAULT_SEGMENT_DELIMITERS  # its segments are sentences (timestamps.segment_spans)

    def __init__(self, name: str, features: LogMel, encoder: ConformerEncoder, decoder, tokenizer: Tokenizer,
                 kind: str, timing: FrameTiming, device: str = "cpu", encoder_backend: str = "auto",
                 backend_options: BackendOptions = BackendOptions(), features_on: str = "auto"):
        self.name = name
        self.device = device
        self.settings: dict[str, str] = {}  # no language or task to choose (transcribe.engine_api)
        self.encoder = encoder.to(device)
        self.decoder = decoder.to(device) if hasattr(decoder, "to") else decoder
        self.tokenizer = tokenizer
        self.kind = kind  # "tdt" | "rnnt" | "ctc": how token frames become word times
        self.timing = timing
        self.sample_rate = features.cfg.sample_rate
        self.max_piece_seconds = DEFAULT_MAX_PIECE_SECONDS
        self.feature_cfg = features.cfg
        # "workers": the preprocessing workers compute each piece's features and the engine pads
        # them into batches as LogMel would; "device": the workers ship audio and `logmel` runs
        # on the padded batch here (transcribe/audio_frontend.py).
        self.features_on = resolve_features_on(features_on)
        per_piece = LogMelFrontend.of(features, self.max_piece_seconds)
        self.max_feature_frames = per_piece.max_frames
        self.logmel = features.to(device) if self.features_on == "device" else None
        self.frontend = (AudioFrontend(self.sample_rate, self.max_piece_seconds) if self.logmel is not None
                         else per_piece)
        self.stage_seconds = StageTimes(device)
        self._host: torch.Tensor | None = None  # pinned batch buffer on CUDA, see reserve()
        # Profiles: per length edge, the batch width of a piece that long (as _batch pads it).
        self.profiles = feature_profiles(features.cfg, backend_options, BUCKET_EDGES_S)
        self.encoder_backend = make_backend(resolve_backend(encoder_backend, device), self.encoder, self.profiles,
                                            features.cfg.pad_value, backend_options)
        self.bucket_edges_s = self.encoder_backend.bucket_edges_s
        # Feature frames of padded batch per encoder block (None: the batch in one call). Only
        # eager torch on the CPU: graphs and TensorRT have their buckets, and a GPU wants rows.
        self.block_frames = (self._width(per_piece.frames(int(CPU_BLOCK_SECONDS * self.sample_rate)))
                             if device == "cpu" and self.encoder_backend.name == "torch" else None)

    @property
    def runtime(self) -> str:
        """How the model runs, for the one-line startup note: encoder backend, decoder mode and
        where features are computed."""
        mode = self.decoder.mode if isinstance(self.decoder, TransducerDecoder) and self.kind != "ctc" else "ctc"
        dtype = str(self.encoder.dtype).removeprefix("torch.")
        return f"encoder {self.encoder_backend.name} {dtype}, decoder {mode}, features on {self.features_on}"

    @classmethod
    def from_nemo(cls, path: str | Path, device: str = "auto", name: str | None = None,
                  decoding: str = "auto", encoder_backend: str = "auto",
                  backend_options: BackendOptions | None = None, decoder_mode: str = "auto",
                  features_on: str = "auto", dtype: str = "auto") -> "ParakeetEngine":
        """Load a `.nemo` checkpoint. `decoding`: auto (transducer if present), or ctc (hybrids).
        `encoder_backend`: auto (cuda-graphs on CUDA, torch on the CPU), torch, compile,
        cuda-graphs or tensorrt (engines/encoder_backend.py). `decoder_mode`: auto, full-graph,
        unrolled or eager (engines/decode_modes.py, decode_graphs.py; a graph mode that cannot run falls back,
        logged once). `features_on`: auto (= workers for now), workers or device
        (transcribe/audio_frontend.py). `dtype`: the encoder's compute dtype, auto (= float32),
        float32, bfloat16 (CPUs with bf16 in hardware, CUDA >= sm80) or float16 (CUDA)
        (engines/precision.py); with the tensorrt backend an explicit dtype also sets the
        engine's precision."""
        if decoding not in DECODINGS:
            raise ValueError(f"decoding must be one of {', '.join(DECODINGS)}, got {decoding!r}")
        device = pick_device(device)
        DecodeMode(decoder_mode)  # a bad name fails before the load
        resolve_features_on(features_on)  # a bad name fails before the load
        backend = resolve_backend(encoder_backend, device)  # a bad name fails before the load
        compute = resolve_dtype(dtype, device)  # an unknown or unsupported dtype too
        options = replace(backend_options or BackendOptions(), nemo_path=str(path))
        if backend == "tensorrt" and dtype != "auto":
            options = replace(options, precision=TRT_PRECISION[compute])
        with NemoArchive(path) as archive, naming_checkpoint(archive.path):
            spec = NemoSpec.read(archive, decoding)  # config and tokenizer, whole, before any weight is read
            state = archive.state_dict()
            bufs = sub_state_dict(state, "preprocessor.featurizer")
            features = LogMel(spec.features, window=bufs.get("window"), fb=bufs.get("fb"))
            # oneDNN-packed weights are CPU-only opaque tensors that `.to()` cannot move.
            # The encoder takes its weights out of `state` and frees each one that packing replaces.
            encoder = ConformerEncoder.from_state(spec.encoder, pop_sub_state_dict(state, "encoder"),
                                                  pack_linears=device == "cpu" and backend != "compile", consume=True,
                                                  dtype=compute, device=device)
            if spec.ctc_only:
                decoder, kind = CTCDecoder.from_archive(archive, state), "ctc"
            else:
                decoder = TransducerDecoder.from_archive(archive, state)
                kind = "ctc" if decoding == "ctc" else ("tdt" if decoder.config.is_tdt else "rnnt")
        del state
        timing = FrameTiming(spec.features.window_stride, encoder.cfg.subsampling_factor)
        engine = cls(name or Path(path).stem, features, encoder, decoder, spec.tokenizer, kind, timing, device, backend, options,
                     features_on)
        if isinstance(engine.decoder, TransducerDecoder) and kind != "ctc":
            engine.decoder.set_mode(decoder_mode)  # after the move: the mode depends on the device
        return engine

    def reserve(self, max_items: int) -> None:
        """Preallocate, once at startup, the decoder state for [max_items, encoder frames of the
        longest piece] and (CUDA only: on the CPU the batch is built where the encoder reads it)
        the pinned host memory for a batch of max_items of the longest pieces the frontend makes
        ([n_mels, max frames] each, or [1, max samples] with features on the device)."""
        if isinstance(self.decoder, TransducerDecoder):
            max_enc = int(self.encoder.output_lengths(torch.tensor([self._width(self.max_feature_frames)]))[0])
            self.decoder.reserve(max_items, max_enc)
        if self.device.startswith("cuda"):
            fe = self.frontend
            self._host = torch.empty(max_items * fe.n_mels * self._batch_width(fe.max_frames), pin_memory=True)
        self.encoder_backend.reserve(max_items)  # CUDA graphs: capture every bucket now

    def _encode(self, feats: torch.Tensor, flen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder over a batch: [B, n_mels, W], [B] -> [B, D, T'], [B]. With `block_frames`,
        in length-sorted blocks (CPU_BLOCK_SECONDS), each cut to the width a batch of only its
        rows would have, so every row is encoded as in such a batch; the outputs go back in
        the batch's row order, zero past each block's frames (past every row's length)."""
        blocks = None if self.block_frames is None else length_blocks(flen.tolist(), self._width, self.block_frames)
        if blocks is None or len(blocks) == 1:
            return self.encoder_backend(feats, flen)
        enc = elen = None
        for rows in blocks:
            idx = torch.tensor(rows)
            e, n = self.encoder_backend(feats[idx, :, : self._width(int(flen[rows[0]]))], flen[idx])
            if enc is None:  # the first block holds the longest row: the widest output
                enc, elen = e.new_zeros(len(flen), e.size(1), e.size(2)), n.new_empty(len(flen))
            enc[idx, :, : e.size(2)] = e
            elen[idx] = n
        return enc, elen

    def _width(self, frames: int) -> int:
        """Batch time axis for a longest piece of `frames` frames: what `LogMel` gives a batch
        (one more than the valid frames, rounded up to pad_to), so batched shapes stay equal."""
        return feature_width(frames, self.feature_cfg.pad_to)

    def _batch_width(self, length: int) -> int:
        """Batch time axis for the frontend's pieces: log-mel pieces pad as `LogMel` would (_width);
        audio pieces to the longest, since `LogMel` on the device then gives that same width."""
        return length if self.logmel is not None else self._width(length)

    def _batch(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The frontend's pieces [C, L_i] (log-mel [n_mels, F_i], or audio [1, T_i]) -> padded
        [B, C, W] and lengths [B] (frames or samples) on the device."""
        lengths = torch.tensor([f.shape[1] for f in pieces], dtype=torch.int64)
        shape = (len(pieces), pieces[0].shape[0], self._batch_width(int(lengths.max())))
        n = shape[0] * shape[1] * shape[2]
        # The front of the flat pinned buffer, so the batch is contiguous and copies asynchronously.
        batch = self._host[:n].view(shape) if self._host is not None and n <= self._host.numel() else torch.empty(shape)
        # Audio past a piece's end is masked by LogMel, whatever it holds; zero is its natural pad.
        pad = 0.0 if self.logmel is not None else self.feature_cfg.pad_value
        # Through numpy: one plain memcpy per row, on this thread. torch's copies fan out to its
        # OpenMP threads, and while the preprocessing workers keep the cores busy a copy waits
        # at a barrier for a thread the scheduler parked: 32 pieces [128, 1000-3000] into the
        # reused buffer, both cores of the dev VM busy elsewhere, p90 56-264 ms a batch that
        # way against 14 ms; idle, 4-5 vs 6 ms (bench/batch_assembly.py).
        rows = batch.numpy()
        for i, f in enumerate(pieces):
            rows[i, :, : f.shape[1]] = f.numpy()
            rows[i, :, f.shape[1]:] = pad
        return batch.to(self.device, non_blocking=True), lengths.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def transcribe(self, pieces: list[np.ndarray]) -> list[Result]:
        """A batch of float32 mono pieces at `sample_rate` -> one Result per piece."""
        pieces = checked_pieces(pieces)
        if not pieces:
            return []
        t = time.perf_counter()
        features = [torch.from_numpy(self.frontend(p)) for p in pieces]
        self.stage_seconds.lap("features", t)
        return self.transcribe_features(features)

    def _encoder_input(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The frontend's pieces -> features [B, n_mels, W] and frame lengths [B] on the device,
        timed as the stages "batch" and, with features on the device, "features"."""
        t = time.perf_counter()
        x, lengths = self._batch(pieces)
        # The sync in lap() also ends the host-to-device copy before the pinned buffer is reused.
        t = self.stage_seconds.lap("batch", t)
        if self.logmel is not None:
            x, lengths = self.logmel(x[:, 0], lengths)
            self.stage_seconds.lap("features", t)
        return x, lengths

    @torch.inference_mode()
    def transcribe_features(self, pieces: list[torch.Tensor], languages: list[str | None] | None = None,
                            after_pause: list[bool] | None = None) -> list[Result]:
        """Per-piece frontend output, float32: features [n_mels, F_i], or audio [1, T_i] with
        features on the device (views are fine: they are copied into the batch before this
        returns) -> one Result per piece. languages: ignored, a transducer takes no language
        prompt (`detects_language` is False); after_pause: ignored, its word times are its
        frames'."""
        feats, flen = self._encoder_input(pieces)
        t = time.perf_counter()
        enc, elen = self._encode(feats, flen)
        t = self.stage_seconds.lap("encoder", t)
        if self.kind == "ctc" and isinstance(self.decoder, TransducerDecoder):
            hyps = self.decoder.decode_ctc(enc, elen)
        else:
            hyps = self.decoder.decode(enc, elen)
        t = self.stage_seconds.lap("decoder", t)
        out = [build_result(self.tokenizer, h.tokens, h.frames, h.durations, self.kind, self.timing) for h in hyps]
        self.stage_seconds.lap("detokenize", t)
        return out
