"""Prometheus `/metrics` for every role (design §5, issue #6).

Nothing in the domain code knows about Prometheus: the aggregator, the worker and the stage keep
plain counters (their own counters and `protocol.Meter`s), and a collector here turns them into
metric families at scrape time. Naming follows the Prometheus conventions: the `btnode_` prefix,
base units (seconds, bytes), `_total` on counters, and low-cardinality labels (block, outcome,
reason, closed_by, direction, form, chain).

Durations are summaries (a `_count` and a `_sum`): `rate(x_sum[5m]) / rate(x_count[5m])` is the
mean over the window. Histograms would give quantiles too; they are not needed yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from btnode.aggregate.trust.audit import AuditTotals
from btnode.aggregate.trust.delegate import DelegatedReplays
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import IdentityRecord
from btnode.errors import ConfigError
from btnode.node.api_metrics import ApiCollector, Family, build_info  # noqa: F401 - re-exported
from btnode.protocol import Meter, Outcome
from btnode.swarm.worker import WorkerStats

log = logging.getLogger(__name__)


def transfer_families(counts: dict[tuple[str, ...], float]) -> Family:
    fam = CounterMetricFamily("btnode_transfer_bytes", "Tensor bytes moved, by direction and form: raw is the "
                              "codec's bytes before zstd, wire the compressed payload.", labels=["direction", "form"])
    for direction in ("sent", "received"):
        for form in ("raw", "wire"):
            fam.add_metric([direction, form], counts.get((direction, form), 0))
    return fam


def duration_family(name: str, doc: str, durations: dict[str, tuple[int, float]], label: str,
                    keys: tuple[str, ...]) -> Family:
    fam = SummaryMetricFamily(name, doc, labels=[label])
    for k in keys:
        count, total = durations.get(k, (0, 0.0))
        fam.add_metric([k], count_value=count, sum_value=total)
    return fam


class AggregatorCollector(Collector):
    def __init__(self, agg: SwarmAggregator, role: str = "aggregator"):
        self.agg = agg
        self.role = role  # "relay" for a relay's (node/relay.py): the same families, its own children's rounds

    def collect(self) -> Iterator[Family]:
        yield build_info(self.role)
        version = GaugeMetricFamily("btnode_block_version", "Newest published version per block.", labels=["block"])
        replicas = GaugeMetricFamily("btnode_block_replicas", "Registered replicas per block.", labels=["block"])
        loss = GaugeMetricFamily("btnode_block_train_loss", "Mean training CE (nats/byte) reported by the updates "
                                 "of the block's last round.", labels=["block"])
        age = GaugeMetricFamily("btnode_round_age_seconds", "Seconds since the open round's clock started.",
                                labels=["block"])
        accepted_open = GaugeMetricFamily("btnode_round_accepted_updates", "Updates accepted so far in the open "
                                          "round.", labels=["block"])
        rounds = CounterMetricFamily("btnode_rounds", "Rounds closed, by what closed them.", labels=["block", "closed_by"])
        updates = CounterMetricFamily("btnode_updates", "Pushed updates by the answer on arrival (pending, probation, "
                                      "late, stale, rejected) and, once their round closed, by their receipt (applied, "
                                      "dropped), with the reason.", labels=["block", "outcome", "reason"])
        status = self.agg.status()
        for s in status.blocks:
            lb = str(s.block)
            version.add_metric([lb], s.current.version)
            replicas.add_metric([lb], len(s.replicas))
            if s.recent:
                loss.add_metric([lb], s.recent[-1].info.mean_loss)
            age.add_metric([lb], max(0.0, s.round_age_s))
            accepted_open.add_metric([lb], s.accepted_in_round)
            for reason in ("deadline", "all_reported", "drain"):
                rounds.add_metric([lb, reason], s.rounds_closed.get(reason, 0))
            for outcome in (o.value for o in Outcome):  # present from the start, at 0
                if not any(o == outcome for o, _ in s.updates):
                    updates.add_metric([lb, outcome, "none"], 0)
            for (outcome, reason), n in sorted(s.updates.items()):
                updates.add_metric([lb, outcome, reason or "none"], n)
        yield from (version, replicas, loss, age, accepted_open, rounds, updates)
        yield from identity_families(status.identities)
        events = CounterMetricFamily("btnode_swarm_events", "Swarm-wide events outside one block (joins, refused "
                                     "joins, pushes for unknown blocks), by reason.", labels=["event", "reason"])
        for (name, reason), n in sorted(status.events.items()):
            events.add_metric([name, reason or "none"], n)
        yield events
        counts, durations = self.agg.meter.snapshot()
        yield transfer_families(counts)
        yield duration_family("btnode_rpc_duration_seconds", "Time to serve a push (receive, validate, judge), a "
                              "full pull, a delta fetch or a start state for an audit.", durations, "call",
                              ("push", "pull", "fetch_delta", "submit_state"))
        if self.agg.audits is not None:
            yield from audit_families(self.agg.audits.totals())
        if self.agg.delegated is not None:
            yield from delegation_families(self.agg.delegated)


def identity_families(records: tuple[IdentityRecord, ...]) -> Iterator[Family]:
    """Drops per identity without a label per identity (an open swarm's names are unbounded): how many
    identities the screen dropped updates of, and the most of one; `btnode status` names them."""
    drops = [r.screened_out for r in records]
    dropped = GaugeMetricFamily("btnode_identities_dropped", "Identities with at least one update dropped by the "
                                "robust screen at a round's close (btnode status names them).",
                                value=sum(1 for n in drops if n))
    most = GaugeMetricFamily("btnode_identity_drops_max", "The most updates of one identity dropped by the robust "
                             "screen at a round's close.", value=max(drops, default=0))
    yield from (dropped, most)


def delegation_families(d: DelegatedReplays) -> Iterator[Family]:
    """Delegated verification (aggregate/trust/delegate.py): what went to workers, what the aggregator kept."""
    events = CounterMetricFamily("btnode_verification_events", "Delegated verification: tasks handed to workers, "
                                 "redundant and spot-checked ones, disputes, rechecks, and audits replayed by the "
                                 "aggregator itself (local).", labels=["event"])
    counts = dict(d.counts)
    for name in ("tasks", "redundant", "spot", "disputes", "rechecks", "local", "reassigned", "local_after_dispute"):
        events.add_metric([name], counts.get(name, 0))
    verifiers = CounterMetricFamily("btnode_verifier_seconds", "Replay time workers attested doing for others "
                                    "(their verified work).")
    verifiers.add_metric([], sum(d.work.values()))
    referee = CounterMetricFamily("btnode_referee_seconds", "The aggregator's own compute on disputes (one step or "
                                  "one encode each).")
    referee.add_metric([], d.referee_seconds)
    yield from (events, verifiers, referee)


def audit_families(t: AuditTotals) -> Iterator[Family]:
    """Replay audits (aggregate/trust/audit.py): verdicts, their compute, how long a cheat went unseen."""
    audits = CounterMetricFamily("btnode_audits", "Replay audits by result (passed, failed) and reason (why one "
                                 "failed: delta, state, late_state, ...).", labels=["result", "reason"])
    for result in ("passed", "failed"):  # present from the start, at 0
        if not any(r == result for r, _ in t.counts):
            audits.add_metric([result, "none"], 0)
    for (result, reason), n in sorted(t.counts.items()):
        audits.add_metric([result, reason or "none"], n)
    cpu = CounterMetricFamily("btnode_audit_seconds", "Wall time spent replaying updates (the auditor's cost).")
    cpu.add_metric([], t.seconds)
    delay = SummaryMetricFamily("btnode_audit_detection_delay_seconds", "Seconds from the push of an update to "
                                "its failed audit.", count_value=t.detections, sum_value=t.detection_seconds)
    waiting = GaugeMetricFamily("btnode_audits_waiting", "Audits waiting for their update's start state.",
                                value=t.waiting)
    yield from (audits, cpu, delay, waiting)


class WorkerCollector(Collector):
    def __init__(self, block: int, stats: Callable[[], WorkerStats | None]):
        self.block = block
        self.stats = stats  # the running worker's stats (it is rebuilt when it reconnects)

    def collect(self) -> Iterator[Family]:
        yield build_info("worker")
        s = self.stats()
        if s is None:
            return
        lb = [str(self.block)]
        pushes = CounterMetricFamily("btnode_worker_pushes", "Updates pushed, by the aggregator's answer.",
                                     labels=["block", "outcome"])
        for outcome in (o.value for o in Outcome):
            pushes.add_metric([*lb, outcome], s.outcomes.get(outcome, 0))
        yield pushes
        version = GaugeMetricFamily("btnode_worker_version", "The block version this worker holds.", labels=["block"])
        version.add_metric(lb, s.version)
        steps = CounterMetricFamily("btnode_worker_steps", "Local training steps.", labels=["block"])
        steps.add_metric(lb, s.steps)
        wait_steps = CounterMetricFamily("btnode_worker_wait_steps", "Local steps trained while waiting for a "
                                         "version (folded into the next update).", labels=["block"])
        wait_steps.add_metric(lb, s.wait_steps)
        train = CounterMetricFamily("btnode_worker_train_seconds", "Wall time spent inside training steps.",
                                    labels=["block"])
        train.add_metric(lb, s.train_seconds)
        wall = time.perf_counter() - s.started
        util = GaugeMetricFamily("btnode_worker_utilisation_ratio", "Training time ÷ wall time since the worker "
                                 "started (rate(train_seconds) gives it over a window).", labels=["block"])
        util.add_metric(lb, s.train_seconds / wall if wall > 0 else 0.0)
        retries = CounterMetricFamily("btnode_worker_retries", "Calls tried again: refused for now by the "
                                      "aggregator (over a limit) or through an outage.", labels=["block"])
        retries.add_metric(lb, s.retries)
        reconnects = CounterMetricFamily("btnode_worker_reconnects", "Version streams opened again after one broke "
                                         "or was refused.", labels=["block"])
        reconnects.add_metric(lb, s.reconnects)
        repushes = CounterMetricFamily("btnode_worker_repushes", "Updates pushed again after a version stream "
                                       "reconnected (the aggregator may have restarted), by its answer.",
                                       labels=["block", "outcome"])
        for outcome in (o.value for o in Outcome):  # present from the start, at 0
            repushes.add_metric([*lb, outcome], s.repushes.get(outcome, 0))
        receipts = CounterMetricFamily("btnode_worker_receipts", "Round receipts of this worker's updates: applied, "
                                       "or dropped at the round's close, by the aggregator's reason.",
                                       labels=["block", "outcome", "reason"])
        receipts.add_metric([*lb, Outcome.APPLIED.value, "none"], s.applied)
        for reason, n in sorted(s.dropped.items()):
            receipts.add_metric([*lb, Outcome.DROPPED.value, reason or "none"], n)
        yield from (version, steps, wait_steps, train, util, retries, reconnects, repushes, receipts)
        if s.losses:
            loss = GaugeMetricFamily("btnode_worker_train_loss", "Mean training CE (nats/byte) of the last pushed "
                                     "update.", labels=["block"])
            loss.add_metric(lb, s.losses[-1])
            yield loss
        yield transfer_families({("sent", "raw"): s.bytes_pushed_raw, ("sent", "wire"): s.bytes_pushed_wire,
                                 ("received", "raw"): s.bytes_pulled_raw, ("received", "wire"): s.bytes_pulled_wire})
        pulls = s.full_pulls + s.delta_fetches
        yield duration_family("btnode_worker_rpc_duration_seconds", "Time a push (until its answer) or a pull "
                              "took, seen by the worker.", {"push": (s.pushes, s.push_seconds),
                                                            "pull": (pulls, s.pull_seconds)}, "call", ("push", "pull"))


class StageCollector(Collector):
    def __init__(self, chain: str, meter: Meter):
        self.chain = chain
        self.meter = meter

    def collect(self) -> Iterator[Family]:
        yield build_info("stage")
        counts, durations = self.meter.snapshot()
        c = self.chain
        requests = CounterMetricFamily("btnode_serve_requests", "Generation requests that entered the chain "
                                       "here, by outcome.", labels=["chain", "outcome"])
        for outcome in ("ok", "error", "cancelled"):
            requests.add_metric([c, outcome], counts.get(("request", c, outcome), 0))
        generated = CounterMetricFamily("btnode_serve_generated_bytes", "Bytes generated for requests that "
                                        "entered here (rate() of it is the served bytes/s).", labels=["chain"])
        generated.add_metric([c], counts.get(("generated_bytes", c), 0))
        traversals = CounterMetricFamily("btnode_serve_traversals", "Traversals the chain's entry sent "
                                         "(each carrying the segments of every request waiting).", labels=["chain"])
        batched = CounterMetricFamily("btnode_serve_batched_segments", "Segments those traversals carried "
                                      "(÷ traversals: the mean batch).", labels=["chain"])
        traversals.add_metric([c], counts.get(("traversals", c), 0))
        batched.add_metric([c], counts.get(("batched_segments", c), 0))
        yield from (requests, generated, traversals, batched)
        yield duration_family("btnode_serve_duration_seconds", "Latency of whole requests (entry stage) and of "
                              "one stage's forward step.", durations, "call", ("request", "forward"))


def serve_metrics(address: str, collector: Collector) -> int:
    """Serve /metrics for `collector` on HOST:PORT (port 0 picks one); returns the bound port."""
    host, _, port = address.rpartition(":")
    try:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(collector)
        server, _ = start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot serve metrics on {address!r}: {exc}") from None
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
    return int(bound)
