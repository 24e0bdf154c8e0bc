"""Which model to run, and loading it: `--model` > $TRANSCRIBE_MODEL > parakeet-tdt-0.6b-v2 (in
the Hugging Face cache, or fetched when the hub answers quickly) > the bundled whisper-base.

Never hangs on a network that drops packets, or on a server that accepts and never answers:
`engines.checkpoint` sends the hub one HEAD request with a short timeout before any download (only on a cache miss), and here before
choosing Parakeet over the bundled model.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from engines.checkpoint import REGISTRY, CheckpointError, hub_reachable, located, registry_name, resolve_checkpoint
from engines.whisper_languages import language_code

DEFAULT_PARAKEET = "parakeet-tdt-0.6b-v2"
BUNDLED = "whisper-base"
WHISPER_NAMES = ("whisper-base",)
BUNDLED_REPO_ID = "openai/whisper-base"  # the repo of the bundled model's weights: `--model` may name it so
WHISPER_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin")


class OptionError(ValueError):
    """An option the chosen model does not take (--language or --task for Parakeet, an encoder
    backend for Whisper): the user's to change, a usage error."""


def is_whisper_path(model: str) -> bool:
    """A local Whisper checkpoint: OpenAI .pt, safetensors, CT2 model.bin, or a folder of those
    (`~` expanded, as `load_engine` reads a path: a quoted `~/w.pt` is the same model)."""
    p = Path(model).expanduser()
    try:
        if p.is_dir():
            return (p / "model.bin").is_file() or (p / "model.safetensors").is_file()
        return p.suffix in WHISPER_SUFFIXES and p.is_file()
    except PermissionError:  # a folder on the way cannot be entered: the load says so (resolve_checkpoint)
        return False


def is_whisper(name: str) -> bool:
    """A Whisper model: the bundled name, a registry entry of that family, or a local Whisper
    checkpoint (`is_whisper_path`); anything else is taken for a Parakeet .nemo."""
    entry = REGISTRY.get(name)
    return name in WHISPER_NAMES or is_whisper_path(name) or (entry is not None and entry.family == "whisper")


def choose_model(model: str | None, bundled: bool = True) -> str:
    """The model name or path to use, following the documented order. `bundled=False`: a
    command that takes Parakeet models only (export-engine) ends the order at the default
    Parakeet, whose own error then says why it cannot be had, never at the bundled Whisper."""
    if model:
        return known_name(model)
    env = os.environ.get("TRANSCRIBE_MODEL")
    if env:
        return known_name(env)
    if not bundled:
        return DEFAULT_PARAKEET
    try:
        resolve_checkpoint(DEFAULT_PARAKEET, offline=True)
        return DEFAULT_PARAKEET
    except CheckpointError:
        pass
    if hub_reachable():
        return DEFAULT_PARAKEET
    print(
        f"note: {DEFAULT_PARAKEET} is not in the Hugging Face cache and the hub is unreachable; "
        f"using the bundled {BUNDLED}. For Parakeet, run once with network access "
        f"(`transcribe --model {DEFAULT_PARAKEET} FILE`) or pass a local .nemo with --model.",
        file=sys.stderr,
    )
    return BUNDLED


def known_name(model: str) -> str:
    """A Hugging Face repo id that the registry (or the bundled model) serves, by its registry
    name, so both spellings are one model (resume compares names); a path that is there stays
    a path."""
    if os.path.exists(os.path.expanduser(model)):
        return model
    return BUNDLED if model.lower() == BUNDLED_REPO_ID else registry_name(model)


def checked_model(model: str | None, encoder_backend: str = "auto", features_on: str = "auto",
                  language: str | None = None, task: str = "transcribe", prompt: str | None = None) -> str:
    """The model `load_engine` would load (a path made absolute), after checking that it takes
    the options given (OptionError if not), and that it names a model there is (CheckpointError
    if not: an unknown name, a missing file). Imports no torch, reads no weights and fetches
    nothing: a command line checks this before it spawns workers or imports anything heavy."""
    name = choose_model(model)
    if name not in REGISTRY and name not in WHISPER_NAMES and os.path.exists(os.path.expanduser(name)):
        # (os.path.exists: False, where Path.exists raised, for a path in a folder that cannot be
        # entered; the load then says "permission denied")
        # A path names the model by where it is, however it was typed: results.jsonl records
        # it and a rerun compares it (`m.nemo` from two folders is two models).
        name = os.path.abspath(Path(name).expanduser())
    whisper = is_whisper(name)
    if not whisper:  # (a Whisper name is the bundled model, a registry entry or a checkpoint there is)
        located(name)  # a registry entry or a .nemo file (load_engine then fetches or reads it)
    if whisper and encoder_backend not in ("auto", "torch"):
        raise OptionError(f"encoder backend {encoder_backend!r} is for Parakeet models; {name} (Whisper) runs eager torch")
    if not whisper and task != "transcribe":
        raise OptionError(f"--task {task} is for Whisper models; {name} (Parakeet) only transcribes")
    if not whisper and language is not None:
        raise OptionError(f"--language is for Whisper models; {name} (Parakeet) takes no language "
                         "(English-only models, or, like parakeet-tdt-0.6b-v3, finding it themselves)")
    if not whisper and prompt is not None:
        raise OptionError(f"--prompt is for Whisper models; {name} (Parakeet) takes no prompt")
    if whisper and features_on not in ("auto", "workers"):
        raise OptionError(f"features on {features_on!r} is for Parakeet models; {name} (Whisper) computes its "
                         "features in the workers")
    return name


def check_streamable(model: str) -> None:
    """OptionError for a Whisper model: `stream` and `serve` run FastConformer transducers only;
    CheckpointError for a name or file there is none of (`located`). Imports no torch: the
    command says it at once."""
    name = choose_model(model)
    if is_whisper(name):
        raise OptionError(f"{model} is a Whisper model: streaming takes FastConformer transducers "
                          "(TDT / RNN-T .nemo) only")
    located(name)


def settings_before_load(name: str, language: str | None = None, task: str = "transcribe",
                         prompt: str | None = None) -> dict[str, str] | None:
    """The `settings` (transcribe.engine_api.Engine) that `load_engine`'s engine for `name`
    (`checked_model`'s) will have with these options, where they are known without reading the
    model: Parakeet's are none; a Whisper model named in the registry or bundled records its
    language and task, an English-only (.en) one none. None where only the model can say: a
    Whisper checkpoint path (is it multilingual?), a prompt (the text kept is cut by tokens), an
    English-only model asked for another language or task (its load refuses them), or a path
    that is not there (its load says so). The transcribe command skips loading when these
    settings find every file done already; tests/test_resume.py holds them to the engines'."""
    if not is_whisper(name):
        return {} if name in REGISTRY or os.path.isfile(name) else None
    if prompt is not None or not (name in WHISPER_NAMES or name in REGISTRY):
        return None
    code = "en" if language is None else language_code(language)
    if name.endswith(".en"):
        return {} if code in ("en", "auto") and task == "transcribe" else None
    return {"language": code, "task": task}


def load_engine(model: str | None, device: str = "auto", encoder_backend: str = "auto", decoder_mode: str = "auto",
                features_on: str = "auto", dtype: str = "auto", backend_options=None, word_timestamps: bool = True,
                language: str | None = None, task: str = "transcribe", prompt: str | None = None):
    """An engine (see `transcribe.engine_api.Engine`) for `model` on `device`. `decoder_mode` (auto,
    full-graph, unrolled, eager: engines/decode_modes.py, decode_graphs.py, whisper_graph.py) applies to
    both families; `encoder_backend` (auto, torch, compile, cuda-graphs, tensorrt:
    engines/encoder_backend.py) to Parakeet models, Whisper's encoder runs eager torch.
    `dtype` (auto, float32, bfloat16, float16; aliases fp32, bf16, fp16: engines/precision.py)
    sets the encoder's compute dtype in both families (auto: float32, except Whisper: float16 on
    CUDA, bfloat16 on CPUs whose bf16 GEMMs time faster than fp32's; Whisper's CPU decoder stays float32,
    engines.whisper_engine.compute_dtypes).
    `features_on` (auto, workers, device: transcribe/audio_frontend.py) and `backend_options`
    (engines.encoder_backend.BackendOptions: the profiles' batch limits, TensorRT's cache) apply
    to Parakeet only: Whisper computes its features in the workers. `word_timestamps` applies to
    Whisper, whose word times take an extra alignment pass (engines/whisper_alignment.py);
    Parakeet's come with its decoding. `language` (a code or name, or auto: detected once per file,
    transcribe/file_language.py; None: en) and `task` (transcribe, or translate into English) are
    Whisper's, as is `prompt` (text read as coming before every piece: names, spellings, style);
    Parakeet models take no language (v2 is English, v3 finds the language itself), only
    transcribe, and take no prompt."""
    name = checked_model(model, encoder_backend, features_on, language, task, prompt)
    cached = resolve_checkpoint(name) if name in REGISTRY else None  # fetched into the Hugging Face cache
    from engines.whisper_weights import WhisperWeightsError

    try:
        if is_whisper(name):
            from engines.whisper_engine import WhisperEngine
            from engines.whisper_tokenizer import LanguageTaskError

            try:
                if name in WHISPER_NAMES:
                    engine = WhisperEngine.load(name, device, decoder_mode, dtype, language or "en", task, prompt)
                else:
                    engine = WhisperEngine.load_path(cached or Path(name), device, name=name, decoder_mode=decoder_mode,
                                                     dtype=dtype, language=language or "en", task=task, prompt=prompt)
            except LanguageTaskError as e:  # known only once the vocabulary is read
                raise OptionError(f"{name}: {e}") from e
            engine.word_timestamps = word_timestamps
            return engine
        from engines.parakeet import ParakeetEngine

        return ParakeetEngine.from_nemo(cached or resolve_checkpoint(name), device, name=name, encoder_backend=encoder_backend,
                                        decoder_mode=decoder_mode, features_on=features_on, dtype=dtype,
                                        backend_options=backend_options)
    except (CheckpointError, WhisperWeightsError) as e:
        if cached is None:
            raise
        # A download cut short, a disk error: "download it again" alone does not say how, and
        # huggingface_hub hands back what its cache holds, whole or not.
        repo = next((p for p in cached.parents if p.name.startswith("models--")), cached)
        raise CheckpointError(f"{e}. It is the Hugging Face cache's copy of {name}: if it is damaged, remove "
                              f"{repo} and run again to fetch it anew") from e
