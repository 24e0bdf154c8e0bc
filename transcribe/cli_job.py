"""What every transcribing command does around its run: discover the inputs, spawn the
workers and load the engine (`prepare`), then run the job so that SIGINT / SIGTERM, a worker
that cannot start or an output disk that stops taking writes end it with the command's exit
status and a line saying what a rerun does (`interruptible`).
"""
from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import typer

from transcribe.cli_options import (EXIT_NOTHING_RAN, EXIT_USAGE, check_choice, check_runtime, fail, out_folder,
                                    refuse_empty, writable_folder)


def prepare(inputs: list[str], model: Optional[str], device: str, shard_spec: Optional[str],
             workers: Optional[int], encoder_backend: str = "auto", decoder_mode: str = "auto",
             features_on: str = "auto", dtype: str = "auto", batch_seconds: float | None = None,
             words: bool = True, language: Optional[str] = None, task: str = "transcribe",
             prompt: Optional[str] = None, out: Optional[Path] = None, report: Optional[Path] = None,
             finished: Optional[Callable[[list, str, dict], bool]] = None):
    """Discover inputs and load the engine; returns (files, engine, load seconds, prespawned
    workers). The workers are spawned before the model loads so their start overlaps it.
    The engine is None where none is needed: a shard with no files, or when `finished(files,
    model, settings)` says every file is done already by that model with those settings
    (`loader.settings_before_load`, where they are known before the model is read).
    `batch_seconds` (the run's --batch-seconds) shapes the encoder backend's profiles, so a
    TensorRT engine built by `export-engine --batch-seconds` with the same value is found.
    `words`: an output shows word times (Whisper aligns words only then). `language`, `task`,
    `prompt`: --language, --task, --prompt. `out` (--out, `out_folder`) and `report` (--json: its folder must be
    writable) are checked once the inputs are known and before the model loads (None: not
    given)."""
    # Nothing imported before the model loads imports torch (test_cli checks it): a usage error
    # is said in a fraction of a second, not after torch's seconds of import.
    from engines.checkpoint import CheckpointError
    from engines.loader import OptionError, checked_model, settings_before_load
    from transcribe.signals import remember_sigint
    from transcribe.workers import Prespawned, WorkerStartError, default_workers

    remember_sigint()
    language, part = checked_options(model, device, shard_spec, encoder_backend, decoder_mode, features_on,
                                     dtype, batch_seconds, language, task)
    files, found = discovered(inputs, part)
    new_out = out is not None and not os.path.lexists(out)
    if not files:  # no file hashed to this shard (an array job sized for a bigger set): no model needed
        checked_outputs(out, report)  # the run still leaves its (empty) log there
        typer.echo(f"shard {shard_spec} has no files ({len(found)} files in {part[1]} shards)", err=True)
        return files, None, 0.0, None
    chosen = " (from $TRANSCRIBE_MODEL)" if model is None and os.environ.get("TRANSCRIBE_MODEL") else ""
    try:  # the model's name, and whether it takes these options, before any worker, folder or weight
        model = checked_model(model, encoder_backend, features_on, language, task, prompt)
    except OptionError as e:  # an option this model does not take (--language for Parakeet)
        raise fail(str(e), EXIT_USAGE)
    except CheckpointError as e:  # an unknown name, a missing file: said before --out is made
        raise fail(f"cannot load model{chosen}: {e}", EXIT_NOTHING_RAN)
    checked_outputs(out, report)
    if finished is not None:
        settings = settings_before_load(model, language, task, prompt)
        if settings is not None and finished(files, model, settings):
            typer.echo(f"model: {model} not loaded: every file is done already", err=True)
            return files, None, 0.0, None
    t0 = time.perf_counter()
    # No more workers than files, nor, this early (some files may be done already; the job
    # spawns what it lacks), than cores: each is a process importing torch (~250 MB), and
    # `--workers 1000` on one file spawned them all, 0.5 GB more a second until the machine ran out.
    try:
        spares = Prespawned(min(workers or default_workers(), len(files), os.cpu_count() or 1))
    except WorkerStartError as e:
        raise fail(str(e), EXIT_NOTHING_RAN)
    engine = None
    try:
        engine = loaded_engine(model, chosen, device, encoder_backend, decoder_mode, features_on, dtype,
                               batch_seconds, words, language, task, prompt)
    finally:
        if engine is None:  # failed or interrupted: the spare workers have nothing to do
            spares.close(grace_s=0.0)
            if new_out:
                unmade(out)
    runtime = getattr(engine, "runtime", "")  # backend, dtypes, decoder mode (Parakeet: features too)
    typer.echo(f"model: {engine.name} on {engine.device}" + (f" ({runtime})" if runtime else ""), err=True)
    return files, engine, time.perf_counter() - t0, spares


def checked_options(model, device, shard_spec, encoder_backend, decoder_mode, features_on, dtype,
                    batch_seconds, language, task):
    """The options every run takes, checked before any file is looked at (exit 2 on a bad one);
    returns (--language as a code, the parsed --shard or None)."""
    from engines.choices import ENCODER_BACKENDS, DecodeMode
    from engines.whisper_languages import language_code
    from transcribe.audio_frontend import FEATURES_ON
    from transcribe.inputs import parse_shard

    refuse_empty([model], "--model", "model")  # "$MODEL" unset: not the default model, silently
    check_choice("--encoder-backend", encoder_backend, ENCODER_BACKENDS)
    check_choice("--decoder-mode", decoder_mode, (m.value for m in DecodeMode))
    check_choice("--features-on", features_on, FEATURES_ON)
    check_runtime(device, dtype)
    if task not in ("transcribe", "translate"):
        raise fail(f"--task {task!r}: expected transcribe or translate", EXIT_USAGE)
    if language is not None:
        try:
            language = language_code(language)  # EN, English, english: en
        except ValueError as e:
            raise fail(str(e), EXIT_USAGE)
    if batch_seconds is not None and not math.isfinite(batch_seconds):
        raise fail(f"--batch-seconds {batch_seconds}: expected a finite number of seconds", EXIT_USAGE)
    try:
        return language, (parse_shard(shard_spec) if shard_spec else None)
    except ValueError as e:
        raise fail(str(e), EXIT_USAGE)


def discovered(inputs: list[str], part):
    """(this shard's files, every file found); exit 1 when nothing is found."""
    from transcribe.inputs import InputError, discover, shard

    refuse_empty(inputs, "an INPUT", "file or folder")
    try:
        os.getcwd()  # relative paths, and each worker's start, need it
    except FileNotFoundError:
        raise fail("the working folder no longer exists (removed since the shell entered it): cd to one that "
                   "does", EXIT_NOTHING_RAN)
    try:
        found = discover(inputs)
    except InputError as e:
        raise fail(str(e), EXIT_NOTHING_RAN)
    if not found:
        raise fail(f"no audio files found in: {' '.join(inputs)}", EXIT_NOTHING_RAN)
    return shard(found, part), found


def checked_outputs(out: Optional[Path], report: Optional[Path]) -> None:
    """`out` (--out: `out_folder`) and `report`'s folder (--json), made and checked writable
    (None: not given): once the inputs and the model's name are known, before the model loads."""
    if out is not None:
        out_folder(out)
    if report is not None:
        writable_folder(report.parent, "--json")


def unmade(out: Path) -> None:
    """Remove the --out folder this run made (`out_folder`) when the model failed to load and it
    holds only the lock file: a failed run leaves no empty folder for the user to find, and a
    folder it did not make is left as it was. The lock is taken first (`resume.out_dir_lock`),
    so a folder another run has begun to use since is left alone."""
    from transcribe.resume import LOCK_NAME, OutputBusy, out_dir_lock

    try:
        if [p.name for p in out.iterdir()] != [LOCK_NAME]:
            return
        with out_dir_lock(out):
            (out / LOCK_NAME).unlink()
            out.rmdir()
    except (OutputBusy, OSError):  # in use, or not ours to remove after all: leave it
        pass


def loaded_engine(model: str, chosen: str, device, encoder_backend, decoder_mode, features_on, dtype,
                  batch_seconds, words, language, task, prompt):
    """`engines.loader.load_engine` with its failures as the command's exit: 2 for an option the
    model turns out not to take, 1 for a model or device that cannot run, 128 + N for a signal.
    `chosen` says where the model's name came from, for the message."""
    from engines.checkpoint import CheckpointError
    from engines.choices import DeviceError, EngineBuildError
    from engines.loader import OptionError
    from transcribe.signals import Interrupted, forget_signals, stop_if_signalled

    try:
        try:  # the imports too: torch's take seconds, and a ^C in them is a ^C during the load
            from engines.encoder_backend import BackendOptions
            from engines.loader import load_engine

            options = BackendOptions() if batch_seconds is None else BackendOptions(batch_seconds=batch_seconds)
            return load_engine(model, device, encoder_backend, decoder_mode, features_on, dtype, options,
                               word_timestamps=words, language=language, task=task, prompt=prompt)
        except BaseException:
            # A ^C while the weights load: torch's reader turns its KeyboardInterrupt into an
            # AttributeError ('ExFileObject' object has no attribute 'read'), a traceback and
            # exit 1. It ends the command as a ^C during the job does.
            stop_if_signalled()
            raise
    except Interrupted as e:
        forget_signals()  # said: a later job in this process (a library caller's) runs
        typer.echo(f"interrupted by {e} while the model loaded: nothing was transcribed", err=True)
        raise typer.Exit(128 + e.signum)
    except OptionError as e:  # one known once the model is read (a language its vocabulary lacks)
        raise fail(str(e), EXIT_USAGE)
    except DeviceError as e:  # the model is fine; this machine cannot run what was asked of it
        raise fail(f"cannot run on this device: {e}", EXIT_NOTHING_RAN)
    except (CheckpointError, EngineBuildError, ValueError, OSError, ImportError) as e:  # ImportError: an extra's package
        raise fail(f"cannot load model{chosen}: {e}", EXIT_NOTHING_RAN)


def interruptible(job, then: str = "run the same command again to resume"):
    """Run `job`; SIGINT / SIGTERM end the command with 128 + the signal after it cleaned up,
    saying `then`: what a rerun does."""
    from transcribe.output_writer import OutputStopped
    from transcribe.resume import OutputBusy
    from transcribe.shm import SharedMemoryTooSmall
    from transcribe.signals import Interrupted, exit_at_once_on_sigint
    from transcribe.workers import WorkerStartError

    try:
        return job()
    except (Interrupted, KeyboardInterrupt) as e:
        # KeyboardInterrupt: a ^C after the job restored Python's handler, on its way out
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        exit_at_once_on_sigint()
        typer.echo(f"interrupted by {signal.Signals(signum).name}: finished files are written; {then}", err=True)
        raise typer.Exit(128 + signum)
    except (WorkerStartError, SharedMemoryTooSmall) as e:
        raise fail(str(e), EXIT_NOTHING_RAN)
    except OutputBusy as e:
        raise fail(f"{e}; wait for it to finish, or write to another --out", EXIT_NOTHING_RAN)
    except OutputStopped as e:
        raise fail(f"cannot write outputs, stopped: {e}. Files finished before are written; "
                    "run the same command again to resume once they can be written", EXIT_NOTHING_RAN)
