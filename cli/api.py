"""`btnode api`: an OpenAI-compatible HTTP server in front of a serving chain (docs/serving.md)."""

from __future__ import annotations

from typing import Any

import typer

from btnode.node.api import ApiConfig
from btnode.settings import build
from btnode_cli.options import takes


@takes(ApiConfig)
def api(**flags: Any) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and a page at / in
    front of the chain whose entry is --entry; runs until SIGINT or SIGTERM."""
    from btnode.node.api import run_api

    run_api(build(ApiConfig, flags))


def register(app: typer.Typer) -> None:
    app.command("api")(api)
