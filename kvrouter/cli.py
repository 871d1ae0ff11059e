"""The ``kvrouter`` command line.

Each command group lives in its own module and registers itself here, so
the CLI stays one small file.
"""

from __future__ import annotations

import typer

from kvrouter.bench.cli import bench_app
from kvrouter.commands import indexer as indexer_command
from kvrouter.commands import serve as serve_command
from kvrouter.commands import top as top_command
from kvrouter.commands import up as up_command
from kvrouter.commands import vllm_adapter as vllm_adapter_command
from kvrouter.commands import worker as worker_command

app = typer.Typer(
    name="kvrouter",
    help="KV-cache-aware router for LLM inference clusters.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")


@app.command()
def version() -> None:
    """Print the version."""
    from kvrouter import __version__

    typer.echo(__version__)


worker_command.register(app)
serve_command.register(app)
up_command.register(app)
indexer_command.register(app)
vllm_adapter_command.register(app)
top_command.register(app)


def main() -> None:
    """Entry point of the ``kvrouter`` script."""
    app()
