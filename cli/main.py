"""`btnode`: the composition root. Parses flags, configures logging, builds frozen configs and hands
them to the library. The commands' options are derived from the config dataclasses that declare
them (btnode/settings.py), so registering the commands imports those modules (and torch)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from btnode import __version__
from btnode.errors import BtnodeError

app = typer.Typer(help="BlockTrain: block-local decentralised training of a byte-level model.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  context_settings={"auto_envvar_prefix": "BTNODE"})


def _version(value: bool) -> None:
    if value:
        typer.echo(f"btnode {__version__}")
        raise typer.Exit()


@app.callback()
def root(ctx: typer.Context,
         verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
         config: Optional[Path] = typer.Option(None, "--config", envvar="BTNODE_CONFIG",
                                               help="TOML settings file (flags and BTNODE_* variables override it)."),
         log_format: str = typer.Option("auto", "--log-format",
                                        help="auto (JSON lines under systemd, text otherwise), text or json."),
         token_file: Optional[Path] = typer.Option(None, "--token-file", envvar="BTNODE_TOKEN_FILE",
                                                   help="File holding the swarm token (or set BTNODE_TOKEN)."),
         tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", envvar="BTNODE_TLS_CERT",
                                                 help="This node's TLS certificate chain (PEM)."),
         tls_key: Optional[Path] = typer.Option(None, "--tls-key", envvar="BTNODE_TLS_KEY", help="Its private key (PEM)."),
         tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", envvar="BTNODE_TLS_CA",
                                               help="CA certificate the swarm's certificates are checked against."),
         tls_client_auth: bool = typer.Option(False, "--tls-client-auth", envvar="BTNODE_TLS_CLIENT_AUTH",
                                              help="Servers: require client certificates (mutual TLS)."),
         tls_server_name: str = typer.Option("", "--tls-server-name", envvar="BTNODE_TLS_SERVER_NAME",
                                             help="Clients: the name the server's certificate must carry."),
         identity: Optional[Path] = typer.Option(None, "--identity", envvar="BTNODE_IDENTITY",
                                                 help="Folder of this node's identity in the swarm (made at enrollment "
                                                      "from --join-code; default with a code: "
                                                      "~/.local/state/btnode/ID)."),
         join_code: str = typer.Option("", "--join-code", envvar="BTNODE_JOIN_CODE",
                                       help="Single-use code from the swarm's operator (`btnode codes mint`): "
                                            "traded once for this node's identity, which later starts reuse."),
         version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    from btnode_cli import config as settings
    from btnode_cli import logs

    if log_format not in ("auto", "text", "json"):
        raise typer.BadParameter("--log-format must be auto, text or json")
    logs.configure(logging.DEBUG if verbose else logging.INFO, log_format)
    file_security: dict = {}
    if config is not None:
        ctx.default_map = settings.default_map(ctx.command, ctx, config)
        file_security = settings.security_table(config)
    settings.configure_security(ctx, file_security, token_file=token_file, tls_cert=tls_cert, tls_key=tls_key,
                                tls_ca=tls_ca, tls_client_auth=tls_client_auth, tls_server_name=tls_server_name, identity=identity, join_code=join_code)


# the root's options that take a value: the word after one of them is not the command
_ROOT_VALUES = frozenset(("--config", "--log-format", "--token-file", "--tls-cert", "--tls-key", "--tls-ca",
                          "--tls-server-name", "--identity", "--join-code"))


def command_word(argv: list[str]) -> str | None:
    """The command named on the command line (`btnode -v api …` → "api"), None for none."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in _ROOT_VALUES
        else:
            return word
    return None


def _register(argv: list[str] | None = None) -> None:
    """Every command, except for `btnode api`: the HTTP proxy registers only itself, so that it never
    imports torch (a light process in front of a remote chain, docs/serving.md)."""
    from btnode_cli import api

    if argv is not None and command_word(argv) == "api":
        api.register(app)
        return
    from btnode_cli import config, data, evaluate, generate, identity, join, judge, ops, serve, simulate, train

    for module in (train, evaluate, judge, generate, api, serve, join, simulate, ops, data, identity, config):
        module.register(app)


def main() -> None:
    """Entry point: domain errors become one line on stderr and their exit code, never a traceback."""
    _register(sys.argv[1:])
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
