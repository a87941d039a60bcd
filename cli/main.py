"""`btnode`: the composition root. Parses flags, configures logging, builds frozen configs and hands
them to the library. Heavy imports (torch) happen inside commands so `btnode --help` stays fast."""

from __future__ import annotations

import logging
import sys

import typer

from btnode import __version__
from btnode.errors import BtnodeError

app = typer.Typer(help="BlockTrain: block-local decentralised training of a byte-level model.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"btnode {__version__}")
        raise typer.Exit()


@app.callback()
def root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
         version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _register() -> None:
    from btnode_cli import evaluate, generate, join, simulate, train

    for module in (train, evaluate, generate, join, simulate):
        module.register(app)


def main() -> None:
    """Entry point: domain errors become one line on stderr and their exit code, never a traceback."""
    _register()
    try:
        app()
    except BtnodeError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
