"""The `transcribe` console script, and `python -m transcribe ...` (a venv not on PATH, a
checkout run in place): the CLI imported under a ^C guard, then run."""
import atexit
import signal
import sys

# Set when the command ends on a ^C (status 130, its work written): the process then ends by
# SIGINT itself, after every other exit handler, as Python does for an uncaught
# KeyboardInterrupt, so that a shell loop over folders stops (`signals.end_by_signal`). The
# shell still reports 130; a Python caller sees -2.
_ended_by_sigint = False


def _die_by_sigint() -> None:
    if _ended_by_sigint:
        from transcribe.signals import end_by_signal  # the standard library only

        end_by_signal(signal.SIGINT)


def main() -> None:
    """`transcribe.cli.main`, after importing it: a ^C during the imports (typer, numpy: about a
    tenth of a second) ends the command as a ^C later does, not with a traceback."""
    global _ended_by_sigint
    atexit.register(_die_by_sigint)  # registered first, so it runs last
    try:
        from transcribe.cli import main as cli_main
    except KeyboardInterrupt:
        _ended_by_sigint = True
        sys.exit(130)
    try:
        cli_main()
    except SystemExit as e:
        _ended_by_sigint = e.code == 128 + signal.SIGINT
        raise


if __name__ == "__main__":
    main()
