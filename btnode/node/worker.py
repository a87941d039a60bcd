"""Run the worker role: check that its unit fits in the memory this host allows (node.memory),
connect to the aggregator (retrying until it is up), train, stop on a signal."""

from __future__ import annotations

import json
import logging
import resource
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from btnode.errors import PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.node.memory import MemoryLimit, check_worker
from btnode.node.metrics import WorkerCollector, serve_metrics
from btnode.node.systemd import notify, start_watchdog
from btnode.rpc.client import SwarmClient
from btnode.store.files import atomic_write
from btnode.swarm.worker import BlockWorker, WorkerConfig, WorkerStats
from btnode.train.config import TrainConfig

log = logging.getLogger(__name__)


def run_worker(cfg: ModelConfig, tc: TrainConfig, wcfg: WorkerConfig, *, peer: str, corpus: bytes,
               device: torch.device, connect_timeout_s: float = 60.0, stats_file: Path | None = None,
               metrics_listen: str | None = None, stop: threading.Event | None = None,
               memory_limit: MemoryLimit | None = None, memory_check: bool = True) -> WorkerStats:
    """`memory_check`: refuse (InsufficientMemory) before building anything when plan's estimate of
    this worker's peak exceeds the smallest of `memory_limit`, the cgroup's limit and MemAvailable.
    Host memory only: on a GPU the unit's state lives in device memory, which this does not check."""
    if memory_check and device.type == "cpu":
        check_worker(cfg, block=wcfg.block, batch=tc.batch, codec=wcfg.codec, setting=memory_limit)
    elif memory_check:
        log.info("memory check skipped: it predicts host memory of CPU training, and this worker trains on %s", device)
    stop = stop or threading.Event()
    link = SwarmClient(peer)
    current: list[BlockWorker] = []
    alive = threading.Event()
    start_watchdog(alive, stop)
    if metrics_listen:
        serve_metrics(metrics_listen, WorkerCollector(wcfg.block, lambda: current[-1].stats if current else None))
    try:
        deadline = time.monotonic() + connect_timeout_s
        while True:
            worker = BlockWorker(cfg, tc, wcfg, link, corpus, device=device)
            worker.heartbeat = alive.set
            worker.on_ready = lambda: notify("READY=1", f"STATUS=training {cfg.unit_name(wcfg.block)}")
            current[:] = [worker]
            try:
                stats = worker.run(stop)
                break
            except PeerUnavailable as exc:
                if time.monotonic() > deadline or worker.stats.pushes:
                    raise
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
