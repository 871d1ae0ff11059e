"""The ``kvrouter`` command line.

Each command group lives in its own module and registers itself here, so
the CLI stays one small file.
"""

from __future__ import annotations

import typer

from kvrouter.commands import worker as worker_command

app = typer.Typer(
    name="kvrouter",
    help="KV-cache-aware router for LLM inference clusters.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def up() -> None:
    """Start Redis, the indexer, workers and the gateway on this machine."""
    typer.echo("kvrouter up: not yet -- the gateway arrives with issue 6.")
    raise typer.Exit(code=1)


@app.command()
def version() -> None:
    """Print the version."""
    from kvrouter import __version__

    typer.echo(__version__)


worker_command.register(app)


def main() -> None:
    """Entry point of the ``kvrouter`` script."""
    app()
