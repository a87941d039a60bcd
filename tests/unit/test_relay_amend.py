"""A relay's amended combined update (aggregate/relay/forward.py, block.py `_replaces`): children of a failed
relay that move to a spare after it forwarded its round go into an amendment, which takes the place of
the spare's first push at the parent, exactly; children the parent names as counted already (through
the failed relay) are taken out of the spare's round exactly and the rest pushed again."""

from __future__ import annotations

import torch

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.manifests import Relays, counted_in
from btnode.aggregate.relay.forward import Combined, RelayBlock
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec
from btnode.errors import MalformedInput
from btnode.protocol import ManifestEntry, Outcome, PushHeader
from btnode.store.versions import VersionStore

INIT = {"w": torch.randn(32, 48, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(700)}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)
SHA = "00" * 32


def acfg(robust: str = "mean") -> AggregatorConfig:
    return AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=OuterConfig(robust=robust))


def delta_of(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in INIT.items()}


def combined(relay: str, children: list[str], i: int, base: int = 0) -> tuple[PushHeader, dict]:
    manifest = tuple(ManifestEntry(c, f"{c}-u", base, 2.0, SHA) for c in children)
    head = PushHeader(worker_id=relay, block=0, base_version=base, samples=2.0 * len(children), loss=1.0,
                      codec=Codec.FP32, update_id=f"{relay}-{i}", manifest=manifest)
    return head, delta_of(i)


def root(tmp_path, name: str, registered: list[str]) -> BlockAggregator:
    agg = BlockAggregator(0, INIT, VersionStore(tmp_path / name, 0), acfg(), clock=lambda: 1000.0)
    for w in registered:
        agg.register(w)
    return agg


def test_an_amendment_takes_the_place_of_the_first_push_bit_for_bit(tmp_path):
    workers = ["c1", "c2", "c3", "d1"]
    amended = root(tmp_path, "amended", workers)
    assert amended.submit(*combined("ra", ["c1"], 1)).outcome is Outcome.PENDING
    assert amended.submit(*combined("rb", ["d1"], 2)).outcome is Outcome.PENDING
    assert amended.info.version == 0  # c2, c3 have not reported
    head, delta = combined("ra", ["c1", "c2", "c3"], 3)
    assert amended.amends(head) == {"c1-u"}
    assert amended.submit(head, delta, amends=frozenset({"c1-u"})).outcome is Outcome.PENDING
    assert amended.info.version == 1 and amended.info.accepted == 2  # ra's amendment and rb's push
    assert sorted(amended.info.included) == ["c1-u", "c2-u", "c3-u", "d1-u"]
    assert amended.counters[("replaced", "")] == 1 and amended.counters[("pending", "")] == 3
    assert amended.counters[("applied", "")] == 2  # the replaced push is neither applied nor dropped
    # the same version as a root that only ever got the amendment and rb's push
    direct = root(tmp_path, "direct", workers)
    assert direct.submit(*combined("rb", ["d1"], 2)).outcome is Outcome.PENDING
    assert direct.submit(*combined("ra", ["c1", "c2", "c3"], 3)).outcome is Outcome.PENDING
    assert direct.info.sha256 == amended.info.sha256


def test_an_amendment_checked_against_a_round_that_moved_on_is_late(tmp_path):
    agg = root(tmp_path, "r", ["c1", "c2", "x"])
    assert agg.submit(*combined("ra", ["c1"], 1)).outcome is Outcome.PENDING
    head, delta = combined("ra", ["c1", "c2"], 2)
    j = agg.submit(head, delta, amends=frozenset())  # checked as a first push; it is not one any more
    assert j.outcome is Outcome.LATE and "amend it again" in j.reason
    assert agg.round.accepted["ra"].update_id == "ra-1"


def test_a_manifest_naming_updates_counted_through_another_relay_is_refused_with_their_ids():
    relays = Relays()
    for r in ("ra", "rb"):
        relays.joined(0, r)
    joined = {w: "" for w in ("c1", "c2", "d1")}
    first, _ = combined("ra", ["c1", "c2"], 1)
    relays.check(first, joined, lambda w: False, lambda u: False)
    relays.pushed(first, True)
    moved, _ = combined("rb", ["c1", "c2", "d1"], 2)  # ra failed after its push; its children moved to rb
    try:
        relays.check(moved, joined, lambda w: False, lambda u: False)
        raise AssertionError("a manifest counting c1 and c2 twice was accepted")
    except MalformedInput as exc:
        assert exc.reason == "counted" and counted_in(str(exc)) == {"c1-u", "c2-u"}
    # ra's own amendment may list its children again; their ids are counted no more once replaced
    again, _ = combined("ra", ["c1"], 3)
    relays.check(again, joined, lambda w: False, lambda u: False, own=frozenset({"c1-u", "c2-u"}))
    relays.pushed(again, True, replaced=frozenset({"c1-u", "c2-u"}))
    assert relays.counted("c1-u") and not relays.counted("c2-u")
    assert counted_in("some other refusal") == frozenset()


def relay_block(tmp_path) -> tuple[RelayBlock, list[Combined]]:
    out: list[Combined] = []
    block = RelayBlock(0, INIT, VersionStore(tmp_path / "relay", 0), acfg(), clock=lambda: 1000.0,
                       on_combined=out.append)
    return block, out


def child(worker: str, i: int) -> tuple[PushHeader, dict]:
    head = PushHeader(worker_id=worker, block=0, base_version=0, samples=2.0, loss=1.0, codec=Codec.FP32,
                      update_id=f"{worker}-u", steps=(0, 1))
    return head, delta_of(i)


def test_a_relay_amends_its_forwarded_round_with_a_child_that_moved_to_it(tmp_path):
    block, out = relay_block(tmp_path)
    block.register("d1")
    assert block.submit(*child("d1", 1)).outcome is Outcome.PENDING
    assert [e.update_id for e in out[0].manifest] == ["d1-u"]
    block.tick()
    assert len(out) == 1  # nothing new: no second push
    block.register("c1")  # a child of a failed relay joins here and re-pushes its update, same id
    assert block.submit(*child("c1", 2)).outcome is Outcome.PENDING
    assert len(out) == 2 and sorted(e.update_id for e in out[1].manifest) == ["c1-u", "d1-u"]
    fresh, seen = relay_block(tmp_path / "fresh")
    fresh.register("c1")
    fresh.register("d1")
    for h, d in (child("c1", 2), child("d1", 1)):
        fresh.submit(h, d)
    assert all(torch.equal(out[1].delta[n], seen[0].delta[n]) for n in INIT)  # the same sum, exactly


def test_a_relay_takes_out_what_the_parent_counted_already_exactly(tmp_path):
    block, out = relay_block(tmp_path)
    for w in ("c1", "c2", "d1"):
        block.register(w)
    for i, w in enumerate(("c1", "c2", "d1")):
        block.submit(*child(w, i))
    assert len(out) == 1 and len(out[0].manifest) == 3
    assert block.uncount(frozenset({"c1-u", "c2-u"})) == 2
    assert [e.update_id for e in out[1].manifest] == ["d1-u"]
    alone, seen = relay_block(tmp_path / "alone")
    alone.register("d1")
    alone.submit(*child("d1", 2))
    assert all(torch.equal(out[1].delta[n], seen[0].delta[n]) for n in INIT)
    assert block.counters[("rejected", "counted_upstream")] == 2


def test_at_a_deadline_the_root_stops_waiting_for_silent_replicas_without_a_stream_until_they_report(tmp_path):
    now = [1000.0]
    agg = BlockAggregator(0, INIT, VersionStore(tmp_path / "r", 0), acfg(), clock=lambda: now[0])
    for w in ("c1", "c2", "c3"):
        agg.register(w)  # joined through a relay: no version stream here
    agg.stream_opened("d1")  # a direct worker, connected
    assert agg.submit(*combined("ra", ["c1"], 1)).outcome is Outcome.PENDING
    now[0] += 11  # past the 10 s deadline: c2 and c3 (their relay died with them) and d1 missed the round
    assert agg.tick() is not None and agg.info.closed_by == "deadline"
    assert agg.registered == {"c1", "c2", "c3", "d1"}  # one round missed: still waited for (a spare may bring them)
    assert agg.submit(*combined("ra2", ["c1"], 3, base=1)).outcome is Outcome.PENDING
    now[0] += 11
    assert agg.tick() is not None and agg.info.closed_by == "deadline"
    assert agg.registered == {"c1", "d1"} and agg.forgotten == {"c2", "c3"}  # two in a row: not any more
    assert agg.submit(*combined("rb", ["c2"], 2, base=2)).outcome is Outcome.PENDING  # c2 is back, via a spare
    assert agg.registered == {"c1", "c2", "d1"} and agg.forgotten == {"c3"}
    agg.stream_closed("d1")
    assert "d1" not in agg.registered


def test_a_relay_restarted_on_its_state_folder_takes_up_its_open_round_durably(tmp_path):
    block, out = relay_block(tmp_path)
    for w in ("c1", "c2", "c3"):
        block.register(w)
    for i, w in enumerate(("c1", "c2")):
        assert block.submit(*child(w, i)).outcome is Outcome.PENDING
    assert out == []  # c3 has not reported: the round is open when the relay is killed
    del block  # SIGKILL: nothing flushed or closed on the way out
    again, out = relay_block(tmp_path)
    assert sorted(again.round.accepted) == ["c1", "c2"]
    assert again.submit(*child("c1", 0)).outcome is Outcome.PENDING  # its re-push: the same answer, counted once
    assert again.counters[("pending", "recovered")] == 2 and len(again.round.accepted) == 2
    again.drain()
    fresh, seen = relay_block(tmp_path / "fresh")
    for i, w in enumerate(("c1", "c2")):
        fresh.submit(*child(w, i))
    fresh.drain()
    assert [e.update_id for e in out[0].manifest] == ["c1-u", "c2-u"]
    assert all(torch.equal(out[0].delta[n], seen[0].delta[n]) for n in INIT)  # the same sum, bit for bit


def test_a_torn_last_record_is_dropped_and_a_round_on_another_version_is_not_taken_up(tmp_path):
    from btnode.aggregate.relay.roundlog import LOG_NAME

    block, _ = relay_block(tmp_path)
    for w in ("c1", "c2", "c3"):
        block.register(w)
    block.submit(*child("c1", 0))
    block.submit(*child("c2", 1))
    log_path = block.store.folder / LOG_NAME
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-20])  # the second record torn mid-write: c2 was never told ACCEPTED
    again, _ = relay_block(tmp_path)
    assert sorted(again.round.accepted) == ["c1"]
    assert again.submit(*child("c2", 1)).outcome is Outcome.PENDING  # c2 re-pushes and is judged afresh
    head = log_path.read_bytes().splitlines()[0].replace(b'"version":0', b'"version":7')
    log_path.write_bytes(head + b"\n")
    assert relay_block(tmp_path)[0].round.accepted == {}


def forwarded(tmp_path) -> tuple[RelayBlock, list[float], list[Combined]]:
    """A relay block on a clock the test moves, that has forwarded its round with one child (d1)."""
    now = [1000.0]
    out: list[Combined] = []
    block = RelayBlock(0, INIT, VersionStore(tmp_path / "relay", 0), acfg(), clock=lambda: now[0],
                       on_combined=out.append)
    block.register("d1")
    block.submit(*child("d1", 1))
    return block, now, out


def test_past_its_deadline_a_relay_that_forwarded_its_round_answers_late_rather_than_amend(tmp_path):
    block, now, out = forwarded(tmp_path)
    block.register("c1")
    now[0] += 5  # within its 10 s deadline: an amendment still reaches the parent in time
    assert block.submit(*child("c1", 2)).outcome is Outcome.PENDING and len(out) == 2
    block.register("c2")
    now[0] += 6  # past it: the parent closes soon, an amendment would come late
    j = block.submit(*child("c2", 3))
    assert j.outcome is Outcome.LATE and "could no longer reach the parent" in j.reason and len(out) == 2
    assert block.submit(*child("c1", 2)).outcome is Outcome.PENDING  # a re-push still gets its answer


def test_a_relay_amends_while_the_parent_said_its_round_is_open_and_no_longer(tmp_path):
    block, now, out = forwarded(tmp_path)  # the parent's answer: its round closes 20 s from now
    block.parent_closes(0, now[0] + 20 - 2)  # (less an upload: node/relay.py)
    block.parent_closes(7, now[0] + 99)  # an answer about another round changes nothing
    for w, seconds, outcome in (("c1", 11, Outcome.PENDING), ("c2", 6, Outcome.PENDING), ("c3", 1, Outcome.LATE)):
        block.register(w)
        now[0] += seconds  # c1 past this relay's own 10 s deadline, still within the parent's round
        assert block.submit(*child(w, len(out) + 1)).outcome is outcome, w
    assert len(out) == 3  # two amendments; c3 came 18 s in, when one could no longer reach the parent


def test_a_relay_stops_waiting_for_the_children_of_a_child_relay_whose_last_stream_ended_and_the_root_does_not(
        tmp_path):
    told: list[tuple[str, bool]] = []
    out: list[Combined] = []
    block = RelayBlock(0, INIT, VersionStore(tmp_path / "relay", 0), acfg(), clock=lambda: 1000.0,
                       on_combined=out.append, on_membership=lambda w, here: told.append((w, here)))
    for w, via in (("c1", "a1"), ("c2", "a1"), ("d1", "a2")):
        block.register(w, via)  # their joins passed on by child relays a1 and a2
    for r in ("a1", "a1", "a2"):  # a1 reconnected before its old stream ended: two streams for a while
        block.relay_stream_opened(r)
    assert block.submit(*combined("a2", ["d1"], 1)).outcome is Outcome.PENDING
    block.relay_stream_closed("a1")
    assert out == [] and block.registered == {"c1", "c2", "d1"}  # a1 still watches: its children are waited for
    block.relay_stream_closed("a1")  # its last stream: a1 died, c1 and c2 report through another relay if they live
    assert [e.worker_id for e in out[0].manifest] == ["d1"] and block.registered == {"d1"}
    assert told == []  # not told upstream: the root keeps waiting for c1 and c2, wherever they report
    block.relay_stream_opened("a1")  # a1 was only cut off: it joins its children again (node/relay.py _follow)
    assert block.registered == {"d1"}
    for w in ("c1", "c2"):
        block.register(w, "a1")  # waited for again, and its late push is an amendment
    assert block.submit(*combined("a1", ["c1", "c2"], 2)).outcome is Outcome.PENDING
    assert sorted(e.worker_id for e in out[1].manifest) == ["c1", "c2", "d1"]
    block.relay_stream_closed("a1")
    assert block.registered == {"d1"}  # (they reported this round already: nothing more to wait for)

    parent = root(tmp_path, "root", [])
    parent.register("c1", "ra")
    parent.relay_stream_opened("ra")
    parent.relay_stream_closed("ra")
    assert parent.registered == {"c1"}  # the root's close is final: it waits for c1 through any relay
