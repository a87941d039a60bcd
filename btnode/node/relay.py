"""Run the relay role (docs/swarm.md, "Relays"): join the parent as a relay, serve children the Swarm
service over a SwarmAggregator built with an UpstreamAdmission, follow the parent's versions (delta or
full pull, hash-checked, stored, re-served), and push each closed round's combined update upstream."""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.manifests import counted_in
from btnode.aggregate.relay.admission import UpstreamAdmission
from btnode.aggregate.relay.forward import Combined, RelayBlock
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import lazy_frames
from btnode.errors import BtnodeError, ConfigError, Forbidden, PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.node.memory import mmap_threshold, return_freed_memory
from btnode.node.metrics import AggregatorCollector, serve_metrics
from btnode.node.aggregator import AggregatorNodeConfig, expire_relay_audits, install_stop_signals, serving, watch_ticks
from btnode.node.settings import ServeConfig
from btnode.rpc.enroll import own_name
from btnode.rpc.security import identity_hint
from btnode.node.systemd import notify
from btnode.node.worker import WorkerNodeConfig
from btnode.protocol import Outcome, PushHeader, VersionInfo
from btnode.rpc import security
from btnode.rpc.certs import check_receipt
from btnode.rpc.failover import FailoverLink, parse_peers
from btnode.rpc.health import NodeHealth
from btnode.rpc.limits import PeerLimits
from btnode.rpc.server import serve
from btnode.settings import flag, same_flag
from btnode.store.files import state_sha256

log = logging.getLogger(__name__)
DUTIES_POLL_S = 2.0  # the children's verification duties fetched at least this often (`_duties`)
AMEND_SAFETY_S = 2.0  # an amendment goes up at least this long before the parent's deadline (or 2 × the last upload)


@dataclass(frozen=True)
class RelayNodeConfig:
    """Where a relay connects and keeps its copy of the versions (local)."""

    peer: str | None = same_flag(WorkerNodeConfig, "peer")  # the parent, then spares: PARENT[,SPARE...]
    relay_id: str | None = flag("--relay-id", "This relay's name at its parent (default HOST-PID-relay).", default=None)
    state_dir: Path | None = same_flag(AggregatorNodeConfig, "state_dir")  # the parent's versions, as served here
    blocks: tuple[int, ...] | None = same_flag(AggregatorNodeConfig, "blocks")  # the blocks it relays (default all)
    margin: float | None = flag("--relay-margin", "Seconds before the parent's round deadline that this relay closes "
                                                  "its children's round and pushes (default a quarter of it).",
                                default=None)


def _fetch(parent: FailoverLink, block: RelayBlock, info: VersionInfo) -> None:
    """Adopt `info`: its delta onto our θ when it builds on it (exactly as a worker adds it), else
    a full pull; each checked against the announced hash before it is stored and served."""
    have, params = block.current()
    if info.version <= have.version:
        return
    if info.base_version == have.version:
        got = parent.fetch_delta(block.block, info.version, block.spec)
        new = {n: params[n] + got.tensors[n] for n in params}
        if state_sha256(new) == info.sha256 == got.info.sha256:
            block.adopt(info, new, raw=got.raw, codec=got.info.delta_codec)
            return
        log.warning("%s v%d: the delta from the parent fails the announced hash; pulling in full", block.name,
                    info.version)
    pulled = parent.pull(block.block, "", block.spec)
    if state_sha256(pulled.tensors) != info.sha256 or pulled.info.sha256 != info.sha256:
        raise PeerUnavailable(f"{block.name} v{info.version}: the parent's pull fails the announced hash")
    block.adopt(pulled.info, pulled.tensors, raw=None, codec=None)


def _follow(parent: FailoverLink, relay: UpstreamAdmission, block: RelayBlock, stop: threading.Event,
            count: Callable[[str, str], None]) -> None:
    """Watch the parent's versions of `block` and adopt each, until `stop`; a broken stream (the
    link has moved to the next parent) or a failed fetch is retried after a second. When the stream
    comes back, join again and re-push the last combined update if the parent is still on its round
    (same update id: a parent that only lost the connection answers as before; a restarted one,
    which lost its open round, judges it again), as a worker does after a reconnect."""
    streams = 0
    while not stop.is_set():
        try:
            # no worker id: a relay is no replica; the parent's round waits on its children (they joined there)
            for i, info in enumerate(parent.watch(block.block, "")):
                if i == 0 and streams:
                    parent.rejoin()
                    _reforward(parent, relay, block.block, info, count)
                _fetch(parent, block, info)
                if stop.is_set():
                    return
        except BtnodeError as exc:
            if stop.is_set():
                return
            log.warning("%s: following the parent: %s; again in 1 s", block.name, exc)
        streams += 1
        stop.wait(1.0)


def _duties(parent: FailoverLink, relay: UpstreamAdmission, stop: threading.Event) -> None:
    """Fetch the children's verification duties (aggregate/relay/duties.py) as soon as the parent's version
    stream says some wait, and every DUTIES_POLL_S besides (a parent without mutual TLS cannot tell this
    relay's stream apart)."""
    blocks = sorted(relay.blocks)
    while not stop.wait(0.05):
        if any([parent.duties_waiting(b, "") for b in blocks]) or \
                time.monotonic() - relay.duties.fetched > DUTIES_POLL_S:
            relay.duties.refresh()


def _reforward(parent: FailoverLink, relay: UpstreamAdmission, block: int, info: VersionInfo,
               count: Callable[[str, str], None]) -> None:
    last = relay.last_forward.get(block)
    if last is None or last[0].base_version != info.version:
        return
    header, c = last
    try:
        j = parent.push(header, lazy_frames(c.delta, Codec.FP32))
    except BtnodeError:
        # counted too: a just-restarted parent may take the update and fail to answer in time (the next
        # stream pushes it again, unless its round closed meanwhile, with the update in it)
        count("repushed", "unanswered")
        raise
    count("repushed", j.outcome.value)  # in Status and /metrics: the parent had lost (or not answered) it
    log.info("block %d round %d: re-pushed the combined update of %d children after reconnecting: %s%s", block,
             c.base_version, len(c.manifest), j.outcome.value, f" ({j.reason})" if j.reason else "")
    if j.audit:  # a restarted parent draws it again (the same update id): it needs the evidence again
        _evidence(parent, relay, header, c)


def _header(c: Combined, name: str) -> PushHeader:
    return PushHeader(worker_id=name, block=c.block, base_version=c.base_version, samples=c.weight, loss=c.loss,
                      codec=Codec.FP32, update_id=uuid.uuid4().hex, manifest=c.manifest)


def _forward(parent: FailoverLink, relay: UpstreamAdmission, c: Combined, give_up: float) -> None:
    """Push one combined update, through outages of the parent until `give_up` (monotonic)."""
    header = _header(c, relay.name)
    relay.last_forward[c.block] = (header, c)
    while True:
        t0 = time.monotonic()
        try:
            j = parent.push(header, lazy_frames(c.delta, Codec.FP32))
            break
        except PeerUnavailable as exc:
            if time.monotonic() > give_up:
                log.error("block %d round %d: the parent stayed unreachable (%s); %d child updates not forwarded",
                          c.block, c.base_version, exc, len(c.manifest))
                return
            time.sleep(0.5)
    level = logging.INFO if j.outcome.in_round else logging.WARNING
    log.log(level, "block %d round %d: combined update of %d children (weight %g) %s at the parent%s", c.block,
            c.base_version, len(c.manifest), c.weight, j.outcome.value, f": {j.reason}" if j.reason else "")
    relay.forwarded[j.outcome.value] = relay.forwarded.get(j.outcome.value, 0) + 1
    block = relay.blocks[c.block]
    if j.closes_in_s > 0:  # amendments go up while they can reach the parent's round: its deadline less an upload
        took = time.monotonic() - t0
        block.parent_closes(c.base_version, block.clock() + j.closes_in_s - max(AMEND_SAFETY_S, 2 * took))
    counted = counted_in(j.reason) if j.outcome is Outcome.REJECTED else frozenset()
    if counted:  # children of a failed relay, counted through it: out, and the rest amended (queued again)
        block.uncount(counted)
    if j.audit:
        _evidence(parent, relay, header, c)


def _latest(relay: UpstreamAdmission, first: Combined) -> list[Combined]:
    """`first` and whatever else is queued, keeping only the newest combined update of each block and
    round: an amendment takes the place of the one before it, so only the last needs to go up."""
    queued = [first]
    while True:
        try:
            queued.append(relay.outbox.get_nowait())
        except queue.Empty:
            break
    newest = {(c.block, c.base_version): c for c in queued}
    return list(newest.values())


def _evidence(parent: FailoverLink, relay: UpstreamAdmission, header: PushHeader, c: Combined) -> None:
    """The parent drew this combined push for a relay audit (aggregate/trust/evidence.py): send it the
    children's frames the round kept, from which it recombines the push bit for bit."""
    block = relay.blocks[c.block]
    try:
        parent.submit_evidence(header, block.unit, relay.evidence(c))
    except BtnodeError as exc:
        log.error("block %d round %d: the evidence of the combined push was refused or not sent: %s", c.block,
                  c.base_version, exc)
        return
    log.info("block %d round %d: sent the evidence of the combined push (%d children) for the parent's audit", c.block,
             c.base_version, len(c.manifest))


def _forwarder(parent: FailoverLink, relay: UpstreamAdmission, deadline_s: float, stop: threading.Event) -> None:
    while not (stop.is_set() and relay.outbox.empty()):
        try:
            c = relay.outbox.get(timeout=0.2)
        except queue.Empty:
            continue
        try:
            for c in _latest(relay, c):
                _forward(parent, relay, c, time.monotonic() + deadline_s)
        except Forbidden as exc:  # revoked at the parent (an operator, or a failed relay audit)
            log.error("the parent refuses this relay (%s): %d child updates not forwarded; stopping, so that the "
                      "children move to their spares", exc, len(c.manifest))
            stop.set()
            return


def run_relay(cfg: ModelConfig, acfg: AggregatorConfig, *, peers: list[str], listen: str, state_dir: Path, name: str,
              margin: float | None = None, blocks: list[int] | None = None, seed: int = 0,
              port_file: Path | None = None, limits: PeerLimits | None = None,
              stop: threading.Event | None = None, metrics_listen: str | None = None) -> None:
    """Serve children until `stop`. Its round deadline is the parent's less `margin` (default a
    quarter), so that the combined push arrives while the parent's round is open."""
    stop = stop or threading.Event()
    return_freed_memory(mmap_threshold("relay", acfg.mmap_threshold_kib))  # 2 arenas; over 4 MiB freed to the kernel (node/memory.py)
    parent = FailoverLink(peers, relay_id=name)  # its streams and passed-on joins name it (docs/relays.md)
    owned = sorted(range(cfg.total_blocks) if blocks is None else blocks)
    joined = None
    deadline = time.monotonic() + 60.0
    while joined is None:
        try:
            joined = [parent.join(name, b, cfg.fingerprint(), json.dumps(cfg.to_dict()), relay=True) for b in owned]
        except PeerUnavailable as exc:
            if time.monotonic() > deadline or stop.is_set():
                raise
            if hint := identity_hint(peers[0]):
                raise ConfigError(hint) from None
            log.info("parent not reachable yet (%s); retrying", exc)
            stop.wait(1.0)
    parent_deadline = joined[0].deadline_s
    own = parent_deadline - (parent_deadline / 4 if margin is None else margin)
    if own <= 0:
        raise ConfigError(f"--relay-margin {margin} leaves no round: the parent's deadline is {parent_deadline:g} s")
    acfg = replace(acfg, round=replace(acfg.round, deadline_s=own, max_staleness=joined[0].max_staleness),
                   update_codecs=tuple(c for c in acfg.update_codecs if c in joined[0].codecs))
    sec = security.current()
    relay = UpstreamAdmission(
        parent, name,
        parent_audits=any(j.relay_audits for j in joined),  # then it keeps its rounds' evidence and takes no child relay
        parent_replays=any(j.audits for j in joined),  # then it commits each child update there first (Draw)
        # under mutual TLS, children's receipts are checked here, as the root will check them
        check_receipt=functools.partial(check_receipt, sec.ca.read_bytes()) if sec.client_auth and sec.ca else None)
    agg = SwarmAggregator(cfg, acfg, state_dir, blocks=owned, seed=seed, upstream=relay)
    if metrics_listen:
        serve_metrics(metrics_listen, AggregatorCollector(agg, role="relay"))
    for b in relay.blocks.values():  # start from the parent's current version (hash-checked by adopt)
        pulled, have = parent.pull(b.block, "", b.spec), b.current()[0]
        if (have.version, have.sha256) != (pulled.info.version, pulled.info.sha256):
            b.adopt(pulled.info, pulled.tensors, raw=None, codec=None)
    health = NodeHealth()
    server, port, server_stop = serve(agg, listen, limits=limits, health=health)
    threads = [threading.Thread(target=_follow, args=(parent, relay, b, stop, agg.count), daemon=True, name=f"follow-{b.block}")
               for b in relay.blocks.values()]
    threads.append(threading.Thread(target=expire_relay_audits, args=(agg, stop), daemon=True, name="relay-audits"))
    if relay.parent_replays:
        threads.append(threading.Thread(target=_duties, args=(parent, relay, stop), daemon=True, name="relay-duties"))
    threads.append(threading.Thread(target=_forwarder, args=(parent, relay, parent_deadline, stop), daemon=True,
                                    name="forwarder"))
    for t in threads:
        t.start()
    log.info("relay %s for blocks %s listening on port %d under %s (round %g s, the parent's %g s%s%s)", name, owned,
             port, parent.address, own, parent_deadline, "; the parent audits relays" if relay.parent_audits else "",
             "; the parent replays updates: each child update is committed there first" if relay.parent_replays else "")
    tickers, alive = serving(agg.blocks, stop, port=port, port_file=port_file, health=health,
                             status=f"relaying blocks {owned} on port {port}")  # a close never gaps the watchdog
    try:
        watch_ticks(tickers, alive, stop)
    finally:
        stop.set()
        notify("STOPPING=1", "STATUS=draining")
        server_stop.set()
        server.stop(grace=5.0).wait()
        tickers.join()
        agg.drain()  # an open round with accepted updates goes upstream before the relay exits
        threads[-1].join(timeout=parent_deadline)
        while not relay.outbox.empty():  # the forwarder may have stopped before the drain queued its round
            try:
                _forward(parent, relay, relay.outbox.get(), time.monotonic() + parent_deadline)
            except Forbidden as exc:
                log.error("the parent refuses this relay (%s): its open round is not forwarded", exc)
                break
        parent.cancel_watches()
        parent.close()
        log.info("relay stopped (forwarded %s; %d child updates missed their round)", relay.forwarded, relay.lost())


def join_relay(model: ModelConfig, aggregate: AggregatorConfig, limits: PeerLimits, serve_cfg: ServeConfig,
               node: RelayNodeConfig) -> None:
    """`btnode join --role relay --peer PARENT[,SPARE]`: relay until SIGTERM/SIGINT."""
    if node.peer is None or node.state_dir is None:
        raise ConfigError("a relay needs --peer (its parent) and --state-dir (its copy of the versions)")
    stop = threading.Event()
    install_stop_signals(stop)
    run_relay(model, aggregate, peers=parse_peers(node.peer), listen=serve_cfg.listen, state_dir=node.state_dir,
              name=node.relay_id or own_name() or f"{socket.gethostname()}-{os.getpid()}-relay", margin=node.margin,
              blocks=list(node.blocks) if node.blocks else None, port_file=serve_cfg.port_file, limits=limits,
              stop=stop, metrics_listen=serve_cfg.metrics_listen)
