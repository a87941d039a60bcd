"""Relays with real processes (docs/swarm.md, "Relays"): a root, relays and tiny workers train
rounds with the same versions at every hop; a relay killed mid-round loses no accepted update;
a combined push whose manifest lies is refused by the root."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.identities import Role
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.model.config import ModelConfig
from btnode.node import launch
from btnode.protocol import ManifestEntry, Outcome, PushHeader
from btnode.rpc.certs import admit, init_ca
from btnode.rpc.client import SwarmClient
from btnode.errors import Unauthenticated
from btnode.rpc.convert import info_from_pb
from btnode.rpc.security import Security
from btnode.store.models import init_block
from lab import lab_env
from btnode.store.versions import VersionStore

from procs import CLI, TINY_SHAPE, free_port, honest_terms, scrape, start, wait_port

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
CLAIMS = ["--batch", "4", "--steps-per-round", "2"]
WORKER = [*CLAIMS, "--warmup", "1", "--block", "0"]
SHA = "00" * 32


def spawn(processes, tmp: Path, name: str, *args: str, listen: str = "127.0.0.1:0"):
    """A `btnode join` process on `listen` (kept in `processes`); returns (process, its port file)."""
    port = tmp / f"{name}.port"
    port.unlink(missing_ok=True)
    # relay mechanics, as before #38's defaults (a test's own --audit, later on the line, wins): identities and
    # audits through relays are tested where they are named (mutual TLS, replays below; tests/rpc)
    proc = start(["join", "--no-identities", "--audit", "0", *args, "--listen", listen, "--port-file", str(port),
                  "--state-dir", str(tmp / name), *TINY_SHAPE, *CLAIMS], tmp / f"{name}.log")
    processes.append(proc)
    return proc, port


def node(processes, tmp: Path, name: str, *args: str, listen: str = "127.0.0.1:0") -> str:
    proc, port = spawn(processes, tmp, name, *args, listen=listen)
    return f"127.0.0.1:{wait_port(port, proc)}"


def relays(processes, tmp: Path, parent: str, extra: dict[str, list[str]]) -> list[str]:
    """Relays of block 0 under `parent`, started together; their addresses."""
    started = [spawn(processes, tmp, r, "--role", "relay", "--peer", parent, "--relay-id", r, "--blocks-owned", "0",
                     *args) for r, args in extra.items()]
    return [f"127.0.0.1:{wait_port(port, proc)}" for proc, port in started]


def worker(processes, tmp: Path, name: str, peers: str, rounds: int):
    proc = start(["join", "--role", "worker", "--peer", peers, "--rounds", str(rounds), "--worker-id", name,
                  "--stats-file", str(tmp / f"{name}.json"), *TINY_SHAPE, *WORKER], tmp / f"{name}.log")
    processes.append(proc)
    return proc


def finished(tmp: Path, procs: dict, timeout: float = 150.0) -> dict[str, dict]:
    """Wait for each worker process to exit 0; its stats file."""
    out = {}
    for name, proc in procs.items():
        rc = proc.wait(timeout=timeout)
        assert rc == 0, (tmp / f"{name}.log").read_text()
        out[name] = json.loads((tmp / f"{name}.json").read_text())
    return out


def included(client: SwarmClient) -> set[str]:
    return {i for r in client.status_dict()["blocks"][0]["recent"] for i in r["included"]}


def counters(client: SwarmClient) -> dict[tuple[str, str], float]:
    """A node's counters from its Status reply: (event, reason) → count; a block's updates count as
    ("updates", outcome) when the reason is empty, else ("updates", reason)."""
    return {(c["name"], c["labels"].get("reason") or c["labels"].get("outcome", "")): c["value"]
            for c in client.status_dict()["counters"]}


def test_two_relays_carry_four_workers_with_the_same_versions_at_every_hop(tmp_path, processes):
    metrics = free_port()
    root, r1, r2 = (f"127.0.0.1:{free_port()}" for _ in range(3))
    # all seven processes start at once (relays and workers retry their parent until it serves)
    spawn(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "20", "--keep",
          "100", "--metrics-listen", f"127.0.0.1:{metrics}", listen=root)
    for r, at in (("r1", r1), ("r2", r2)):
        spawn(processes, tmp_path, r, "--role", "relay", "--peer", root, "--relay-id", r, "--blocks-owned", "0",
              listen=at)
    procs = {f"w{i}": worker(processes, tmp_path, f"w{i}", r1 if i < 2 else r2, 3) for i in range(4)}
    stats = finished(tmp_path, procs)
    c = SwarmClient(root, timeout_s=15)
    st = c.status_dict()["blocks"][0]
    root_store = VersionStore(tmp_path / "root", 0)
    for name, s in stats.items():
        # a worker that joins after its relay's first round closed is LATE once, as with a flat aggregator
        assert s["outcomes"].get("pending", 0) >= 2 and set(s["outcomes"]) <= {"pending", "late"}, (name, s)
        assert s["not_included"] == [], (name, s)
        assert s["delta_fetches"] >= 2  # versions came as deltas from its relay, checked against the root's hash
        assert root_store.load(s["version"]).meta["info"]["sha256"] == s["sha256"]
    # every accepted update is listed in the version it went into, and nothing else is
    assert included(c) == {u for s in stats.values() for u in s["accepted_updates"]}
    for r in ("r1", "r2"):
        relay_store = VersionStore(tmp_path / r, 0)
        for v in relay_store.versions():  # bit-identical at the relay: same tensors, same hash
            mine, theirs = relay_store.load(v), root_store.load(v)
            assert mine.meta["info"]["sha256"] == theirs.meta["info"]["sha256"]
            assert all(torch.equal(mine.params[n], theirs.params[n]) for n in theirs.params)
    # the root sees relays, not workers, push; and knows each relay's children
    assert {r["name"]: sorted(r["children"]) for r in st["relays"]} == {"r1": ["w0", "w1"], "r2": ["w2", "w3"]}
    # one combined push per round at least: as many as the child with the most accepted updates (3 when
    # none was LATE; 2 when both of a relay's children trained on a version the root replaced before the
    # relay had a child: a flat 3 failed one CI run, which half of the check was not recorded)
    for r in st["relays"]:
        most = max(stats[w]["outcomes"].get("pending", 0) for w in r["children"])
        assert r["refused"] == 0 and r["pushes"] >= most, (st["relays"], stats)
    c.close()
    # the root's version egress: one full pull and one delta per version for each of the two relays (a flat
    # root would serve the four workers: twice that), whatever the rounds' interleaving
    sent = re.search(r'btnode_transfer_bytes_total\{direction="sent",form="wire"\} (\S+)', scrape(metrics))
    full = max(s["bytes_pulled_wire"] - s["bytes_delta_wire"] for s in stats.values())
    per_delta = max(s["bytes_delta_wire"] / s["delta_fetches"] for s in stats.values())
    versions = st["version"]
    assert sent is not None and 0 < float(sent.group(1)) <= 1.25 * 2 * (full + versions * per_delta), (
        sent, full, per_delta, versions)
    shown = subprocess.run([*CLI, "status", "--peer", root], capture_output=True, text=True, timeout=60).stdout
    assert "relay r1: children [w0, w1]" in shown and "relay r2: children [w2, w3]" in shown, shown


def holding_relay(processes, tmp_path: Path, deadline_s: str, rb_child: bool):
    """A root, relay ra holding w0's and w1's accepted updates (it closes a round at 3, and its third
    child, idle, never pushes), and relay rb, their spare (with its own child w2 if `rb_child`, whose
    update rb has forwarded): then ra SIGKILLed mid-round, deterministically. Returns (root client,
    worker processes, rb's address)."""
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", deadline_s)
    first, spare = relays(processes, tmp_path, root, {"ra": ["--min-updates", "3"], "rb": []})
    a, c = SwarmClient(first, timeout_s=15), SwarmClient(root, timeout_s=15)
    a.join("idle", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(
        ClaimConfig(batch=4, steps_per_round=2)))
    procs = {w: worker(processes, tmp_path, w, f"{first},{spare}", 2) for w in ("w0", "w1")}
    if rb_child:
        procs["w2"] = worker(processes, tmp_path, "w2", spare, 2)
    deadline = time.monotonic() + 60
    while (a.status_dict()["blocks"][0]["accepted_in_round"] < 2
           or rb_child and not c.status_dict()["blocks"][0]["accepted_in_round"]):
        assert time.monotonic() < deadline, "ra never held two updates, or rb never forwarded w2's"
        time.sleep(0.05)
    a.close()
    processes[1].send_signal(signal.SIGKILL)
    return c, procs, spare


def test_a_relay_killed_mid_round_loses_no_accepted_update(tmp_path, processes):
    c, procs, _ = holding_relay(processes, tmp_path, "30", rb_child=False)
    c.leave("idle", 0)  # so that the root's rounds close once rb reports for w0 and w1
    stats = finished(tmp_path, procs)
    accepted = {u for s in stats.values() for u in s["accepted_updates"]}
    assert len(accepted) == 4 and all(s["not_included"] == [] for s in stats.values())
    assert accepted <= included(c)  # 0 lost: each accepted update, re-pushed to rb, made it into a version
    st = c.status_dict()["blocks"][0]
    pushes = {r["name"]: r["pushes"] for r in st["relays"]}
    assert pushes["ra"] == 0 and pushes["rb"] >= 2  # more when w1 re-pushed after rb forwarded w0's: an amendment
    # so each worker moved to the spare: both of its accepted updates are in versions, and ra pushed none
    assert {w: len(s["accepted_updates"]) for w, s in stats.items()} == {"w0": 2, "w1": 2}, stats
    c.close()


def test_a_spare_that_forwarded_its_round_amends_it_with_the_children_of_a_killed_relay(tmp_path, processes):
    c, procs, _ = holding_relay(processes, tmp_path, "60", rb_child=True)  # rb's round went up before ra died
    c.leave("idle", 0)
    stats = finished(tmp_path, procs)
    accepted = {u for s in stats.values() for u in s["accepted_updates"]}
    assert len(accepted) == 6 and all(s["not_included"] == [] for s in stats.values())
    assert accepted <= included(c)  # 0 lost: w0's and w1's updates went up in rb's amendment
    # rb's round (w2's update alone) went up before ra died: the root took an amendment in its place
    assert counters(c).get(("updates", "replaced"), 0) >= 1, counters(c)
    first = [s["accepted_updates"][0] for s in stats.values()]  # each worker's update of round 0
    assert any(set(first) <= set(r["included"]) for r in c.status_dict()["blocks"][0]["recent"]), first
    c.close()


def test_the_root_stops_waiting_for_a_child_whose_version_stream_at_its_relay_ended(tmp_path, processes):
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "60")
    (relay,) = relays(processes, tmp_path, root, {"r1": []})
    c, r = SwarmClient(root, timeout_s=15), SwarmClient(relay, timeout_s=15)
    r.join("c9", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(
        ClaimConfig(batch=4, steps_per_round=2)))

    def replicas_at_root_become(want: bool) -> None:
        deadline = time.monotonic() + 20
        while ("c9" in c.status_dict()["blocks"][0]["replicas"]) != want:
            assert time.monotonic() < deadline, f"c9 {'never' if want else 'still'} a replica at the root"
            time.sleep(0.05)

    replicas_at_root_become(True)  # its join passed through the relay
    stream = r.watch(0, "c9")
    next(stream)  # the current version: the stream is open, c9 registered at the relay
    r.cancel_watches("c9")  # its stream ends (as when its process dies): the relay tells the root
    replicas_at_root_become(False)
    assert "c9" not in r.status_dict()["blocks"][0]["replicas"]
    stream = r.watch(0, "c9")  # back: the relay joins it at the root again, with its first join
    next(stream)
    replicas_at_root_become(True)
    r.close()
    c.close()


def test_a_relay_killed_with_its_workers_takes_its_round_up_again_after_a_restart(tmp_path, processes):
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "12")
    listen = f"127.0.0.1:{free_port()}"
    relay_args = ("--role", "relay", "--peer", root, "--relay-id", "r1", "--blocks-owned", "0")
    relay = node(processes, tmp_path, "r1", *relay_args, listen=listen)
    r = SwarmClient(relay, timeout_s=15)
    terms = honest_terms(ClaimConfig(batch=4, steps_per_round=2))
    keys = {w: r.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=terms).data_key
            for w in ("c1", "c2", "idle")}  # idle never pushes: the relay's round is open when it is killed
    spec = {n: tuple(t.shape) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    for i, w in enumerate(("c1", "c2")):
        g = torch.Generator().manual_seed(i)
        delta = {n: 1e-5 * torch.randn(s, generator=g) for n, s in spec.items()}
        h = PushHeader(worker_id=w, block=0, base_version=0, samples=8.0, loss=1.0, codec=Codec.FP32,
                       update_id=f"{w}-update", data_key=keys[w], steps=(0, 1))
        assert r.push(h, encode_frames(delta, Codec.FP32)).outcome is Outcome.PENDING
    r.close()
    processes[1].send_signal(signal.SIGKILL)  # the relay, and (in effect) c1 and c2: nobody will push again
    processes[1].wait()
    node(processes, tmp_path, "r1", *relay_args, listen=listen)  # systemd's Restart=, on the same state folder
    c = SwarmClient(root, timeout_s=15)
    deadline = time.monotonic() + 60
    while not {"c1-update", "c2-update"} <= included(c):  # forwarded from the log; the root closes at its deadline
        assert time.monotonic() < deadline, (tmp_path / "r1.log").read_text()[-3000:]
        time.sleep(0.2)
    # (nobody pushed after the kill: only the restarted relay's round log can have carried c1's and c2's updates)
    c.close()


def test_a_relay_re_pushes_its_combined_update_to_a_restarted_root(tmp_path, processes):
    listen = f"127.0.0.1:{free_port()}"
    root_args = ("--role", "aggregator", "--blocks-owned", "0", "--deadline", "20")
    root = node(processes, tmp_path, "root", *root_args, listen=listen)
    c = SwarmClient(root, timeout_s=15)
    # a worker joined at the root that never pushes: the root's round stays open after the relay's push
    c.join("idle", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(
        ClaimConfig(batch=4, steps_per_round=2)))
    (relay,) = relays(processes, tmp_path, root, {"r1": []})
    procs = {w: worker(processes, tmp_path, w, relay, 2) for w in ("w0", "w1")}
    deadline = time.monotonic() + 120
    while not c.status_dict()["blocks"][0]["accepted_in_round"]:
        assert time.monotonic() < deadline, "the relay never pushed"
        time.sleep(0.05)
    c.close()
    processes[0].send_signal(signal.SIGKILL)  # the root loses its open round, with the relay's combined update
    processes[0].wait()
    lost_round = VersionStore(tmp_path / "root", 0).latest().version == 0  # (unless it closed just before the kill)
    node(processes, tmp_path, "root", *root_args, listen=listen)
    stats = finished(tmp_path, procs)
    c = SwarmClient(root, timeout_s=15)
    accepted = {u for s in stats.values() for u in s["accepted_updates"]}
    assert accepted and accepted <= included(c) and all(s["not_included"] == [] for s in stats.values())
    if lost_round:  # the relay's combined update came back only because the relay pushed it again
        r = SwarmClient(relay, timeout_s=15)
        repushed = {why: n for (name, why), n in counters(r).items() if name == "repushed"}
        # pending, probation (drawn for audit), or unanswered: the restarted root took it, and its answer came
        # too late under load (seen once in CI); the round then closed with it before the relay's next try
        assert sum(repushed.get(k, 0) for k in ("pending", "probation", "unanswered")) >= 1, repushed
        r.close()
    c.close()


def _push(c: SwarmClient, relay: str, manifest: list[ManifestEntry], samples: float, base: int = 0):
    g = torch.Generator().manual_seed(len(manifest))
    spec = {n: tuple(t.shape) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    delta = {n: 1e-4 * torch.randn(s, generator=g) for n, s in spec.items()}
    h = PushHeader(worker_id=relay, block=0, base_version=base, samples=samples, loss=1.0, codec=Codec.FP32,
                   update_id=f"{relay}-{time.monotonic_ns()}", manifest=tuple(manifest))
    return c.push(h, encode_frames(delta, Codec.FP32))


def test_a_manifest_that_lies_is_refused_by_the_root(tmp_path, processes):
    # no relay audits: these hand-made pushes have no evidence behind them (the audit test is below)
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "30",
                "--relay-audit-rate", "0")
    c = SwarmClient(root, timeout_s=15)
    terms = honest_terms(ClaimConfig(batch=4, steps_per_round=2))
    c.join("liar", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), relay=True)
    c.join("c1", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=terms)
    honest = ManifestEntry(worker_id="c1", update_id="u1", base_version=0, weight=8.0, sha256=SHA)
    cases = {  # each refused, with the reason saying why
        "too heavy": ([ManifestEntry("c1", "u1", 0, 1000.0, SHA)], 1000.0, "a claim allows at most 16"),
        "unknown child": ([honest, ManifestEntry("ghost", "u2", 0, 8.0, SHA)], 16.0, "'ghost', which never joined"),
        "sum": ([honest], 16.0, "sum to 8"),
        "listed twice": ([honest, ManifestEntry("c1", "u3", 0, 8.0, SHA)], 16.0, "twice"),
        "future": ([ManifestEntry("c1", "u1", 5, 8.0, SHA)], 8.0, "after the push's base"),
    }
    for what, (manifest, samples, why) in cases.items():
        j = _push(c, "liar", manifest, samples)
        assert j.outcome is Outcome.REJECTED and why in j.reason, (what, j)
    j = _push(c, "c1", [honest], 8.0)  # a worker is no relay
    assert j.outcome is Outcome.REJECTED and "without joining block 0 as a relay" in j.reason
    assert info_from_pb(c.status().blocks[0].current).version == 0  # nothing of them was applied
    j = _push(c, "liar", [honest], 8.0)  # the honest manifest goes in: the refusals above were not blanket
    assert j.outcome is Outcome.PENDING, j
    deadline = time.monotonic() + 30
    while info_from_pb(c.status().blocks[0].current).version < 1:  # c1 reported through the relay: all reported
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert included(c) == {"u1"}
    j = _push(c, "liar", [ManifestEntry("c1", "u1", 1, 8.0, SHA)], 8.0, base=1)  # the same child update again
    assert j.outcome is Outcome.REJECTED and "already counted" in j.reason
    st = c.status_dict()["blocks"][0]
    assert st["relays"] == [{"name": "liar", "children": ["c1"], "last_version": 0, "last_weight": 8.0, "pushes": 1,
                             "refused": 6}]
    c.close()


def test_a_relay_under_a_relay_flattens_its_children_into_the_manifest(tmp_path, processes):
    # relays of relays cannot pass relay audits (docs/swarm.md): a root that audits makes r1 refuse r2
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "30",
                "--keep", "100", "--relay-audit-rate", "0")
    (upper,) = relays(processes, tmp_path, root, {"r1": []})
    (lower,) = relays(processes, tmp_path, upper, {"r2": []})
    stats = finished(tmp_path, {w: worker(processes, tmp_path, w, lower, 2) for w in ("w0", "w1")})
    c = SwarmClient(root, timeout_s=15)
    assert all(s["not_included"] == [] for s in stats.values())
    assert included(c) == {u for s in stats.values() for u in s["accepted_updates"]}
    root_store = VersionStore(tmp_path / "root", 0)
    assert all(root_store.load(s["version"]).meta["info"]["sha256"] == s["sha256"] for s in stats.values())
    st = c.status_dict()["blocks"][0]
    # the root knows the workers (their joins passed both relays) and sees them in r1's manifests;
    # r2 joined r1 only; neither relay is a replica: the root's rounds wait on the workers r1 reports for
    assert [(r["name"], r["children"]) for r in st["relays"]] == [("r1", ["w0", "w1"])]
    assert not {"r1", "r2"} & set(st["replicas"])
    c.close()


def test_the_swarm_token_is_checked_at_the_relay_and_presented_upstream(tmp_path, processes):
    token = tmp_path / "token"
    token.write_text("relay-token-1\n")

    def secured(name: str, *args: str) -> str:
        port = tmp_path / f"{name}.port"
        proc = start(["--token-file", str(token), "join", "--no-identities", "--audit", "0", *args,  # the token alone
                      "--listen", "127.0.0.1:0", "--port-file", str(port),
                      "--state-dir", str(tmp_path / name), *TINY_SHAPE, *CLAIMS], tmp_path / f"{name}.log")
        processes.append(proc)
        return f"127.0.0.1:{wait_port(port, proc)}"

    root = secured("root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "30")
    relay = secured("r1", "--role", "relay", "--peer", root, "--relay-id", "r1", "--blocks-owned", "0")
    bare = SwarmClient(relay, timeout_s=10)  # no token: refused at the relay itself
    try:
        bare.status()
        raise AssertionError("the relay answered a call without the swarm token")
    except Unauthenticated:
        pass
    bare.close()
    # two rounds: a worker whose first push finds its relay's round closed is LATE once (see the first test)
    w = start(["--token-file", str(token), "join", "--role", "worker", "--peer", relay, "--rounds", "2",
               "--worker-id", "w0", "--stats-file", str(tmp_path / "w0.json"), *TINY_SHAPE, *WORKER],
              tmp_path / "w0.log")
    processes.append(w)
    stats = finished(tmp_path, {"w0": w})
    c = SwarmClient(root, timeout_s=15, security=Security(token="relay-token-1"))
    accepted = set(stats["w0"]["accepted_updates"])
    assert accepted and stats["w0"]["not_included"] == [], stats  # something to check below, whatever the timing
    assert accepted <= included(c)  # the relay's joins and pushes carried its token
    c.close()


def forging_relay(processes, tmp: Path, name: str, cheat: str, parent: str) -> str:
    """A relay process running a test cheat (lab/relay_cheats.py); its address."""
    port = tmp / f"{name}.port"
    with open(tmp / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lab.relay_cheats", cheat, "join", "--role", "relay",
                                 "--peer", parent, "--relay-id", name, "--blocks-owned", "0", "--listen", "127.0.0.1:0",
                                 "--port-file", str(port), "--state-dir", str(tmp / name), *TINY_SHAPE, *CLAIMS],
                                stdout=log, stderr=subprocess.STDOUT, env=lab_env(launch.one_thread_env()))
    processes.append(proc)
    return f"127.0.0.1:{wait_port(port, proc)}"


def event(text: str, name: str, reason: str) -> float:
    m = re.search(rf'btnode_swarm_events_total\{{event="{name}",reason="{reason}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_a_relay_audit_passes_an_honest_relay_and_revokes_one_that_nudges_one_value(tmp_path, processes):
    metrics = free_port()
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "12",
                "--keep", "100", "--relay-audit-rate", "1", "--relay-audit-timeout", "4",
                "--metrics-listen", f"127.0.0.1:{metrics}")
    (honest,) = relays(processes, tmp_path, root, {"r1": []})
    forger_at = len(processes)
    forger = forging_relay(processes, tmp_path, "r2", "nudge", root)  # one coordinate one fp32 step off
    procs = {"w0": worker(processes, tmp_path, "w0", honest, 3), "w1": worker(processes, tmp_path, "w1", honest, 3),
             "w2": worker(processes, tmp_path, "w2", f"{forger},{honest}", 3),  # the honest relay is their spare
             "w3": worker(processes, tmp_path, "w3", f"{forger},{honest}", 3)}
    stats = finished(tmp_path, procs, timeout=300)
    c = SwarmClient(root, timeout_s=15)
    went_in = included(c)
    # the honest relay's children are in the versions, every one of their accepted updates
    for w in ("w0", "w1"):
        assert stats[w]["not_included"] == [] and set(stats[w]["accepted_updates"]) <= went_in, stats[w]
    # the forging relay's children lost what it took: its drawn push was held, its evidence did not recombine to
    # what it pushed, it was revoked, its next push was refused and it stopped; they moved to the spare, and
    # what they pushed there went in
    lost = {u for w in ("w2", "w3") for u in stats[w]["not_included"]}
    assert lost and not lost & went_in, stats
    assert all(set(stats[w]["accepted_updates"]) - lost <= went_in for w in ("w2", "w3")), stats
    assert any(set(stats[w]["accepted_updates"]) & went_in for w in ("w2", "w3")), stats
    text = scrape(metrics)
    assert event(text, "relay_audits", "passed") >= 1, text
    assert event(text, "relay_audits", "evidence") >= 1, text  # (an amendment of its round may be drawn and fail too)
    assert event(text, "revoked", "relay_evidence") == 1, text
    assert event(text, "evidence_refused", "evidence") >= 1, text
    st = c.status_dict()["blocks"][0]
    records = {r["name"]: r for r in st["relays"]}
    assert records["r1"]["refused"] == 0 and records["r1"]["pushes"] >= 3, records
    assert records["r2"]["pushes"] == 0 and records["r2"]["refused"] >= 1, records
    # refused as revoked, the forger stopped by itself (nobody signalled it); r1's passed audits took its evidence
    assert processes[forger_at].wait(timeout=60) == 0
    c.close()


def test_workers_under_mutual_tls_join_and_push_through_a_relay_with_signed_receipts(tmp_path, processes):
    pki = tmp_path / "pki"
    init_ca(pki / "ca")
    admit(pki / "ca", "root", role=Role.AGGREGATOR, hosts=("127.0.0.1",), out=pki)
    admit(pki / "ca", "r1", role=Role.RELAY, hosts=("127.0.0.1",), out=pki)
    for name in ("w0", "w1", "op"):
        admit(pki / "ca", name, role=Role.OPERATOR if name == "op" else Role.WORKER, out=pki)

    def tls(name: str, server: bool) -> dict[str, str]:
        return {"BTNODE_TLS_CERT": str(pki / f"{name}.pem"), "BTNODE_TLS_KEY": str(pki / f"{name}.key"),
                "BTNODE_TLS_CA": str(pki / "ca" / "ca.pem"), **({"BTNODE_TLS_CLIENT_AUTH": "1"} if server else {})}

    def run(name: str, args: list[str], server: bool) -> subprocess.Popen:
        proc = launch.spawn_node([*args, *TINY_SHAPE, *CLAIMS], log=tmp_path / f"{name}.log",
                                 env=launch.one_thread_env(**tls(name, server)))
        processes.append(proc)
        return proc

    def served(name: str, args: list[str]) -> str:
        port = tmp_path / f"{name}.port"
        proc = run(name, ["join", *args, "--listen", "127.0.0.1:0", "--port-file", str(port), "--state-dir",
                          str(tmp_path / name)], server=True)
        return f"127.0.0.1:{wait_port(port, proc)}"

    root = served("root", ["--role", "aggregator", "--blocks-owned", "0", "--deadline", "20", "--keep", "100",
                           "--relay-audit-rate", "1", "--audit", "0"])  # replays would pass each child on
    relay = served("r1", ["--role", "relay", "--peer", root, "--relay-id", "r1", "--blocks-owned", "0"])
    procs = {w: run(w, ["join", "--role", "worker", "--peer", relay, "--rounds", "2", "--worker-id", w,
                        "--stats-file", str(tmp_path / f"{w}.json"), "--warmup", "1", "--block", "0"], server=False)
             for w in ("w0", "w1")}
    stats = finished(tmp_path, procs)
    c = SwarmClient(root, timeout_s=15, security=Security(cert=pki / "op.pem", key=pki / "op.key",
                                                          ca=pki / "ca" / "ca.pem"))
    went_in = included(c)
    for w, s in stats.items():  # every accepted update of theirs, carried by r1 with their signatures, went in
        assert s["not_included"] == [] and s["accepted_updates"] and set(s["accepted_updates"]) <= went_in, (w, s)
    identities = {r["name"]: r for r in c.status_dict()["identities"]}
    assert {w: (identities[w]["role"], identities[w]["joined"]) for w in ("w0", "w1")} == {
        "w0": ("worker", [0]), "w1": ("worker", [0])}  # admitted by their own signed joins, passed on by r1
    # r1's drawn pushes were held for their audit (PROBATION, counted in its record) and passed; nothing refused
    assert identities["r1"]["role"] == "relay" and set(identities["r1"]["refused"]) <= {"probation"}, identities["r1"]
    counted = counters(c)
    assert counted.get(("relay_audits", "passed"), 0) >= 1, counted  # audited too: its children's frames recombine
    assert not [k for k in counted if k[0] == "identity_refused"], counted  # no signature (nor identity) refused
    c.close()


def test_an_auditing_root_replays_the_updates_of_workers_behind_a_relay(tmp_path, processes):
    """A root with --audit 0.5 --probation 1 and workers behind a relay: every child update is committed
    at the root before the relay counts it; each worker's first one (probation) and the drawn ones go up
    as they came and are replayed there, the others go up combined with the root's commit tokens."""
    root = node(processes, tmp_path, "root", "--role", "aggregator", "--blocks-owned", "0", "--deadline", "20",
                "--keep", "100", "--audit", "0.5", "--probation", "1")
    (relay,) = relays(processes, tmp_path, root, {"r1": []})
    stats = finished(tmp_path, {w: worker(processes, tmp_path, w, relay, 4) for w in ("w0", "w1")}, timeout=240)
    c = SwarmClient(root, timeout_s=15)
    deadline = time.monotonic() + 60
    while True:  # the last replays may still run after the workers exit
        status = c.status_dict()
        events = {(x["name"], x["labels"].get("reason", "")): x["value"] for x in status["counters"]}
        audited = {r["name"]: (r["audited"], r["failed"]) for r in status["identities"] if r["name"] != "r1"}  # workers
        if sum(a for a, _ in audited.values()) >= events.get(("draws", "drawn"), 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    drawn, committed = events.get(("draws", "drawn"), 0), events.get(("draws", "committed"), 0)
    pushed = sum(sum(s["outcomes"].values()) for s in stats.values())
    assert drawn >= 2 and drawn + committed == pushed, (events, stats)  # each push committed once (no re-push here)
    assert audited == {"w0": (audited["w0"][0], 0), "w1": (audited["w1"][0], 0)}  # replayed, none failed
    assert sum(a for a, _ in audited.values()) == drawn  # every drawn update replayed, bit for bit
    for name, s in stats.items():
        assert s["not_included"] == [] and set(s["outcomes"]) <= {"pending", "probation", "late"}, (name, s)
    assert {u for s in stats.values() for u in s["accepted_updates"]} <= included(c)
    assert not [r["name"] for r in status["identities"] if r["revoked_at_unix"]], status["identities"]
    assert not [k for k in events if k[0] == "revoked" or k[1] == "uncommitted"], events
    assert not [k for k in events if k[0] == "relay_uncounted"], events  # every committed update went in
    if committed:  # (p = 0.5 over 6 draws: 1 run in 32 draws every one of them, and no combined push carries one)
        (record,) = status["blocks"][0]["relays"]
        assert record["pushes"] >= 1 and record["refused"] == 0
    c.close()
