"""`btnode serve --checkpoint DIR`: one process from a checkpoint to an OpenAI endpoint. Every block
(or the whole AR model) is loaded here and linked into one local chain, whose gRPC entry listens on
a local port (`btnode generate --entry` and other API servers reach it); the HTTP API and its page
(node/api.py) sit in front of that entry, in the same process."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from btnode.errors import CheckpointError, ConfigError
from btnode.meter import Meter
from btnode.node.api import ApiConfig, run_api
from btnode.node.stage import StageConfig
from btnode.rpc.health import NodeHealth
from btnode.rpc.stages import serve_stage
from btnode.serve.ar import LocalARStage
from btnode.serve.context_cache import ContextCacheConfig
from btnode.serve.draft import ARDrafter
from btnode.serve.identity import ModelIdentity, Origin, chain_sha256
from btnode.serve.stages import LocalBlockStage, local_chain
from btnode.settings import flag, same_flag
from btnode.store import files
from btnode.store.models import checkpoint_version, kind_of, load_ar, load_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """The chain `btnode serve` holds (local)."""

    checkpoint: Path | None = same_flag(StageConfig, "checkpoint")
    entry_listen: str = flag("--entry-listen", "HOST:PORT of the chain's gRPC entry in this process (port 0 picks "
                                               "one; `btnode generate --entry` reaches it).", default="127.0.0.1:0")
    context_cache_mb: float = same_flag(StageConfig, "context_cache_mb")
    kv_cache_mb: float = same_flag(StageConfig, "kv_cache_mb")
    draft: Path | None = same_flag(StageConfig, "draft")


def weights_sha256(units: list[torch.nn.Module]) -> str:
    """One hash of the served weights: sha256 over each unit's canonical state hash, in chain order."""
    return chain_sha256([files.state_sha256(unit.state_dict()) for unit in units])


def load_chain(config: ServeConfig, device: torch.device, name: str) -> tuple[LocalBlockStage | LocalARStage,
                                                                               ModelIdentity]:
    """The whole chain in this process, its first stage, and which weights it serves."""
    folder = config.checkpoint
    if folder is None:
        raise ConfigError("give --checkpoint DIR (a train-local, train-ar or aggregator state folder)")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    kv_bytes = int(config.kv_cache_mb * 2**20)
    origin = Origin(name=folder.resolve().name, version=checkpoint_version(folder))
    first: LocalBlockStage | LocalARStage
    if kind_of(folder) == "ar":
        model = load_ar(folder).model
        drafter = ARDrafter(load_ar(config.draft).model, device=device, kv_bytes=kv_bytes) \
            if config.draft is not None else None  # type: ignore[arg-type]
        first = LocalARStage(model, 0, model.n_layers, device=device, name="ar",  # type: ignore[arg-type]
                             drafter=drafter, kv_bytes=kv_bytes, origin=origin)
    else:
        if config.draft is not None:
            raise ConfigError("--draft (speculative decoding with a draft model) is for an AR checkpoint")
        _, blocks = load_blocks(folder)
        contexts = ContextCacheConfig(max_bytes=int(config.context_cache_mb * 2**20))
        first = local_chain(blocks, device, contexts, origin)
    weights = first.weights()  # the same Weights a proxy in front of this entry (or of separate stages) reads
    assert weights is not None
    identity = ModelIdentity.of(weights, name)
    return first, identity


def run_serve(config: ServeConfig, api: ApiConfig, device: torch.device) -> None:
    """Load the chain, serve its gRPC entry, and the HTTP API in front of it until SIGINT or SIGTERM."""
    stage, identity = load_chain(config, device, api.model_name)
    server, port, stop = serve_stage(stage, config.entry_listen, meter=Meter(), health=NodeHealth(serving=True))
    host = config.entry_listen.rpartition(":")[0].strip("[]")
    entry = f"{host if host not in ('', '0.0.0.0', '::') else '127.0.0.1'}:{port}"
    log.info("model %s: version %d, weights sha256 %s; gRPC entry on %s", identity.id, identity.version,
             identity.weights_sha256, entry)

    def ready(url: str) -> None:
        body = json.dumps({"model": identity.id, "prompt": "The history of", "max_tokens": 64})
        print(f"serving {identity.id} at {url}/v1 (the page: {url}/; gRPC entry {entry})\n"
              f"curl -s {url}/v1/completions -H 'Content-Type: application/json'"
              + (" -H \"Authorization: Bearer $KEY\"" if api.api_key else "") + f" -d '{body}'", flush=True)

    try:
        run_api(dataclasses.replace(api, entries=(entry,)), identity, on_listening=ready)
    finally:
        stop.set()
        server.stop(grace=2.0).wait()
