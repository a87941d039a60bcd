"""Run the aggregator role: serve the swarm RPCs, close rounds on time, stop cleanly on a signal.
`join_aggregator` is the role as `btnode join --role aggregator` runs it, from its configs.

Each block's deadline is checked, and its round closed, by that block's own ticker thread; the main
loop only watches them and feeds the watchdog. A close of minutes (a robust rule over many updates)
thus neither gaps systemd's keep-alives nor delays another block's close; a tick that runs long is
logged (STALL_WARN_S), and a main loop that hangs still stops the keep-alives."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from pathlib import Path

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.data.source import ByteSource
from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.node.memory import mmap_threshold, return_freed_memory
from btnode.node.metrics import AggregatorCollector, serve_metrics
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.systemd import notify, start_watchdog
from btnode.rpc.health import NodeHealth
from btnode.rpc import security
from btnode.rpc.enroll import SwarmAuthority, serve_enrollment
from btnode.rpc.limits import PeerLimits
from btnode.rpc.server import serve
from btnode.settings import flag, join_ints, parse_ints, same_flag
from btnode.durable import atomic_write
from btnode.train.config import TrainConfig

log = logging.getLogger(__name__)
TICK_S = 0.05  # how often deadlines are checked
AUDIT_TICK_S = 0.2  # how often the auditor looks for audits to run
STALL_WARN_S = 10.0  # a block's tick (its round's close) running longer is logged, and again every as long


class Tickable(Protocol):
    def tick(self) -> object: ...


class BlockTickers:
    """One thread per block calling its `tick()` every TICK_S until `stop`; `busy()` says which tick has
    run how long, read without taking any block's lock."""

    def __init__(self, blocks: Mapping[int, Tickable], stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic):
        self.blocks, self.stop, self.clock = blocks, stop, clock
        self._since: dict[int, float | None] = dict.fromkeys(blocks)  # block → when its tick began (None: idle)
        self.threads = [threading.Thread(target=self._loop, args=(b,), name=f"tick-{b}", daemon=True) for b in blocks]

    def start(self) -> BlockTickers:
        for t in self.threads:
            t.start()
        return self

    def _loop(self, b: int) -> None:
        while not self.stop.is_set():
            self._since[b] = self.clock()
            try:
                self.blocks[b].tick()
            except Exception:  # noqa: BLE001 - a failed close is logged; the block keeps its open round
                log.exception("block %d: tick failed", b)
            finally:
                self._since[b] = None
            self.stop.wait(TICK_S)

    def busy(self) -> dict[int, float]:
        """Block → seconds its tick in progress has run."""
        now = self.clock()
        return {b: now - t for b, t in list(self._since.items()) if t is not None}

    def join(self) -> None:
        for t in self.threads:
            t.join()


def watch_ticks(tickers: BlockTickers, alive: threading.Event, stop: threading.Event, *,
                warn_after_s: float = STALL_WARN_S) -> None:
    """The main loop: feed the watchdog (`alive`) and log a tick that runs long, until `stop`."""
    warned: dict[int, float] = {}  # block → the run time last logged
    while not stop.is_set():
        alive.set()
        busy = tickers.busy()
        for b, ran in busy.items():
            if ran >= warned.get(b, 0.0) + warn_after_s:
                warned[b] = ran
                log.warning("block %d: its tick (a round's close) has run for %.0f s; the other blocks and the "
                            "watchdog's keep-alives go on", b, ran)
        for b in set(warned) - set(busy):
            del warned[b]
        stop.wait(TICK_S)


def serving(blocks: Mapping[int, Tickable], stop: threading.Event, *, port: int, port_file: Path | None,
            health: NodeHealth, status: str) -> tuple[BlockTickers, threading.Event]:
    """Once the server is up (an aggregator's or a relay's): write the port file, say SERVING and
    READY=1, start the watchdog and the blocks' tickers; returns them and the watchdog's event."""
    if port_file is not None:
        atomic_write(port_file, f"{port}\n".encode())
    health.serving()
    notify("READY=1", f"STATUS={status}")
    alive = threading.Event()
    start_watchdog(alive, stop)
    return BlockTickers(blocks, stop).start(), alive


@dataclass(frozen=True)
class AggregatorNodeConfig:
    """Where an aggregator keeps its versions and what it owns (local)."""

    state_dir: Path | None = flag("--state-dir", "Where versions are stored.", default=None)
    blocks: tuple[int, ...] | None = flag("--blocks-owned", "Comma-separated blocks to own (default all).",
                                          default=None, param="own_blocks", value=str,
                                          parse=lambda t: parse_ints(t, "--blocks-owned"), format=join_ints)
    seed: int = same_flag(TrainConfig, "seed")  # initialises the units' version 0
    identities: bool = flag("--identities/--no-identities",
                            "Admit identities, not token holders: the aggregator makes the swarm's CA in --state-dir at "
                            "its first start, every node enrolls with a single-use join code (`btnode codes mint`) and "
                            "every call needs its certificate (mutual TLS). --no-identities: any token holder may join "
                            "under any worker id (benches, closed lab networks). docs/security.md.", default=True)
    enroll_listen: str | None = flag("--enroll-listen", "HOST:PORT of the enrollment port, the one port that takes "
                                                        "calls without a certificate (join codes only). Default: "
                                                        "--listen's host, its port + 1 (port 0: any).", default=None)
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
                   stop: threading.Event | None = None, drain_notice_s: float = 0.0, data_id: str | None = None,
                   corpus: ByteSource | bytes | None = None, authority: SwarmAuthority | None = None,
                   enroll_listen: str | None = None) -> None:
    """Serve until `stop`; with an `authority` (identities by default) its enrollment port too; gRPC Health says NOT_SERVING until READY=1, SERVING, then NOT_SERVING for
    `drain_notice_s` (still taking calls) before the server stops accepting and the rounds drain.
    With audits on (`acfg.audit`), an auditor thread replays on `corpus`, the workers' training data."""
    stop = stop or threading.Event()
    return_freed_memory(mmap_threshold("aggregator", acfg.mmap_threshold_kib))  # a close's temporaries leave RSS (node/memory.py)
    agg = SwarmAggregator(cfg, acfg, state_dir, blocks=blocks, seed=seed, data_id=data_id, corpus=corpus)
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
    enrollment = _start_enrollment(agg, authority, enroll_listen or _enroll_address(listen, port), state_dir) \
        if authority is not None else None
    auditor = _start_auditor(agg, stop) if agg.audits is not None else None
    if agg.relay_audits is not None:
        r = acfg.relay_audit
        log.info("relay audits: rate %g, evidence within %g s", r.rate, r.timeout_s)
        threading.Thread(target=expire_relay_audits, args=(agg, stop), daemon=True, name="relay-audits").start()
    tickers, alive = serving(agg.blocks, stop, port=port, port_file=port_file, health=health,
                             status=f"serving blocks {sorted(agg.blocks)} on port {port}")
    try:
        watch_ticks(tickers, alive, stop)
    finally:
        stop.set()  # (already set, unless the main loop failed): the tickers end after their tick
        notify("STOPPING=1", "STATUS=draining")
        health.draining(drain_notice_s)
        server_stop.set()
        server.stop(grace=5.0).wait()  # in-flight pushes finish (and are judged) first
        if enrollment is not None:
            enrollment.stop(grace=1.0).wait()
        if auditor is not None:
            auditor.join()  # it saw `stop`: at most the replay in progress finishes
        tickers.join()  # they saw `stop`: at most a close in progress finishes
        for info in agg.drain():
            log.info("drain: block %d published version %d with the round's accepted updates", info.block,
                     info.version)
        log.info("aggregator stopped")


def _enroll_address(listen: str, port: int) -> str:
    host, _, asked = listen.rpartition(":")
    return f"{host}:{0 if asked == '0' else port + 1}"


def _start_enrollment(agg: SwarmAggregator, authority: SwarmAuthority, address: str, state_dir: Path) -> Any:
    server, port = serve_enrollment(authority, address, open_swarm=agg.acfg.open, count=agg.count)
    log.info("identities: every call needs a certificate of this swarm's CA (pin %s); nodes enroll with join codes "
             "on port %d (`btnode codes mint --state-dir %s`); this host's operator identity: --identity %s",
             authority.pin, port, state_dir, authority.operator)
    return server


def expire_relay_audits(agg: SwarmAggregator, stop: threading.Event) -> None:
    """Fail the relay audits whose evidence is late (aggregate/trust/evidence.py), once a second, until `stop`."""
    while not stop.wait(1.0):
        try:
            agg.expire_relay_audits()
        except Exception:  # noqa: BLE001 - a bug here must not take the node down
            log.exception("relay audits: expiring late evidence failed")


def _start_auditor(agg: SwarmAggregator, stop: threading.Event) -> threading.Thread:
    """Replay audits as their states come in, off the RPC threads, until `stop`. A round of audits
    that fails unexpectedly is logged and the aggregator keeps serving (an auditor bug is not a reason
    to stop the swarm; the jobs it had taken are lost, and their held updates miss their round)."""
    a = agg.acfg.audit
    log.info("audits: p=%g, probation %d audits, start states within %g s", a.share, a.probation, a.state_timeout_s)

    def loop() -> None:
        while not stop.wait(AUDIT_TICK_S):
            try:
                agg.run_audits()
            except Exception:  # noqa: BLE001 - an auditor bug must not take the aggregator down
                log.exception("auditor: a round of audits failed")

    thread = threading.Thread(target=loop, name="auditor", daemon=True)
    thread.start()
    return thread


def join_aggregator(model: ModelConfig, aggregate: AggregatorConfig, limits: PeerLimits, serve: ServeConfig,
                    node: AggregatorNodeConfig, host: HostConfig) -> None:
    """`btnode join --role aggregator`: serve until SIGTERM/SIGINT. With --audit it loads --data (the
    workers' data, which replays train on), and that data's id is the one workers must state."""
    if node.state_dir is None:
        raise ConfigError("the aggregator needs --state-dir")
    authority = _identities(node, serve.listen)
    data_id, corpus = node.data_id, None
    if aggregate.audit.on:
        data = host.load_corpus()
        if data_id is not None and data_id != data.ident:
            raise ConfigError(f"--data-id {data_id} is not the id of --data ({data.ident}), which audits replay on")
        data_id, corpus = data.ident, data.train
        log.info("audits replay on %s (data id %s)", data.train.description, data.ident)
    stop = threading.Event()
    install_stop_signals(stop)
    run_aggregator(model, aggregate, state_dir=node.state_dir, listen=serve.listen, seed=node.seed,
                   port_file=serve.port_file, stop=stop, metrics_listen=serve.metrics_listen,
                   drain_notice_s=serve.drain_notice, limits=limits, blocks=list(node.blocks) if node.blocks else None,
                   data_id=data_id, corpus=corpus, authority=authority, enroll_listen=node.enroll_listen)


def _identities(node: AggregatorNodeConfig, listen: str) -> SwarmAuthority | None:
    """The swarm's authority when identities are on and no TLS was configured by hand (then this
    node's settings become its certificates: security.configure); None otherwise."""
    sec = security.current()
    if not node.identities:
        log.warning("--no-identities: any holder of the swarm token%s may join under any worker id, and one "
                    "holder under many", "" if sec.token else " (there is none: anyone)")
        return None
    if sec.tls:
        if not sec.client_auth:
            log.warning("TLS without --tls-client-auth: worker ids are claims, not identities (docs/security.md)")
        return None  # the operator's own CA and certificates (btnode ca init / admit)
    assert node.state_dir is not None
    host = listen.rpartition(":")[0].strip("[]")
    authority = SwarmAuthority.create(node.state_dir, hosts=(host,) if host not in ("", "0.0.0.0", "::") else ())
    security.configure(authority.security(token=sec.token))
    return authority
