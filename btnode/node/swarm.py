"""`btnode swarm`: a whole swarm on this machine: one aggregator and B × R workers (or, in a
DiLoCo run, R full-replica workers of the one AR unit), each its own process on loopback, started
through the real CLI. Prints the CE each unit's accepted updates reported, per round, as versions
are published."""

from __future__ import annotations

import logging
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from btnode.errors import BtnodeError, PeerUnavailable
from btnode.node.launch import spawn_node, start_node, stop_processes
from btnode.rpc.client import SwarmClient
from btnode.rpc.convert import info_from_pb
from btnode.protocol import VersionInfo

log = logging.getLogger(__name__)


@dataclass
class SwarmResult:
    port: int
    versions: dict[int, int] = field(default_factory=dict)  # block → newest version
    history: list[VersionInfo] = field(default_factory=list)
    worker_codes: list[int] = field(default_factory=list)


def run_swarm(*, state_dir: Path, units: list[str], replicas: int, rounds: int, shape_args: list[str],
              aggregator_args: list[str], worker_args: list[str], echo: Callable[[str], None] = print,
              timeout_s: float = 3600.0) -> SwarmResult:
    """Run until every worker has pushed `rounds` updates; returns what was published. `units` names
    each unit the swarm trains, by index (ModelConfig.unit_name)."""
    n_blocks = len(units)
    state_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"
    procs: list[subprocess.Popen] = []
    node = start_node(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
                       *shape_args, *aggregator_args], port_file=state_dir / "aggregator.port",
                      log=logs / "aggregator.log", name="aggregator")
    agg = node.proc
    procs.append(agg)
    try:
        port = node.port
        result = SwarmResult(port=port)
        peer = f"127.0.0.1:{port}"
        echo(f"aggregator on {peer}; starting {n_blocks} × {replicas} workers ({', '.join(units)}) for {rounds} rounds "
             f"(logs in {logs})")
        workers = [spawn_node(["join", "--role", "worker", "--block", str(b), "--peer", peer, "--worker-id", f"b{b}r{r}",
                               "--rounds", str(rounds), "--stats-file", str(logs / f"b{b}r{r}.stats.json"),
                               *shape_args, *worker_args], log=logs / f"worker-b{b}r{r}.log")
                   for b in range(n_blocks) for r in range(replicas)]
        procs.extend(workers)
        client = SwarmClient(peer, timeout_s=10.0)
        seen: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                _report(client, seen, result, echo, units)
                if all(w.poll() is not None for w in workers):
                    _report(client, seen, result, echo, units)
                    break
                if agg.poll() is not None:
                    raise BtnodeError(f"the aggregator exited with code {agg.returncode}; see {logs}/aggregator.log")
                if time.monotonic() > deadline:
                    raise BtnodeError(f"the swarm did not finish within {timeout_s:.0f} s")
                time.sleep(0.5)
        finally:
            client.close()
        result.worker_codes = [w.returncode for w in workers]
        failed = [i for i, c in enumerate(result.worker_codes) if c != 0]
        if failed:
            raise BtnodeError(f"{len(failed)} worker(s) failed; see {logs}")
        return result
    finally:
        stop_processes(procs[::-1], timeout_s=20.0)


def _report(client: SwarmClient, seen: dict[int, int], result: SwarmResult, echo: Callable[[str], None],
            units: list[str]) -> None:
    try:
        status = client.status()
    except PeerUnavailable:
        return
    for bs in status.blocks:
        for r in bs.recent:
            info = info_from_pb(r.version)
            if info.version > seen.get(info.block, 0):
                seen[info.block] = info.version
                result.versions[info.block] = info.version
                result.history.append(info)
                loss = f"{info.mean_loss:.4f}" if not math.isnan(info.mean_loss) else "n/a"
                echo(f"{units[info.block]} round {info.version - 1} → v{info.version}: train CE {loss} "
                     f"({info.accepted} accepted, {info.late} late, {info.stale} stale, {info.rejected} rejected; "
                     f"{info.closed_by})")
