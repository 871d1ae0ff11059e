"""``python -m kvrouter`` runs the CLI."""

from kvrouter.cli import main

main()
