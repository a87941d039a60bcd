"""`btnode serve --checkpoint DIR`: the chain, its gRPC entry and the OpenAI-compatible HTTP API in one
process (docs/serving.md)."""

from __future__ import annotations

from typing import Any

import typer

from btnode.node.api import ApiConfig
from btnode.node.serving import ServeConfig
from btnode.node.settings import HostConfig
from btnode.settings import Section, build
from btnode_cli.options import device, takes

_CHECKPOINT = ("Block or AR checkpoint folder (train-local, train-ar, or an aggregator's state folder: its newest "
               "versions); every block is loaded in this process.")


@takes(Section(ServeConfig, helps={"checkpoint": _CHECKPOINT}), Section(ApiConfig, omit=("entry",)),
       Section(HostConfig, only=("device_name",)))
def serve(**flags: Any) -> None:
    """Serve a checkpoint as an OpenAI-compatible endpoint from one process: /v1/completions,
    /v1/chat/completions, /v1/models, a page at /, /health and /metrics on --listen, and the chain's
    gRPC entry on --entry-listen; prints the URL and a curl line; runs until SIGINT or SIGTERM."""
    from btnode.node.serving import run_serve

    run_serve(build(ServeConfig, flags), build(ApiConfig, flags), device(flags["device_name"]))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
