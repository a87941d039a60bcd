"""Run the aggregator role: serve the swarm RPCs, close rounds on time, stop cleanly on a signal.
`join_aggregator` is the role as `btnode join --role aggregator` runs it, from its configs."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from btnode.aggregate.block import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.node.metrics import AggregatorCollector, serve_metrics
from btnode.node.settings import ServeConfig
from btnode.node.systemd import notify, start_watchdog
from btnode.rpc.health import NodeHealth
from btnode.rpc.limits import PeerLimits
from btnode.rpc.server import serve
from btnode.settings import flag, join_ints, parse_ints, same_flag
from btnode.durable import atomic_write
from btnode.train.config import TrainConfig

log = logging.getLogger(__name__)
TICK_S = 0.05  # how often deadlines are checked


@dataclass(frozen=True)
class AggregatorNodeConfig:
    """Where an aggregator keeps its versions and what it owns (local)."""

    state_dir: Path | None = flag("--state-dir", "Where versions are stored.", default=None)
    blocks: tuple[int, ...] | None = flag("--blocks-owned", "Comma-separated blocks to own (default all).",
                                          default=None, param="own_blocks", value=str,
                                          parse=lambda t: parse_ints(t, "--blocks-owned"), format=join_ints)
    seed: int = same_flag(TrainConfig, "seed")  # initialises the units' version 0
    data_id: str | None = flag("--data-id", "The data id every worker must train on (a worker logs its own at start; "
                                            "btnode status shows the swarm's). Default: the first worker's.",
                               default=None)


def install_stop_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def run_aggregator(cfg: ModelConfig, acfg: AggregatorConfig, *, state_dir: Path, listen: str,
                   blocks: list[int] | None = None, seed: int = 0, port_file: Path | None = None,
                   metrics_listen: str | None = None, limits: PeerLimits | None = None,
                   stop: threading.Event | None = None, drain_notice_s: float = 0.0, data_id: str | None = None) -> None:
    """Serve until `stop`; gRPC Health says NOT_SERVING until READY=1, SERVING, then NOT_SERVING for
    `drain_notice_s` (still taking calls) before the server stops accepting and the rounds drain."""
    stop = stop or threading.Event()
    agg = SwarmAggregator(cfg, acfg, state_dir, blocks=blocks, seed=seed, data_id=data_id)
    if metrics_listen:
        serve_metrics(metrics_listen, AggregatorCollector(agg))
    health = NodeHealth()
    server, port, server_stop = serve(agg, listen, limits=limits, health=health)
    host = listen.rsplit(":", 1)[0]
    owns = f"the {cfg.ar_layers}-layer AR model (DiLoCo)" if cfg.kind == "ar" else f"blocks {sorted(agg.blocks)}"
    outer = acfg.outer
    c = acfg.claims
    claims = (f"claims checked against batch {c.batch}, lr {c.lr:g}, H {c.steps_per_round}" if c.enforce
              else "claims believed")
    log.info("aggregator for %s listening on %s:%d (fingerprint %s…; outer step η=%g, Nesterov μ=%g, %s; %s)", owns,
             host, port, agg.fingerprint[:12], outer.lr, outer.momentum, outer.robust, claims)
    if port_file is not None:
        atomic_write(port_file, f"{port}\n".encode())
    health.serving()
    notify("READY=1", f"STATUS=serving blocks {sorted(agg.blocks)} on port {port}")
    alive = threading.Event()
    start_watchdog(alive, stop)
    try:
        while not stop.is_set():
            agg.tick()
            alive.set()
            stop.wait(TICK_S)
    finally:
        notify("STOPPING=1", "STATUS=draining")
        health.draining(drain_notice_s)
        server_stop.set()
        server.stop(grace=5.0).wait()  # in-flight pushes finish (and are judged) first
        for info in agg.drain():
            log.info("drain: block %d published version %d with the round's accepted updates", info.block,
                     info.version)
        log.info("aggregator stopped")


def join_aggregator(model: ModelConfig, aggregate: AggregatorConfig, limits: PeerLimits, serve: ServeConfig,
                    node: AggregatorNodeConfig) -> None:
    """`btnode join --role aggregator`: serve until SIGTERM/SIGINT."""
    if node.state_dir is None:
        raise ConfigError("the aggregator needs --state-dir")
    stop = threading.Event()
    install_stop_signals(stop)
    run_aggregator(model, aggregate, state_dir=node.state_dir, listen=serve.listen, seed=node.seed,
                   port_file=serve.port_file, stop=stop, metrics_listen=serve.metrics_listen,
                   drain_notice_s=serve.drain_notice, limits=limits, blocks=list(node.blocks) if node.blocks else None,
                   data_id=node.data_id)
