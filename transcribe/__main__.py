"""`python -m transcribe ...`: the `transcribe` command without its console script (a venv not
on PATH, a checkout run in place)."""
from transcribe.cli import main

main()
