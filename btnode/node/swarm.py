"""`btnode swarm`: a whole swarm on this machine: one aggregator and B × R workers (or, in a
DiLoCo run, R full-replica workers of the one AR unit), each its own process on loopback, started
through the real CLI, their argv derived from the configs they are to run (node/roles.py). Prints
the CE each unit's accepted updates reported, per round, as versions are published."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from btnode.aggregate.round.config import AggregatorConfig
from btnode.errors import BtnodeError, InputError, PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.node.aggregator import AggregatorNodeConfig
from btnode.node.launch import spawn_node, start_node, stop_processes
from btnode.node.roles import ROLES
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.worker import WorkerNodeConfig
from btnode.rpc import security
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, enrolled, identity_security
from btnode.rpc.convert import info_from_pb
from btnode.protocol import VersionInfo
from btnode.rpc.limits import PeerLimits
from btnode.settings import flag
from btnode.swarm.worker import WorkerConfig
from btnode.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class SwarmResult:
    port: int
    versions: dict[int, int] = field(default_factory=dict)  # block → newest version
    history: list[VersionInfo] = field(default_factory=list)
    worker_codes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SwarmConfig:
    """The shape of a local swarm (local)."""

    replicas: int = flag("--replicas", "R: workers per block.", default=2)
    threads: int = flag("--threads", "Torch threads per worker.", default=1)


def run_swarm(model: ModelConfig, aggregate: AggregatorConfig, node: AggregatorNodeConfig, train: TrainConfig,
              worker: WorkerConfig, swarm: SwarmConfig, host: HostConfig = HostConfig(), *,
              echo: Callable[[str], None] = print, timeout_s: float = 3600.0) -> SwarmResult:
    """Run until every worker has pushed `worker.rounds` updates; returns what was published. The
    aggregator runs `aggregate` in `node.state_dir`; each worker runs `train` and `worker` with its
    unit and name filled in, and trains on `host`'s data (which the aggregator's audits replay on)."""
    if node.state_dir is None or worker.rounds is None:
        raise BtnodeError("a local swarm needs a state folder and a number of rounds")
    state_dir, rounds, replicas = node.state_dir, worker.rounds, swarm.replicas
    units = [model.unit_name(b) for b in range(model.total_blocks)]
    env = {"OMP_NUM_THREADS": str(swarm.threads), **os.environ}  # unless the caller set it
    state_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"
    procs: list[subprocess.Popen] = []
    serve = ServeConfig(listen="127.0.0.1:0")  # start_node adds --port-file
    started = start_node(ROLES["aggregator"].argv("aggregator", model, aggregate, PeerLimits(), serve, node, host),
                         port_file=state_dir / "aggregator.port", log=logs / "aggregator.log", env=env, name="aggregator")
    agg = started.proc
    procs.append(agg)
    try:
        port = started.port
        result = SwarmResult(port=port)
        peer = f"127.0.0.1:{port}"
        echo(f"aggregator on {peer}; starting {len(units)} × {replicas} workers ({', '.join(units)}) for {rounds} rounds "
             f"on {host.data or 'the bundled WikiText-2'} (logs in {logs})")
        authority = SwarmAuthority(state_dir) if node.identities and not security.current().tls else None
        workers = [spawn_node(ROLES["worker"].argv("worker", model, train,
                                                   replace(worker, block=b, worker_id="" if authority else f"b{b}r{r}"),
                                                   WorkerNodeConfig(peer=peer, stats_file=logs / f"b{b}r{r}.stats.json"),
                                                   host),
                              log=logs / f"worker-b{b}r{r}.log",
                              env={**env, **(enrolled_env(authority, state_dir / "identities", f"b{b}r{r}")
                                             if authority else {})})
                   for b in range(len(units)) for r in range(replicas)]
        procs.extend(workers)
        client = SwarmClient(peer, timeout_s=10.0,
                             security=identity_security(authority.operator) if authority else None)
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


def enrolled_env(authority: SwarmAuthority, folder: Path, name: str) -> dict[str, str]:
    """The environment of a local node that is (or becomes, with a code minted now) identity `name`,
    kept in folder/name: as an operator gives each node its code."""
    home = folder / name
    if enrolled(home):
        return {"BTNODE_IDENTITY": str(home)}
    try:
        code, _ = authority.mint(name=name, host="127.0.0.1")
    except InputError:  # the name had a code whose identity folder is gone: a new name
        code, _ = authority.mint(host="127.0.0.1")
    return {"BTNODE_IDENTITY": str(home), "BTNODE_JOIN_CODE": str(code)}


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
