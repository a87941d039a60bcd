"""Relay failover in a later round, with real processes (docs/relays.md, "Failover"): a relay killed in
the second round while it holds accepted updates loses none of them; a re-push that reaches the spare
while the worker's re-join is still at the root is refused for now (JoinPending) and lands once the join
has; a push the spare refuses for good makes it tell the root, which stops waiting for that worker; in a
relay of relays, the relay above a killed one stops waiting for its children once its stream ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.protocol import EMPTY_STATE, JoinInfo, Outcome, PushHeader, VersionInfo, WorkClaim
from btnode.rpc.client import SwarmClient
from btnode.rpc.failover import FailoverLink
from btnode.store.models import init_block
from btnode.train.recipe import Recipe

from procs import honest_terms, wait_port
from test_relay import CFG, counters, finished, included, node, relays, worker

HERE = Path(__file__).resolve().parent
CLAIMS = ClaimConfig(batch=4, steps_per_round=2)


def join(c: SwarmClient, name: str) -> JoinInfo:
    return c.join(name, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))


def update(name: str, base: VersionInfo, key: str, seed: int) -> tuple[PushHeader, list]:
    """A hand-made update of `name` on `base` that the root's claims check takes (each coordinate within
    a small part of what H AdamW steps at the swarm's lr allow; the samples and steps of one round)."""
    g = torch.Generator().manual_seed(seed)
    h, lr = CLAIMS.steps_per_round, CLAIMS.lr
    delta = {n: (torch.rand(t.shape, generator=g) * 2 - 1) * (0.3 * h * lr)
             for n, t in init_block(CFG, 0, 0).state_dict().items()}
    recipe = Recipe.here(torch.device("cpu"), "fp32", error_feedback=True).to_json()
    header = PushHeader(worker_id=name, block=0, base_version=base.version, samples=float(h * CLAIMS.batch), loss=1.0,
                        codec=Codec.FP32, update_id=f"{name}-{base.version}-{seed}", data_key=key,
                        steps=tuple(range(base.version * h, (base.version + 1) * h)),
                        claim=WorkClaim(base_sha256=base.sha256, data_id="", recipe=recipe, optimizer_start=EMPTY_STATE,
                                        optimizer_end=EMPTY_STATE, residual_start=EMPTY_STATE,
                                        residual_end=EMPTY_STATE))
    return header, list(encode_frames(delta, Codec.FP32))


def wait_for(what: str, ok, timeout: float = 60.0) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def block0(c: SwarmClient) -> dict:
    return c.status_dict()["blocks"][0]


def test_a_relay_killed_in_the_second_round_loses_no_accepted_update(tmp_path, processes):
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "60",
                "--keep", "100")
    first, spare = relays(processes, tmp_path, root, {"ra": [], "rb": []})
    a, c = SwarmClient(first, timeout_s=15), SwarmClient(root, timeout_s=15)
    # "idle" reports in round 0 (by hand) and never again: ra's round 1 stays open, holding w0's and w1's updates
    info = join(a, "idle")
    assert a.push(*update("idle", info.current, info.data_key, 0)).outcome is Outcome.PENDING
    procs = {w: worker(processes, tmp_path, w, f"{first},{spare}", 3) for w in ("w0", "w1")}
    wait_for("ra never held two updates of round 1", lambda: (
        block0(c)["version"] >= 1 and (b := block0(a))["version"] == 1 and b["accepted_in_round"] >= 2))
    a.close()
    processes[1].send_signal(signal.SIGKILL)
    killed = time.time()
    c.leave("idle", 0)  # the root's rounds close once rb reports for w0 and w1
    stats = finished(tmp_path, procs)
    accepted = {u for s in stats.values() for u in s["accepted_updates"]}
    assert {w: len(s["accepted_updates"]) for w, s in stats.items()} == {"w0": 3, "w1": 3}, stats
    assert all(s["not_included"] == [] for s in stats.values()), stats
    assert accepted <= included(c)  # 0 lost: round 1's updates, accepted by ra, re-pushed to rb and published
    recent = block0(c)["recent"]
    after = [r for r in recent if r["closed_at_unix"] > killed]
    # the rounds after the kill closed because everyone reported, not at the 60 s deadline
    assert after and all(r["closed_by"] == "all_reported" for r in after), recent
    assert sum(s["repushes"].get("pending", 0) for s in stats.values()) >= 2, stats  # both re-pushed to rb
    # the workers joined rb before any call there: no push overtook its join
    assert counters(SwarmClient(spare, timeout_s=15)).get(("join_pending", ""), 0) == 0
    c.close()


def test_a_re_push_racing_its_re_join_is_retried_and_a_child_refused_for_good_is_no_longer_waited_for(
        tmp_path, processes):
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "60",
                "--keep", "100")
    port = tmp_path / "proxy.port"
    with open(tmp_path / "proxy.log", "ab") as log:  # holds the joins of x and z on their way to the root
        proxy = subprocess.Popen([sys.executable, str(HERE.parent / "faults" / "held_joins.py"), root, str(port),
                                  str(tmp_path), "x", "z"], stdout=log, stderr=subprocess.STDOUT)
    processes.append(proxy)
    parent = f"127.0.0.1:{wait_port(port, proxy)}"
    (first,) = relays(processes, tmp_path, root, {"ra": []})
    ra = processes[-1]
    (spare,) = relays(processes, tmp_path, parent, {"rb": []})  # rb's parent: the root, through the proxy
    a, b, c = (SwarmClient(x, timeout_s=15) for x in (first, spare, root))
    joined = {w: join(a, w) for w in ("x", "y", "z", "idle")}  # idle never pushes: ra's round stays open
    ups = {w: update(w, joined[w].current, joined[w].data_key, i) for i, w in enumerate(("x", "y", "z"))}
    for w, (h, frames) in ups.items():
        assert a.push(h, frames).outcome is Outcome.PENDING, w
    wait_for("ra never held three updates", lambda: block0(a)["accepted_in_round"] >= 3)
    a.close()
    ra.send_signal(signal.SIGKILL)
    c.leave("idle", 0)

    # y, an old client, pushes to the spare without joining it: refused for good, and rb tells the root
    j = b.push(*ups["y"])
    assert j.outcome is Outcome.REJECTED and "without joining" in j.reason, j
    wait_for("the root still waits for y", lambda: "y" not in block0(c)["replicas"])

    # x re-joins rb (held at the proxy: rb has no key for x yet) while its re-push races it
    rejoin = threading.Thread(target=join, args=(b, "x"))
    rejoin.start()
    wait_for("x's join never reached the proxy", (tmp_path / "held-x").exists)
    answer: list = []
    pusher = threading.Thread(target=lambda: answer.append(b.push(*ups["x"])))
    pusher.start()
    wait_for("the push was never refused for now", lambda: b.retries[("push", "join_pending")] >= 1)
    assert pusher.is_alive() and not answer  # refused for now, and retried: not a final answer
    (tmp_path / "release-x").touch()
    rejoin.join(30)
    pusher.join(60)
    assert answer and answer[0].outcome is Outcome.PENDING, answer  # the same update id, accepted by the spare
    raced = counters(b).get(("join_pending", ""), 0)
    assert raced == b.retries[("push", "join_pending")], (counters(b), b.retries)

    # z, a FailoverLink client, moves from dead ra to rb: its push waits for its join there, and never races it
    link = FailoverLink([first, spare], timeout_s=15)
    joiner = threading.Thread(target=join, args=(link, "z"))
    joiner.start()
    wait_for("z's join never reached the proxy", (tmp_path / "held-z").exists)
    pushed: list = []
    pusher = threading.Thread(target=lambda: pushed.append(link.push(*ups["z"])))
    pusher.start()
    pusher.join(1.0)  # time enough to reach rb, were it not waiting for the join
    assert pusher.is_alive() and counters(b).get(("join_pending", ""), 0) == raced
    (tmp_path / "release-z").touch()
    joiner.join(30)
    pusher.join(60)
    assert pushed and pushed[0].outcome is Outcome.PENDING, pushed
    assert counters(b).get(("join_pending", ""), 0) == raced  # no call of z reached rb before its join had landed

    wait_for("no version 1", lambda: block0(c)["version"] >= 1, timeout=40)  # well before the 60 s deadline
    got = included(c)
    assert {ups["x"][0].update_id, ups["z"][0].update_id} <= got and ups["y"][0].update_id not in got
    assert block0(c)["recent"][-1]["closed_by"] == "all_reported", block0(c)["recent"]
    for x in (b, c, link):
        x.close()


def test_in_a_relay_of_relays_the_relay_above_a_killed_one_stops_waiting_for_its_children(tmp_path, processes):
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "90",
                "--keep", "100", "--relay-audit-rate", "0")
    upper, other = relays(processes, tmp_path, root, {"ua": [], "ub": []})  # ua's round: 67.5 s (a quarter less)
    (lower,) = relays(processes, tmp_path, upper, {"la": []})
    la = processes[-1]
    low, up, c = (SwarmClient(x, timeout_s=15) for x in (lower, upper, root))
    # "idle" reports in round 0 (by hand) and never again: la's round 1 stays open, holding w0's and w1's updates
    info = join(low, "idle")
    assert low.push(*update("idle", info.current, info.data_key, 0)).outcome is Outcome.PENDING
    procs = {w: worker(processes, tmp_path, w, f"{lower},{other}", 3) for w in ("w0", "w1")}
    procs["w2"] = worker(processes, tmp_path, "w2", upper, 3)  # ua's own child: ua pushes each round
    wait_for("la never held two updates of round 1", lambda: (
        block0(c)["version"] >= 1 and (b := block0(low))["version"] == 1 and b["accepted_in_round"] >= 2))
    low.close()
    la.send_signal(signal.SIGKILL)  # w0 and w1 move to ub, in the other branch, and re-push there
    killed = time.time()
    c.leave("idle", 0)
    stats = finished(tmp_path, procs, timeout=300)
    accepted = {u for s in stats.values() for u in s["accepted_updates"]}
    assert {w: len(s["accepted_updates"]) for w, s in stats.items()} == {"w0": 3, "w1": 3, "w2": 3}, stats
    assert all(s["not_included"] == [] for s in stats.values()), stats
    assert accepted <= included(c)  # 0 lost: round 1's updates, accepted by la, re-pushed to ub and published
    after = [r for r in block0(c)["recent"] if r["closed_at_unix"] > killed]
    # ua stopped waiting for la's children (now ub's) when la's stream ended, not at its 67.5 s deadline,
    # in the kill's round and in every later one
    times = [killed, *(r["closed_at_unix"] for r in after)]
    assert len(times) > 1 and all(t - s < 30 for s, t in zip(times, times[1:])), (killed, block0(c)["recent"])
    assert all(r["closed_by"] == "all_reported" for r in after), after
    for x in (up, c):
        x.close()
