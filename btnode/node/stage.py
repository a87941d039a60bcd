"""Run the stage role: load one block (from a checkpoint folder, an aggregator's state folder or a
live aggregator) or a slice of the AR baseline, link it to the candidates for the next stage, serve.
`join_stage` is the role as `btnode join --role stage` runs it, from its configs."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from btnode.errors import CheckpointError, ConfigError
from btnode.model.block import DiffusionBlock
from btnode.device import resolve_device
from btnode.model.config import KINDS, ModelConfig
from btnode.node.aggregator import install_stop_signals
from btnode.node.metrics import StageCollector, serve_metrics
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.systemd import notify, start_watchdog
from btnode.node.worker import WorkerNodeConfig
from btnode.protocol import Meter
from btnode.rpc.client import SwarmClient
from btnode.rpc.health import NodeHealth
from btnode.rpc.stages import RemoteARStage, RemoteBlockStage, serve_stage
from btnode.serve.ar import LocalARStage
from btnode.serve.context_cache import ContextCacheConfig
from btnode.serve.draft import ARDrafter
from btnode.serve.kvcache import KV_BUDGET_BYTES
from btnode.serve.defaults import serving_defaults
from btnode.serve.identity import Origin
from btnode.serve.stages import FailoverStage, LocalBlockStage
from btnode.settings import flag, parse_ints, same_flag
from btnode.durable import atomic_write
from btnode.store.files import state_sha256
from btnode.store.models import checkpoint_version, load_ar, load_one_block
from btnode.swarm.worker import WorkerConfig

log = logging.getLogger(__name__)


def layer_range(text: str) -> tuple[int, int]:
    """--layers-range LO:HI."""
    parsed = parse_ints(text.replace(":", ","), "--layers-range")
    if len(parsed) != 2:
        raise ConfigError(f"--layers-range takes LO:HI, got {text!r}")
    return parsed[0], parsed[1]


@dataclass(frozen=True)
class StageConfig:
    """What a stage serves and whom it hands on to (local)."""

    kind: str = same_flag(ModelConfig, "kind")  # --model: block, or a slice of an AR model
    block: int | None = same_flag(WorkerConfig, "block", default=None)
    layers: tuple[int, int] | None = flag("--layers-range", "Layers LO:HI of the AR model this stage holds (--model ar).",
                                          default=None, value=str, parse=layer_range,
                                          format=lambda r: f"{r[0]}:{r[1]}")
    checkpoint: Path | None = flag("--checkpoint", "Load the block (or AR model) from this folder instead of --peer.",
                                   default=None)
    peer: str | None = same_flag(WorkerNodeConfig, "peer")
    next_stages: tuple[str, ...] = flag("--next", "HOST:PORT of the next stage; a comma-separated list adds spares, "
                                                  "tried in order.", default=(), param="next_stage", value=str,
                                        parse=lambda t: tuple(a.strip() for a in t.split(",") if a.strip()),
                                        format=lambda n: ",".join(n) or None, optional=True)
    timeout_s: float = flag("--stage-timeout", "Seconds to wait for the next stage before trying a spare.", default=60.0)
    name: str | None = same_flag(WorkerConfig, "worker_id", default=None)
    context_cache_mb: float = flag("--context-cache-mb", "Memory for per-request clean-stream caches of a block stage "
                                                         "(0 = off: every segment rebuilds its window).", default=256.0)
    context_cache_entries: int = flag("--context-cache-entries", "Requests whose caches are kept (least recently used "
                                                                 "go first).", default=1024)
    draft: Path | None = flag("--draft", "AR checkpoint folder of a small draft model (the first stage of a --model ar "
                                         "chain): lets requests ask for speculative decoding.", default=None)
    kv_cache_mb: float = flag("--kv-cache-mb", "Memory for per-request KV caches of a --model ar stage, all requests "
                                               "together (least recently used go first).", default=256.0)


def block_from_aggregator(peer: str, block: int) -> tuple[ModelConfig, DiffusionBlock, int]:
    """The newest version of `block` pulled from a live aggregator, hash-checked; and its version."""
    client = SwarmClient(peer, timeout_s=60)
    try:
        cfg = client.model_config()
        if cfg.kind != "block":
            raise ConfigError(f"the aggregator at {peer} trains an AR model (DiLoCo), not blocks; serve it with "
                              "--model ar --checkpoint <its state folder>")
        model = DiffusionBlock(cfg)
        pulled = client.pull(block, f"stage-{block}", {n: tuple(t.shape) for n, t in model.state_dict().items()})
    finally:
        client.close()
    if state_sha256(pulled.tensors) != pulled.info.sha256:
        raise CheckpointError(f"block {block} v{pulled.info.version} from {peer} fails its hash")
    model.load_state_dict(pulled.tensors)
    log.info("loaded block %d version %d from %s", block, pulled.info.version, peer)
    return cfg, model, pulled.info.version


def _origin(checkpoint: Path) -> Origin:
    """Which weights a checkpoint folder holds, as a model id names them (serve/identity.py)."""
    return Origin(name=checkpoint.resolve().name, version=checkpoint_version(checkpoint))


def build_stage(*, kind: str, block: int | None, layers: tuple[int, int] | None, checkpoint: Path | None,
                peer: str | None, next_stages: list[str], device: torch.device, timeout_s: float,
                name: str, context_cache: ContextCacheConfig = ContextCacheConfig(), draft: Path | None = None,
                kv_bytes: int = KV_BUDGET_BYTES) -> LocalBlockStage | LocalARStage:
    if draft is not None and kind != "ar":
        raise ConfigError("--draft (speculative decoding) is for the first stage of an AR chain (--model ar)")
    if kind == "ar":
        if checkpoint is None or layers is None:
            raise ConfigError("an autoregressive stage needs --checkpoint (an AR folder) and --layers LO:HI")
        model = load_ar(checkpoint).model
        origin = _origin(checkpoint)
        drafter = None
        if draft is not None:
            if layers[0] != 0:
                raise ConfigError("--draft belongs on the first stage of the AR chain (--layers-range 0:HI)")
            drafter = ARDrafter(load_ar(draft).model, device=device, kv_bytes=kv_bytes)  # type: ignore[arg-type]
            log.info("entry %s drafts with %s (%d layers)", name, draft, drafter.model.n_layers)
        nxt = FailoverStage([RemoteARStage(a, timeout_s=timeout_s) for a in next_stages]) if next_stages else None
        return LocalARStage(model, layers[0], layers[1], next=nxt, device=device, name=name,  # type: ignore[arg-type]
                            drafter=drafter, kv_bytes=kv_bytes, origin=origin)
    if block is None:
        raise ConfigError("a block stage needs --block")
    if (checkpoint is None) == (peer is None):
        raise ConfigError("give exactly one of --checkpoint (a folder) or --peer (a live aggregator)")
    if peer:
        cfg, model, version = block_from_aggregator(peer, block)
        origin = Origin(version=version)
    else:
        cfg, model = load_one_block(checkpoint, block)  # type: ignore[arg-type]
        origin = _origin(checkpoint)  # type: ignore[arg-type]
    is_last = block == cfg.total_blocks - 1
    may_end = is_last or block == cfg.n_blocks - 1  # the last scoring block ends sweeps without tail steps
    if is_last and next_stages:
        raise ConfigError(f"block {block} is the last block: it takes no --next")
    if not may_end and not next_stages:
        raise ConfigError(f"block {block} needs --next (the stage, or stages, of block {block + 1})")
    nxt = FailoverStage([RemoteBlockStage(a, timeout_s=timeout_s) for a in next_stages]) if next_stages else None
    return LocalBlockStage(model, block, cfg.n_blocks, next=nxt, device=device, name=name, context_cache=context_cache,
                           defaults=serving_defaults(cfg, checkpoint), origin=origin)  # a checkpoint's serving.json


def run_stage(stage: LocalBlockStage | LocalARStage, *, listen: str, port_file: Path | None = None,
              metrics_listen: str | None = None, stop: threading.Event | None = None,
              drain_notice_s: float = 0.0) -> None:
    """Serve until `stop`; gRPC Health as for the aggregator: NOT_SERVING until ready, SERVING, then
    NOT_SERVING for `drain_notice_s` (still serving) before the server stops accepting."""
    stop = stop or threading.Event()
    meter = Meter()
    if metrics_listen:
        serve_metrics(metrics_listen, StageCollector("ar" if isinstance(stage, LocalARStage) else "block", meter))
    health = NodeHealth()
    server, port, server_stop = serve_stage(stage, listen, meter=meter, health=health)
    log.info("stage %s listening on %s:%d", stage.name, listen.rsplit(":", 1)[0], port)
    if port_file is not None:
        atomic_write(port_file, f"{port}\n".encode())
    health.serving()
    notify("READY=1", f"STATUS=serving {stage.name} on port {port}")
    start_watchdog(None, stop)
    try:
        stop.wait()
    finally:
        notify("STOPPING=1")
        health.draining(drain_notice_s)
        server_stop.set()
        server.stop(grace=5.0).wait()
        log.info("stage %s stopped", stage.name)


def join_stage(stage: StageConfig, serve: ServeConfig, host: HostConfig) -> None:
    """`btnode join --role stage`: build the stage and serve until SIGTERM/SIGINT."""
    if stage.kind not in KINDS:
        raise ConfigError(f"--model must be block or ar, got {stage.kind!r}")
    span = f"{stage.layers[0]}:{stage.layers[1]}" if stage.layers else None
    name = stage.name or (f"block-{stage.block}" if stage.kind == "block" else f"ar-{span}")
    contexts = ContextCacheConfig(max_bytes=int(stage.context_cache_mb * 2**20), max_entries=stage.context_cache_entries)
    built = build_stage(kind=stage.kind, block=stage.block, layers=stage.layers, checkpoint=stage.checkpoint,
                        peer=stage.peer, next_stages=list(stage.next_stages), device=resolve_device(host.device),
                        timeout_s=stage.timeout_s, name=name, context_cache=contexts, draft=stage.draft,
                        kv_bytes=int(stage.kv_cache_mb * 2**20))
    stop = threading.Event()
    install_stop_signals(stop)
    run_stage(built, listen=serve.listen, port_file=serve.port_file, metrics_listen=serve.metrics_listen, stop=stop,
              drain_notice_s=serve.drain_notice)
