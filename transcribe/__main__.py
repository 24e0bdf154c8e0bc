"""The `transcribe` console script, and `python -m transcribe ...` (a venv not on PATH, a
checkout run in place): the CLI imported under a ^C guard, then run."""
import sys


def main() -> None:
    """`transcribe.cli.main`, after importing it: a ^C during the imports (typer, numpy: about a
    tenth of a second) ends the command with 130, as a ^C later does, not with a traceback."""
    try:
        from transcribe.cli import main as cli_main
    except KeyboardInterrupt:
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
