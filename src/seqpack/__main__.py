"""``python -m seqpack`` runs the command line."""

from .cli import main

raise SystemExit(main(exiting=True))
