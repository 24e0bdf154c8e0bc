"""The `transcribe` console script, and `python -m transcribe ...` (a venv not on PATH, a
checkout run in place): the CLI imported under a ^C guard, then run."""
import atexit
import os
import signal
import sys

# Set when the command ends on a ^C (status 130, its work written): the process then ends by
# SIGINT itself, after every other exit handler, as Python does for an uncaught
# KeyboardInterrupt. A shell running it in a loop (`for d in */; do transcribe "$d" ...; done`)
# stops the loop only when its child died by the signal: an exit status of 130 made it go on to
# the next folder, one ^C per folder. The shell still reports 130; a Python caller sees -2.
_ended_by_sigint = False


def _die_by_sigint() -> None:
    if not _ended_by_sigint:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, a closed pipe or stream
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


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
