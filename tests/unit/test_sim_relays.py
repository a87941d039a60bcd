"""The simulator with relays (SimConfig.relays): the daemon's relay aggregators in process between the
workers and the root, on the virtual clock. A swarm behind two relays trains: every update a relay or
the root took in reaches a published version, audits pass, nothing is revoked; the root checks what a
relay passes on by its children's signatures, as under mutual TLS."""

from __future__ import annotations

import json

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.data.corpus import bundled
from btnode.errors import ConfigError, Forbidden
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement
from btnode.sim.simulator import SimConfig, Simulation
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
H = 2


def simulation(tmp_path, rounds: int, **sim) -> tuple[Simulation, list]:
    torch.manual_seed(0)
    tc = TrainConfig(batch=4, steps=rounds * H, warmup=H, seed=0)
    published: list = []
    s = Simulation(CFG, tc, AggregatorConfig(claims=ClaimConfig.of(tc, H)),
                   SimConfig(rounds=rounds, steps_per_round=H, **sim), bundled().train, tmp_path,
                   device=torch.device("cpu"), on_publish=lambda b, info: published.append(info))
    return s, published


def taken_in(s: Simulation) -> dict[str, list[str]]:
    """Record, per worker, the update ids its relay (or the root, for one passed on) took into a round."""
    taken: dict[str, list[str]] = {}
    for rep in s.replicas:
        link, wid = rep.worker.link, rep.worker.wcfg.worker_id

        def push(header, frames, push=link.push, wid=wid) -> Judgement:
            j = push(header, frames)
            if j.outcome.in_round:
                taken.setdefault(wid, []).append(header.update_id)
            return j

        link.push = push
    return taken


@pytest.mark.parametrize("participation", [1.0, 0.7])
def test_a_swarm_behind_two_relays_trains_and_every_update_taken_is_published(tmp_path, participation):
    s, published = simulation(tmp_path, rounds=5, replicas=6, relays=2, participation=participation, seed=3)
    assert [r.relay.name for r in s.relays] == ["relay0", "relay1"]
    assert {rep.relay.name for rep in s.replicas if rep.relay is not None} == {"relay0", "relay1"}
    taken = taken_in(s)
    result = s.run()

    versions = [info.version for info in published]
    assert versions == list(range(1, result.versions[0] + 1)) and len(versions) >= 4
    included = {u for info in published for u in info.included}
    assert taken and all(u in included for ids in taken.values() for u in ids)
    assert sum(len(ids) for ids in taken.values()) == len(included)  # and nothing else went in
    # the relays combined updates, and their rounds took every child update they accepted up to the root
    assert all(sum(h.relay.judged.values()) > 0 and h.relay.lost() == 0 for h in s.relays)
    assert not any(event == "relay_uncounted" for event, _ in s.agg.counters)
    # audits through the relays: drawn children's updates passed on, replayed, all passed
    assert s.agg.counters[("draws", "drawn")] > 0 and s.agg.counters[("draws", "committed")] > 0
    assert s.verdicts and all(v.passed for v in s.verdicts)
    assert not s.agg.identities.revoked
    # every replica hears its versions from its relay: each ends on the root's newest
    newest = s.agg.block(0).info
    assert all(h.relay.blocks[0].info == newest for h in s.relays)
    if participation < 1:  # relays' rounds also close by their deadline, when a child sat it out; and a
        # child back from sitting one out may push on a version its relay has moved on from: LATE there
        assert sum(b.rounds_closed["deadline"] for h in s.relays for b in h.relay.blocks.values()) > 0
        assert sum(n for h in s.relays for b in h.relay.blocks.values()
                   for (outcome, _), n in b.counters.items() if outcome == "late") > 0


def test_an_update_late_at_its_relay_does_not_lock_its_worker_out(tmp_path):
    """A relay answers a child's late update LATE itself, before reading its frames; it still sends the claim
    up (Draw, `refused`), so that the root's chain of the worker's claims moves on as its optimizer did."""
    s, _ = simulation(tmp_path, rounds=5, replicas=6, relays=2, participation=0.7, seed=3)
    s.run()
    assert s.agg.counters[("draws", "refused_at_relay")] > 0  # the run has late updates at a relay
    assert s.agg.counters[("draws_refused", "chain")] == 0


def test_children_behind_relays_verify_each_other_the_far_ones_first(tmp_path):
    """Delegated verification through relays: the root hands drawn child updates to other children (via
    their relays), never the author, and one behind another relay than the author's whenever there is one;
    the root replays none itself beyond its spot share, and every verdict passes."""
    s, _ = simulation(tmp_path, rounds=4, replicas=6, relays=2, seed=3)
    delegated = s.agg.delegated
    assert delegated is not None
    chosen: list[tuple[str, list[str], list[str]]] = []  # (author, its verifiers, the pool), as each task was handed out
    draw = delegated._draw

    def recorded(update_id: str, author: str, pool: list[str], n: int) -> list[str]:
        got = draw(update_id, author, pool, n)
        chosen.append((author, got, list(pool)))
        return got

    delegated._draw = recorded  # type: ignore[method-assign]
    s.run()
    assert delegated.counts.get("tasks", 0) > 0 and delegated.work, delegated.counts
    workers = {rep.worker.wcfg.worker_id for rep in s.replicas}
    assert set(delegated.work) <= workers  # the children replayed, through their relays
    relay_of = {rep.worker.wcfg.worker_id: rep.relay.name for rep in s.replicas}
    assert {s.agg.relays_for(w) for w in workers} == {"relay0", "relay1"}
    for author, verifiers, pool in chosen:  # one behind the author's relay only when no other was left
        far = [v for v in pool if relay_of[v] != relay_of[author]]
        near = [v for v in verifiers if relay_of[v] == relay_of[author]]
        assert author not in verifiers and len(near) == max(0, len(verifiers) - len(far)), (author, verifiers, pool)
    assert any(len(v) == 2 for _, v, _ in chosen)  # (the redundant share drew two somewhere)
    assert delegated.counts.get("local", 0) == 0
    assert s.verdicts and all(v.passed for v in s.verdicts) and not s.agg.identities.revoked


def test_the_root_checks_what_a_relay_passes_on_by_the_childs_signature(tmp_path):
    s, _ = simulation(tmp_path, rounds=1, replicas=2, relays=1)
    parent, ca = s.relays[0].relay.parent, s.ca
    assert ca is not None
    join = ("intruder", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), "")
    with pytest.raises(Forbidden, match="signature"):  # a join passed on without the worker's signature
        parent.join(*join, training_json="", proof=(b"", b""))
    with pytest.raises(Forbidden, match="signature"):  # ... or with a signature over something else
        parent.join(*join, training_json="", proof=(ca.cert("intruder"), ca.sign("intruder", b"another join")))
    assert "intruder" not in s.agg.blocks[0].registered


def test_relays_are_at_most_the_replicas():
    with pytest.raises(ConfigError, match="relays"):
        SimConfig(replicas=2, relays=3)
