"""Replay audits through a relay (docs/security.md, "Replay audits through relays"): a root that replays
audits, a relay run by node/relay.run_relay (its follower and forwarder threads, its own round
deadline), both behind real gRPC servers in this process, and real BlockWorkers pushing to the relay.
The relay commits each child update at the root before it counts it (Draw); one the root draws goes up
as it came and its start state after it; the others go up combined, each entry with the root's token."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.errors import PeerUnavailable
from btnode.node.relay import run_relay
from btnode.rpc.client import SwarmClient
from btnode.rpc.server import serve
from btnode.swarm.worker import BlockWorker, WorkerConfig
from lab.cheats import NegatedWorker
from lab.fuzz import CFG
from btnode.train.config import TrainConfig

from test_audit_rpc import until

CORPUS = bytes(range(256)) * 16
TRAIN = TrainConfig(batch=4, warmup=1, steps=100)
CLAIMS = ClaimConfig.of(TRAIN, steps_per_round=2)


def _tree(tmp_path: Path, share: float, probation: int):
    """(root aggregator, the relay's address); root and relay torn down after the test."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=20.0), audit=AuditConfig(share=share, probation=probation),
                            claims=CLAIMS)
    root = SwarmAggregator(CFG, acfg, tmp_path / "root", corpus=CORPUS, blocks=[0])
    server, port, server_stop = serve(root, "127.0.0.1:0")
    done = threading.Event()

    def tick() -> None:  # deadlines and audits, as the aggregator node runs them
        while not done.wait(0.02):
            root.tick()
            root.run_audits()

    port_file = tmp_path / "relay.port"
    relay_acfg = AggregatorConfig(round=RoundConfig(deadline_s=20.0), claims=CLAIMS)
    threads = [threading.Thread(target=tick, daemon=True),
               threading.Thread(target=run_relay, args=(CFG, relay_acfg), daemon=True,
                                kwargs={"peers": [f"127.0.0.1:{port}"], "listen": "127.0.0.1:0", "blocks": [0],
                                        "state_dir": tmp_path / "relay", "name": "r1", "port_file": port_file,
                                        "stop": done})]
    for t in threads:
        t.start()
    until(lambda: port_file.exists() and port_file.read_text().strip() != "")
    yield root, f"127.0.0.1:{int(port_file.read_text())}"
    done.set()
    for t in threads:
        t.join(timeout=30)
    server_stop.set()
    server.stop(0).wait()


@pytest.fixture
def every_update_drawn(tmp_path):
    yield from _tree(tmp_path, share=1.0, probation=1)


@pytest.fixture
def none_drawn(tmp_path):
    yield from _tree(tmp_path, share=1e-12, probation=0)  # on, but no update is drawn (p = 1e-12)


def _run(address: str, worker_id: str, rounds: int, cls: type[BlockWorker] = BlockWorker, wait_s: float = 60.0):
    link = SwarmClient(address, timeout_s=20)
    wcfg = WorkerConfig(worker_id=worker_id, block=0, steps_per_round=2, codec=Codec.INT8, rounds=rounds,
                        wait_timeout_s=wait_s)
    try:
        return cls(CFG, TRAIN, wcfg, link, CORPUS, device=torch.device("cpu")).run()
    finally:
        link.close()


def test_drawn_child_updates_go_up_as_they_came_and_pass_their_replay_at_the_root(every_update_drawn):
    root, relay = every_update_drawn
    stats = _run(relay, "w", rounds=3)
    # the root's answers, through the relay: its first update held on probation, replayed, applied; the
    # next two drawn, held until their verdict (PROBATION), and their start states passed on by the relay
    assert stats.outcomes == {"probation": 3}
    assert root.audits is not None
    until(lambda: root.audits.totals().counts == {("passed", ""): 3})
    assert root.counters[("draws", "drawn")] == 3 and root.counters[("draws", "committed")] == 0
    assert root.meter.snapshot()[1]["submit_state"][0] == 2  # passed on by the relay
    until(lambda: root.block(0).info.version == 3)
    assert [(r.name, r.audited, r.failed) for r in root.status().identities] == [("w", 3, 0)]


def test_a_cheat_behind_a_relay_is_caught_by_its_replay_and_revoked(every_update_drawn):
    root, relay = every_update_drawn
    with pytest.raises(PeerUnavailable, match="no version after 0"):  # its probation update: held, replayed, failed
        _run(relay, "cheat", rounds=1, cls=NegatedWorker, wait_s=5.0)
    until(lambda: root.identities.is_revoked("cheat"))
    assert root.audits is not None and root.audits.totals().counts == {("failed", "delta"): 1}
    assert root.block(0).info.version == 0  # nothing of it applied


def test_child_updates_not_drawn_go_up_combined_each_with_the_roots_commit_token(none_drawn):
    root, relay = none_drawn
    runs = [threading.Thread(target=_run, args=(relay, w, 2)) for w in ("w1", "w2")]
    for t in runs:
        t.start()
    for t in runs:
        t.join(timeout=120)
    until(lambda: root.block(0).info.version == 2)
    assert root.counters[("draws", "committed")] == 4 and root.counters[("draws", "drawn")] == 0
    (record,) = root.status().blocks[0].relays
    assert record.name == "r1" and record.children == ("w1", "w2") and record.pushes >= 2 and record.refused == 0
    assert len(root.block(0).info.included) == 2  # both children's updates went into the last version
