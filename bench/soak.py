"""Soak run (issue #7): a local swarm (aggregator + 3 blocks × 2 replicas, each its own process on
loopback) trains for --minutes while a random worker is killed with SIGKILL and restarted about
every 30 s, and the aggregator is killed with SIGKILL and restarted a few times. Reports the
versions reached, the fraction of updates accepted (summed from the round records of every stored
version, so that restarts lose nothing), the number of stored versions whose hash does not
verify (must be 0), and RSS over time. Writes bench/results/soak.json and a BENCHMARKS.md row.

    .venv/bin/python -m bench.soak                 # 10 minutes
    .venv/bin/python -m bench.soak --minutes 1     # a smoke run
    .venv/bin/python -m bench.soak --minutes 30 --audit 0.25   # honest workers under replay audits
                                                   # (bench/results/soak_audit.json): must flag nobody
    .venv/bin/python -m bench.soak --relays 2      # workers through 2 relays (each worker's spare is the
                                                   # other), relays killed too (bench/results/soak_relays.json)
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench.flags import QUICK_SHAPE, BenchParser, shape_flags
from bench.report import Progress, previous, publish, result_path, table
from bench.runs import Metric
from btnode.node.launch import one_thread_env, spawn_node, start_node, stop_processes

WORKERS = [(b, r) for b in range(3) for r in range(2)]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--worker-kill-every", type=float, default=30.0, help="mean seconds between worker kills")
    ap.add_argument("--aggregator-kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--audit", type=float, default=0.0, help="share p of updates the aggregator replays (with "
                                                              "probation 2): the run reports who was flagged")
    ap.add_argument("--relays", type=int, default=0, help="workers reach the aggregator through this many relays "
                                                          "(worker r of a block on relay r mod K, the next as its spare); "
                                                          "a relay is killed and restarted as often as a worker")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep its state and logs (default: a temporary one)")
    ap.add_argument("--report-only", action="store_true", help="recompute the summary and the report from soak.json")
    ap.add_argument("--out", dest="results", type=Path, metavar="PATH",
                    help="where the result JSON goes (default bench/results/soak.json, soak_audit.json with --audit; any "
                         "other path leaves BENCHMARKS.md alone)")
    args = ap.parse_args()
    setting = "audit" if args.audit else "relays" if args.relays else "default"
    if args.report_only:
        out = previous(result_path("soak", setting))
        out["rss_growth_mb"] = rss_growth(out["rss"], [e["t"] for e in out["events"] if e["event"] == "kill -9 aggregator"])
        publish("soak", out, metrics(out), render, out=result_path("soak", setting))
        return
    if args.results is None:
        args.results = result_path("soak", setting, quick=args.minutes < (30 if args.audit else 10))  # a smoke run never
        # replaces the published one
    rng = random.Random(args.seed)
    port = free_port()
    env = one_thread_env()
    shape = shape_flags(QUICK_SHAPE)
    duration = args.minutes * 60
    agg_kills = sorted(rng.uniform(0.15, 0.85) * duration for _ in range(args.aggregator_kills))
    with tempfile.TemporaryDirectory(prefix="btnode-soak-") as tmp:
        work = args.keep or Path(tmp)
        state = work / "state"
        logs = work / "logs"
        logs.mkdir()

        training = ["--steps-per-round", "5", "--batch", "8"]  # the workers', which the aggregator checks claims by
        aggregator = ["join", "--role", "aggregator", "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
                      "--deadline", "10", "--keep", "100000", *training, *shape,
                      "--no-identities", "--audit", "0"]  # as measured before #38's defaults (identities, audits); docs/security.md for the defaults' costs
        if args.audit:
            aggregator += ["--audit", str(args.audit), "--probation", "2"]

        def start_aggregator() -> subprocess.Popen:  # a restart does not wait for the port
            return spawn_node(aggregator, log=logs / "aggregator.log", env=env)

        relay_ports = [free_port() for _ in range(args.relays)]

        def relay_command(j: int) -> list[str]:
            return ["join", "--role", "relay", "--relay-id", f"relay{j}", "--peer", f"127.0.0.1:{port}",
                    "--listen", f"127.0.0.1:{relay_ports[j]}", "--state-dir", str(work / f"relay{j}"), *training, *shape]

        def peers(r: int) -> str:
            if not args.relays:
                return f"127.0.0.1:{port}"
            first = r % args.relays
            order = [relay_ports[(first + k) % args.relays] for k in range(min(2, args.relays))]
            return ",".join(f"127.0.0.1:{p}" for p in order)

        def start_worker(b: int, r: int) -> subprocess.Popen:
            return spawn_node(["join", "--role", "worker", "--block", str(b), "--peer", peers(r),
                               "--worker-id", f"b{b}r{r}", *training, "--warmup", "10", *shape], log=logs / f"b{b}r{r}.log", env=env)

        def start_relay(j: int) -> subprocess.Popen:
            return spawn_node(relay_command(j), log=logs / f"relay{j}.log", env=env)

        agg = start_node(aggregator, port_file=work / "port", log=logs / "aggregator.log", env=env,
                         name="aggregator").proc
        relays = {j: start_relay(j) for j in range(args.relays)}
        workers = {w: start_worker(*w) for w in WORKERS}
        events: list[dict] = []
        samples: list[dict] = []
        t0 = time.monotonic()
        next_worker_kill = rng.expovariate(1 / args.worker_kill_every)
        next_sample = 0.0
        progress = Progress(int(duration), "soak", "s")
        try:
            while (now := time.monotonic() - t0) < duration:
                if agg_kills and now >= agg_kills[0]:
                    agg_kills.pop(0)
                    agg.send_signal(signal.SIGKILL)
                    agg.wait()
                    events.append({"t": now, "event": "kill -9 aggregator"})
                    agg = start_aggregator()
                if now >= next_worker_kill and relays and rng.random() < 0.5:
                    j = rng.randrange(args.relays)
                    relays[j].send_signal(signal.SIGKILL)
                    relays[j].wait()
                    events.append({"t": now, "event": f"kill -9 relay{j}"})
                    relays[j] = start_relay(j)
                    next_worker_kill = now + rng.expovariate(1 / args.worker_kill_every)
                if now >= next_worker_kill:
                    w = rng.choice(WORKERS)
                    workers[w].send_signal(signal.SIGKILL)
                    workers[w].wait()
                    events.append({"t": now, "event": f"kill -9 worker b{w[0]}r{w[1]}"})
                    workers[w] = start_worker(*w)
                    next_worker_kill = now + rng.expovariate(1 / args.worker_kill_every)
                for w, p in list(workers.items()):  # a worker that gave up (e.g. aggregator away too long)
                    if p.poll() is not None:
                        events.append({"t": now, "event": f"worker b{w[0]}r{w[1]} exited {p.returncode}; restarted"})
                        workers[w] = start_worker(*w)
                for j, p in list(relays.items()):
                    if p.poll() is not None:
                        events.append({"t": now, "event": f"relay{j} exited {p.returncode}; restarted"})
                        relays[j] = start_relay(j)
                if agg.poll() is not None:
                    events.append({"t": now, "event": f"aggregator exited {agg.returncode}; restarted"})
                    agg = start_aggregator()
                if now >= next_sample:
                    samples.append({"t": round(now, 1), "aggregator_mb": rss_mb(agg.pid),
                                    "workers_mb": [rss_mb(p.pid) for p in workers.values()]})
                    next_sample = now + 15
                progress(int(now))
                time.sleep(0.2)
        finally:
            stop_processes([*workers.values(), *relays.values(), agg], timeout_s=60)
        result = audit(state)
        if args.audit:
            result.update(audits(state, logs / "aggregator.log"))
    wall = time.monotonic() - t0
    agg_series = [s["aggregator_mb"] for s in samples if s["t"] >= 60]
    worker_series = [max(s["workers_mb"]) for s in samples if s["t"] >= 60]
    out = {"minutes": wall / 60, "audit": args.audit, **result, "events": events, "rss": samples,
           "rss_growth_mb": rss_growth(samples, [e["t"] for e in events if e["event"] == "kill -9 aggregator"]),
           "worker_rss_max_mb": max(worker_series) if worker_series else None,
           "aggregator_rss_max_mb": max(agg_series) if agg_series else None,
           "worker_kills": sum("worker" in e["event"] and "kill" in e["event"] for e in events),
           "relays": args.relays, "relay_kills": sum(e["event"].startswith("kill -9 relay") for e in events),
           "aggregator_kills": sum(e["event"] == "kill -9 aggregator" for e in events)}
    publish("soak", out, metrics(out), render, out=args.results)
    print(json.dumps({k: v for k, v in out.items() if k not in ("events", "rss")}, indent=1))


def audits(state: Path, log: Path) -> dict:
    """What the replay audits decided over every aggregator incarnation: from its log (appended
    across restarts) and the revocations it keeps in the state folder."""
    text = log.read_text(errors="replace")
    revoked_file = state / "revoked.json"
    revoked = sorted(json.loads(revoked_file.read_text())["revoked"]) if revoked_file.exists() else []
    return {"audits_passed": len(re.findall(r"audit of \S+ update on version \d+ passed", text)),
            "audits_failed": len(re.findall(r"worker \S+ revoked \(", text)),
            "flagged": revoked, "false_positives": len(revoked)}


def metrics(res: dict) -> dict[str, Metric]:
    """How long, how many kills, versions failing their hash, updates accepted, memory growth."""
    out: dict[str, Metric] = {"minutes": res["minutes"], "corrupt versions": res["corrupt_versions"],
                              "accepted share": res["accept_fraction"], "worker kills": res["worker_kills"]}
    out.update({"relay kills": res["relay_kills"]} if "relay_kills" in res else {})
    out.update({"aggregator kills": res["aggregator_kills"], "RSS growth (MB)": res["rss_growth_mb"],
                "aggregator peak RSS (MB)": res["aggregator_rss_max_mb"]})
    out.update({"audits failed": res["audits_failed"], "false positives": res["false_positives"]} if "audits_failed" in res else {})
    return out


def render(out: dict) -> str:
    if "flagged" in out:
        return render_audit(out)
    if out.get("relays"):
        return render_relays(out)
    return "\n".join([
        "## Soak run (`bench/soak.py`)", "",
        "Command: `.venv/bin/python -m bench.soak` (2 cores). A local swarm (aggregator + 3 blocks × 2 replicas, "
        "tiny model d=32, H = 5, τ = 10 s) on loopback; a random worker killed with SIGKILL and restarted about "
        "every 30 s, the aggregator killed with SIGKILL and restarted at random times. Accepted fraction: summed "
        "over the round records of every stored version. RSS: the aggregator's, sampled every 15 s after the "
        "first minute; growth = within one aggregator incarnation (restarts reset RSS), last sample − first sample "
        "taken 60 s after it started, the largest over incarnations.", "",
        *table(["minutes", "worker kills", "aggregator kills", "versions (min over blocks)", "accepted fraction",
                "versions failing their hash", "aggregator RSS growth (MB)", "aggregator / worker RSS max (MB)"],
               [(f"{out['minutes']:.1f}", out["worker_kills"], out["aggregator_kills"], out["versions_min"],
                 f"{out['accept_fraction']:.3f}", out["corrupt_versions"], f"{out['rss_growth_mb']:.1f}",
                 f"{out['aggregator_rss_max_mb']:.0f} / {out['worker_rss_max_mb']:.0f}")], "rrrrrrrl")])


def render_relays(out: dict) -> str:
    return "\n".join([
        "## Soak run through relays (`bench/soak.py --relays`)", "",
        f"Command: `.venv/bin/python -m bench.soak --minutes {out['minutes']:.0f} --relays {out['relays']}` (2 cores). "
        "The soak swarm above with every worker reaching the aggregator through a relay (worker r on relay "
        "r mod K, the next relay as its spare): workers, relays and the aggregator killed with SIGKILL and "
        "restarted at random times. Accepted fraction: at the root, over the round records of every stored "
        "version (a relay's combined push counts each child it lists).", "",
        *table(["minutes", "worker kills", "relay kills", "aggregator kills", "versions (min over blocks)",
                "accepted fraction", "versions failing their hash", "aggregator RSS max (MB)"],
               [(f"{out['minutes']:.1f}", out["worker_kills"], out["relay_kills"], out["aggregator_kills"],
                 out["versions_min"], f"{out['accept_fraction']:.3f}", out["corrupt_versions"],
                 f"{out['aggregator_rss_max_mb']:.0f}")], "rrrrrrrr")])


def render_audit(out: dict) -> str:
    return "\n".join([
        "## Honest soak under replay audits (`bench/soak.py --audit`)", "",
        f"Command: `.venv/bin/python -m bench.soak --minutes {out['minutes']:.0f} --audit {out['audit']}` (2 cores). "
        "The soak swarm above (3 blocks × 2 honest replicas, workers killed with SIGKILL and restarted, the "
        "aggregator killed and restarted) with the aggregator replaying a share p of updates and every new "
        "worker id on probation for 2 audits. A flag is a revocation (revoked.json): every one is a false "
        "positive here.", "",
        *table(["minutes", "worker kills", "aggregator kills", "versions (min over blocks)", "audits passed",
                "audits failed", "false positives", "versions failing their hash"],
               [(f"{out['minutes']:.1f}", out["worker_kills"], out["aggregator_kills"], out["versions_min"],
                 out["audits_passed"], out["audits_failed"], out["false_positives"], out["corrupt_versions"])],
               "rrrrrrrr")])


def rss_growth(samples: list[dict], restarts: list[float], settle_s: float = 60.0) -> float:
    """The aggregator's RSS growth within one incarnation (restarts reset RSS): for each, the last
    sample minus the first one taken `settle_s` after it started; the largest over incarnations."""
    bounds = [0.0, *restarts, float("inf")]
    growth = 0.0
    for start, end in zip(bounds, bounds[1:]):
        xs = [s["aggregator_mb"] for s in samples if start + settle_s <= s["t"] < end]
        if len(xs) >= 2:
            growth = max(growth, xs[-1] - xs[0])
    return growth


def audit(state: Path) -> dict:
    """Every stored version of every block: does it verify? And the round records' outcome counts."""
    from btnode.errors import BtnodeError
    from btnode.store.files import state_sha256
    from btnode.store.versions import VersionStore

    newest, corrupt, checked = [], 0, 0
    counts = {"accepted": 0, "late": 0, "stale": 0, "rejected": 0}
    for b in range(3):
        store = VersionStore(state, b, keep=100000)
        versions = store.versions()
        newest.append(max(versions) if versions else 0)
        for v in versions:
            checked += 1
            try:
                stored = store.load(v)
                ok = state_sha256(stored.params) == stored.meta["info"]["sha256"]
            except (BtnodeError, OSError, KeyError, ValueError):
                ok = False
            corrupt += not ok
            if ok and v > 0:
                for k in counts:
                    counts[k] += stored.meta["info"][k]
    total = sum(counts.values())
    return {"versions_min": min(newest), "versions": newest, "versions_checked": checked, "corrupt_versions": corrupt,
            "outcomes": counts, "accept_fraction": counts["accepted"] / total if total else 0.0}


if __name__ == "__main__":
    main()
