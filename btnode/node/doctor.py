"""`btnode doctor`: checks a host before it joins, each finding with a plain-language fix.

Levels: OK, WARN (it will run, but something will hurt), FAIL (it will not work), SKIP (not
asked for: no --peer, no --listen)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from btnode.errors import BtnodeError
from btnode.model.config import ModelConfig
from btnode.node.settings import HostConfig
from btnode.rpc.client import SwarmClient
from btnode.rpc.health import NO_HEALTH, check_health
from btnode.train.plan import unit_bytes

SWARM_SERVICE = "btnode.v2.Worker"  # the aggregator's service for workers, as Health names it (rpc/server.SERVICES)
MAX_SKEW_S = 2.0  # round deadlines are seconds to minutes; skew beyond this confuses logs and τ reasoning


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


def check_peer(cfg: ModelConfig, peer: str | None) -> list[Finding]:
    if not peer:
        return [Finding("peer", "SKIP", "no --peer given"),
                Finding("clock skew", "SKIP", "needs --peer"), Finding("fingerprint", "SKIP", "needs --peer")]
    client = SwarmClient(peer, timeout_s=10)
    try:
        st = client.status_dict()
    except BtnodeError as exc:
        return [Finding("peer", "FAIL", f"cannot reach the aggregator at {peer}: {exc}",
                        "check the address and port, that the aggregator runs (systemctl status btnode-aggregator), "
                        "and that no firewall blocks the port between the hosts"),
                Finding("clock skew", "SKIP", "peer unreachable"), Finding("fingerprint", "SKIP", "peer unreachable")]
    finally:
        client.close()
    out = [Finding("peer", "OK", f"aggregator at {peer} answers in {1e3 * st['rtt_s']:.0f} ms, owning blocks "
                                 f"{[b['block'] for b in st['blocks']]}")]
    skew = st["server_time_unix"] - (st["sent_at_unix"] + st["rtt_s"] / 2)
    if abs(skew) > MAX_SKEW_S:
        out.append(Finding("clock skew", "WARN", f"this host's clock is {-skew:+.1f} s off the aggregator's",
                           "enable time synchronisation on both hosts (timedatectl set-ntp true, or chrony)"))
    else:
        out.append(Finding("clock skew", "OK", f"{-skew:+.3f} s against the aggregator (±{st['rtt_s'] / 2:.3f} s)"))
    if st["fingerprint"] == cfg.fingerprint():
        out.append(Finding("fingerprint", "OK", f"run fingerprint matches the swarm's ({cfg.fingerprint()[:12]}…)"))
    else:
        try:
            theirs = ModelConfig.from_dict(st["config"])
            diff = ", ".join(f"{k}: swarm {t!r}, here {o!r}" for k, o, t in cfg.diff(theirs)) or "fingerprint version"
        except (BtnodeError, TypeError, ValueError, KeyError):
            diff = "the swarm's settings could not be read"
        out.append(Finding("fingerprint", "FAIL", f"this host's swarm-wide settings differ from the swarm's ({diff})",
                           "use the swarm's model settings ([model] in btnode.toml, or the --d-model/--blocks/... "
                           "flags); `btnode status --peer` shows them"))
    return out


def check_health_of(peer: str | None) -> Finding:
    """The peer's gRPC Health for the node as a whole and for btnode.v2.Worker (what a probe sees)."""
    if not peer:
        return Finding("health", "SKIP", "needs --peer")
    try:
        overall, swarm = check_health(peer, "", timeout_s=10), check_health(peer, SWARM_SERVICE, timeout_s=10)
    except BtnodeError as exc:
        return Finding("health", "FAIL", f"no health answer from {peer}: {exc}",
                       "check the address and port, and that the aggregator runs (systemctl status btnode-aggregator)")
    detail = f'grpc.health.v1 at {peer}: "" {overall}, {SWARM_SERVICE} {swarm}'
    if overall == NO_HEALTH:
        return Finding("health", "WARN", f"{peer} has no grpc.health.v1 service",
                       "upgrade btnode on the aggregator host; probes and load balancers need it")
    if swarm == "SERVING":
        return Finding("health", "OK", detail)
    if swarm == "NOT_SERVING":
        return Finding("health", "FAIL", f"{detail}: the aggregator is starting or draining (stopping)",
                       "wait until it has started, or start it again if it was stopped "
                       "(systemctl status btnode-aggregator; journalctl -u btnode-aggregator)")
    return Finding("health", "FAIL", f"{detail}: {peer} is not an aggregator (a stage answers btnode.v2.Serving)",
                   "point --peer at the aggregator's --listen address, not a stage's")


def check_listen(listen: str | None) -> Finding:
    if not listen:
        return Finding("port", "SKIP", "no --listen given (a worker needs no open port)")
    host, _, port = listen.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]") or "0.0.0.0", int(port)))
    except (OSError, ValueError) as exc:
        return Finding("port", "FAIL", f"cannot bind {listen}: {exc}",
                       "another process holds the port (see `ss -ltnp`), or the address is not on this host; "
                       "stop that process or choose another --listen")
    return Finding("port", "OK", f"{listen} can be bound")


def check_disk(cfg: ModelConfig, state_dir: Path, keep: int = 3) -> Finding:
    where = state_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    usage = shutil.disk_usage(where)
    # an aggregator keeps `keep` versions per unit, each the parameters, the published delta and
    # the outer state (≈ 3 × the unit in fp32); double it for the temporary files of a write
    need = 2 * keep * 3 * unit_bytes(cfg)["fp32"]
    detail = f"{usage.free / 2**30:.1f} GiB free under {where} (a full aggregator needs about {need / 2**20:.0f} MiB)"
    if usage.free < need:
        return Finding("disk", "FAIL", detail, "free space there, or point --state-dir at a larger disk")
    if usage.free < 10 * need:
        return Finding("disk", "WARN", detail, "little headroom: free space or move --state-dir before long runs")
    return Finding("disk", "OK", detail)


def check_data(cfg: ModelConfig, host: HostConfig) -> Finding:
    """The --data a worker would train on opens (a dataset's shards present with their listed sizes,
    a URL's manifest fetched) and its training split holds at least one window."""
    try:
        data = host.load_corpus()
    except BtnodeError as exc:
        return Finding("data", "FAIL", str(exc), "point --data at a prepared dataset (its folder or URL), a WikiText "
                                                 "folder or a file; re-copy a dataset whose shards do not match "
                                                 "its manifest.json")
    if len(data.train) < cfg.context + 1:
        return Finding("data", "FAIL", f"{data.train.description} has {len(data.train)} bytes; a window needs "
                                       f"{cfg.context + 1}", "use a larger training corpus")
    return Finding("data", "OK", data.source)


def check_torch(device: str) -> list[Finding]:
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    out = []
    if threads > cores:
        out.append(Finding("torch threads", "WARN", f"torch uses {threads} threads on {cores} cores",
                           f"set OMP_NUM_THREADS={cores} (or fewer when several nodes share the host)"))
    else:
        out.append(Finding("torch threads", "OK", f"torch {torch.__version__}: {threads} threads on {cores} cores"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            out.append(Finding("device", "FAIL", f"--device {device} but CUDA is not available to torch",
                               "install the CUDA build of torch and the NVIDIA driver, or use --device cpu"))
        else:
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            out.append(Finding("device", "OK", f"CUDA devices: {json.dumps(names)}"))
    else:
        gpu = "a CUDA device is available (use --device cuda)" if torch.cuda.is_available() else "no CUDA device"
        out.append(Finding("device", "OK", f"training on the CPU; {gpu}"))
    return out


def run_checks(cfg: ModelConfig, *, peer: str | None, listen: str | None, state_dir: Path,
               host: HostConfig) -> list[Finding]:
    return [*check_peer(cfg, peer), check_health_of(peer), check_listen(listen), check_disk(cfg, state_dir),
            check_data(cfg, host), *check_torch(host.device)]
