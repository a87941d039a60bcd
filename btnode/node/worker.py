"""Run the worker role: check that its unit fits in the memory this host allows (node.memory),
connect to the aggregator (retrying until it is up), train, stop on a signal. `join_worker` is the
role as `btnode join --role worker` runs it, from its configs."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from btnode.data.source import ByteSource
from btnode.device import resolve_device
from btnode.errors import ConfigError, PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.node.aggregator import install_stop_signals
from btnode.node.memory import MemoryLimit, check_worker, setting
from btnode.node.metrics import WorkerCollector, serve_metrics
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.systemd import notify, start_watchdog
from btnode.rpc.enroll import own_name
from btnode.rpc.security import identity_hint
from btnode.rpc.failover import upstream_link
from btnode.settings import flag, same_flag
from btnode.durable import atomic_write
from btnode.swarm.worker import BlockWorker, WorkerConfig, WorkerStats
from btnode.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerNodeConfig:
    """How a worker process reaches its aggregator and what it checks and reports (local)."""

    peer: str | None = flag("--peer", "HOST:PORT of the aggregator or a relay; several, comma-separated: spares, "
                                      "used in order when one fails (docs/swarm.md, \"Relays\").", default=None)
    schedule_steps: int | None = flag("--schedule-steps", "Inner cosine length (default rounds × H).", default=None)
    stats_file: Path | None = flag("--stats-file", "Write transfer and timing stats here on exit.", default=None)
    memory_limit: str | None = flag("--memory-limit", "Memory this worker may use, e.g. 6G or 512M (K/M/G/T = 1024^n, as "
                                                      "systemd's MemoryMax=). The worker refuses to start when btnode "
                                                      "plan's estimate of its peak exceeds the smallest of this, its "
                                                      "cgroup's limit and MemAvailable.", default=None)
    memory_check: bool = flag("--memory-check/--no-memory-check", "Check the estimate against the limits before "
                                                                  "training (off: start anyway, e.g. with swap, and risk "
                                                                  "the kernel's OOM killer).", default=True)
    metrics_listen: str | None = same_flag(ServeConfig, "metrics_listen")


def run_worker(cfg: ModelConfig, tc: TrainConfig, wcfg: WorkerConfig, *, peer: str, corpus: ByteSource | bytes,
               device: torch.device, connect_timeout_s: float = 60.0, stats_file: Path | None = None,
               metrics_listen: str | None = None, stop: threading.Event | None = None,
               memory_limit: MemoryLimit | None = None, memory_check: bool = True, data: str = "") -> WorkerStats:
    """`data`: the corpus's id (btnode.data.identity), stated at Join. `memory_check`: refuse
    (InsufficientMemory) before building anything when plan's estimate of this worker's peak exceeds
    the smallest of `memory_limit`, the cgroup's limit and MemAvailable. Host memory only: on a GPU
    the unit's state lives in device memory, which this does not check."""
    if memory_check and device.type == "cpu":
        check_worker(cfg, block=wcfg.block, batch=tc.batch, codec=wcfg.codec, setting=memory_limit)
    elif memory_check:
        log.info("memory check skipped: it predicts host memory of CPU training, and this worker trains on %s", device)
    stop = stop or threading.Event()
    current: list[BlockWorker] = []
    link = upstream_link(peer, on_retry=lambda what, reason: current[-1].count_retry(what, reason) if current else None)
    alive = threading.Event()
    start_watchdog(alive, stop)
    if metrics_listen:
        serve_metrics(metrics_listen, WorkerCollector(wcfg.block, lambda: current[-1].stats if current else None))
    try:
        deadline = time.monotonic() + connect_timeout_s
        while True:
            worker = BlockWorker(cfg, tc, wcfg, link, corpus, device=device, data_id=data)
            worker.heartbeat = alive.set
            worker.on_ready = lambda: notify("READY=1", f"STATUS=training {cfg.unit_name(wcfg.block)}")
            current[:] = [worker]
            try:
                stats = worker.run(stop)
                break
            except PeerUnavailable as exc:
                if time.monotonic() > deadline or worker.stats.pushes:
                    raise
                if hint := identity_hint(peer.split(",")[0]):
                    raise ConfigError(hint) from None
                log.info("aggregator at %s not reachable yet (%s); retrying", peer, exc)
                alive.set()  # waiting for the peer is not a hang
                stop.wait(1.0)
    finally:
        link.close()
    if stats_file is not None:
        d = asdict(stats)
        d["wall_seconds"] = time.perf_counter() - stats.started
        d["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        atomic_write(stats_file, json.dumps(d, indent=1).encode())
    return stats


def join_worker(model: ModelConfig, train: TrainConfig, worker: WorkerConfig, node: WorkerNodeConfig,
                host: HostConfig) -> None:
    """`btnode join --role worker`: train until --rounds are pushed or SIGTERM/SIGINT. The inner
    schedule is --schedule-steps long, or rounds × H (a long one when rounds are open-ended)."""
    block = 0 if worker.block is None and model.kind == "ar" else worker.block  # the whole AR model is the one unit
    if block is None or node.peer is None:
        raise ConfigError("a worker needs --block and --peer")
    if not 0 <= block < model.total_blocks:
        raise ConfigError(f"--block {block} out of range for {model.total_blocks} blocks" if model.kind == "block" else
                          f"--block {block}: a --model ar run has one unit, block 0 (the whole AR model)")
    cap = setting(node.memory_limit) if node.memory_limit is not None else None
    total = node.schedule_steps or (worker.rounds * worker.steps_per_round if worker.rounds else 100_000)
    tc = replace(train, steps=total, warmup=min(train.warmup, max(1, total // 10)))
    wcfg = replace(worker, block=block, worker_id=worker.worker_id or own_name() or f"{socket.gethostname()}-{os.getpid()}")
    stop = threading.Event()
    install_stop_signals(stop)
    data = host.load_corpus()
    log.info("worker %s trains on %s (data id %s)", wcfg.worker_id, data.train.description, data.ident)
    stats = run_worker(model, tc, wcfg, peer=node.peer, corpus=data.train, device=resolve_device(host.device),
                       stats_file=node.stats_file, metrics_listen=node.metrics_listen, stop=stop, memory_limit=cap,
                       memory_check=node.memory_check, data=data.ident)
    log.info("worker %s done: %d pushes %s", wcfg.worker_id, stats.pushes, stats.outcomes)
