"""A swarm of a thousand (issue #25, item 4): one real aggregator process (`btnode join --role
aggregator`), optionally real relays (`btnode join --role relay`), and N simulated workers that
speak the real protocol (bench/swarmlet.py: real int8 frames of a real block, no training), at
N ∈ {16, 64, 256, 1024}, flat (workers → root) and through a tree of relays.

Per row: the root's peak RSS (VmHWM) and CPU seconds from /proc, a relay's peak RSS, the round
close time (last push accepted → version published, from the root's JSON log), the root's ingress
and egress per round (its /metrics transfer counters, the joins' full pulls left out), updates lost
(a worker was told ACCEPTED, and the version of that round counts fewer accepted updates than
workers were told so; must be 0), refused calls, pulls served, and the largest gap between the
root's systemd watchdog keep-alives (it runs with NOTIFY_SOCKET on a datagram socket this bench
reads and WATCHDOG_USEC set). `--kill` adds a run where simulated-worker processes (and relays)
are SIGKILLed at random mid-round.

All simulated workers share 127.0.0.1, so the root's per-IP limits are raised to N (one host here
stands for N hosts); that is stated in each row's command.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.flags import BenchParser, shape_flags
from bench.report import ROOT, invoked, is_published, module_command, previous, publish, pyplot, result_path, shown, table
from bench.runs import RESULTS, Metric, load
from btnode.data.identity import BUNDLED
from btnode.model.config import ModelConfig
from btnode.node.launch import CLI, NodeProcess, one_thread_env, spawn_node, start_node, stop_processes, wait_port

# The project's default shape, block 0 small: a wider block (--d-model 256) is too slow on a small host at the
# largest N (bench/results/scale/tree-r16-d256.json); memory per update still shows at this one.
SHAPE = ModelConfig()
QUICK_SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
SIZES = (16, 64, 256, 1024)
BATCH, LR, H = 8, 2e-3, 4  # the claims the simulated workers make (and the root checks)
WORKERS_PER_PROCESS = 128
UNIT_SHAPE, UNIT_N = ModelConfig(d_model=1024, n_heads=16, n_layers=2, n_blocks=3, context=128), 8
MAX_RELAYS = 16  # at N = 1,024: 16 relays of 64 (32 of 32 would need ~21 GB for the relays alone)
WATCHDOG_USEC = 2_000_000  # keep-alives every 1 s (half of it), as systemd asks
MB = 2**20


@dataclass
class Notifications:
    """sd_notify datagrams a node sends to a socket this process binds: (time, text) each."""

    path: Path
    got: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path.unlink(missing_ok=True)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.got.append((time.time(), data.decode(errors="replace")))

    def max_gap(self, until: float) -> float:
        """The largest gap between WATCHDOG=1 messages, and from the last one to `until`."""
        pings = [t for t, text in self.got if "WATCHDOG=1" in text.split("\n")]
        if not pings:
            return math.inf
        return max([b - a for a, b in zip(pings, pings[1:])] + [until - pings[-1]])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def proc_stats(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB from VmHWM, CPU seconds user + system) of a live process."""
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return hwm / 1024, cpu


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A node's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, lb), v in m.items() if n == name and all((k, x) in lb for k, x in labels.items()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RootLog:
    """From the root's JSON log: round v → the time of its last accepted update, version → the time it was
    published and what closed its round (all_reported, deadline, drain), and the (round, sender) pairs the
    screen dropped at close (told ACCEPTED on arrival, counted rejected by the version: not lost)."""

    accepted: dict[int, float] = field(default_factory=dict)
    published: dict[int, float] = field(default_factory=dict)
    closed_by: dict[int, str] = field(default_factory=dict)
    dropped: set[tuple[int, str]] = field(default_factory=set)


def json_log_times(log: Path) -> RootLog:
    out = RootLog()
    accepted, published, closed_by = out.accepted, out.published, out.closed_by
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        msg = rec.get("msg", "")
        t = time.mktime(time.strptime(rec["ts"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone + float(rec["ts"][19:-1] or 0)
        if m := re.search(r"round (\d+): (?:accepted|took) the", msg):
            accepted[int(m[1])] = max(accepted.get(int(m[1]), 0.0), t)
        elif m := re.search(r"version (\d+) published \((\w+)", msg):
            published[int(m[1])], closed_by[int(m[1])] = t, m[2]
        elif m := re.search(r"round (\d+): dropping the update of (\S+) at close", msg):
            out.dropped.add((int(m[1]), m[2]))
    return out


def shape_of(args_quick: bool, d_model: int = 0) -> ModelConfig:
    """The block the rows push: the tiny one (`--quick`), the default, or the default at another width
    (`--d-model`: the same heads, layers and context, so only the unit's size changes)."""
    if args_quick:
        return QUICK_SHAPE
    return replace(SHAPE, d_model=d_model) if d_model else SHAPE


def per_peer_flags(n: int) -> list[str]:
    """The root's per-IP limits raised to what N workers on one IP need (every simulated worker is on
    127.0.0.1 here; N hosts would each hold one), for the limits this code declares; the global
    budgets (--max-workers, --max-transfers) stay at their defaults."""
    from btnode.rpc.limits import PeerLimits
    from btnode.settings import declared

    have = {d.flag.name for d in declared(PeerLimits)}
    wanted = {"--max-streams-per-peer": max(8, n), "--max-watches-per-peer": max(64, n),
              "--max-joins-per-minute": max(30, 2 * n), "--max-relay-joins-per-minute": max(600, 2 * n)}
    return [x for name, value in wanted.items() if name in have for x in (name, str(value))]


def root_command(cfg: ModelConfig, out: Path, n: int, metrics_port: int, deadline: float) -> list[str]:
    return [*CLI, "--log-format", "json", "join", "--role", "aggregator", "--listen", "127.0.0.1:0",
            "--state-dir", str(out / "root"), "--blocks-owned", "0", "--deadline", str(deadline), "--keep", "2",
            "--metrics-listen", f"127.0.0.1:{metrics_port}", *per_peer_flags(n),
            "--batch", str(BATCH), "--lr", str(LR), "--steps-per-round", str(H), *shape_flags(cfg),
            # the load alone, as before #38's defaults: simulated workers have no certificates and send no work
            # a replay could check (a lever's --audit, later on the line, wins)
            "--no-identities", "--audit", "0", "--link", "lan"]  # int8 up, fp32 down, as the rows before --link wan


def events(folder: Path) -> list[dict]:
    """Every simulated worker's events, each with `src`: the number of the swarmlet process it came from."""
    out = []
    for f in sorted(folder.glob("events-*.jsonl")):
        src = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            try:
                out.append({**json.loads(line), "src": src})
            except ValueError:  # a line cut short by a SIGKILL
                pass
    return out


def relays_for(n: int) -> int:
    """Relays in the tree of N workers: √N rounded to a power of two, at most MAX_RELAYS (each is a
    Python + torch process of ~650 MB here, and they share this host's 23 GB with the rest)."""
    return min(MAX_RELAYS, 2 ** round(math.log2(math.sqrt(n))))


def relay_command(cfg: ModelConfig, out: Path, j: int, parent: str, children: int) -> list[str]:
    return [*CLI, "--log-format", "json", "join", "--role", "relay", "--peer", parent, "--listen", "127.0.0.1:0",
            "--relay-id", f"relay-{j:02d}", "--state-dir", str(out / f"relay-{j:02d}"), "--blocks-owned", "0",
            *per_peer_flags(children), "--batch", str(BATCH), "--lr", str(LR), "--steps-per-round", str(H),
            *shape_flags(cfg)]


def start_relays(cfg: ModelConfig, out: Path, n: int, parents: list[str], count: int = 0,
                 first: int = 0) -> tuple[list[NodeProcess], list[str]]:
    """√N relays (or `count`), relay j under parents[j mod len(parents)], numbered from `first`, started
    together; returns them (once all listen) and the first one's command."""
    r = count or relays_for(n)
    ids = range(first, first + r)
    cmds = [relay_command(cfg, out, j, parents[i % len(parents)], math.ceil(n / r)) for i, j in enumerate(ids)]
    procs = [spawn_node([*c[len(CLI):], "--port-file", str(out / f"relay-{j:02d}.port")], log=out / f"relay-{j:02d}.log",
                        env=one_thread_env()) for j, c in zip(ids, cmds)]
    try:
        ports = [wait_port(out / f"relay-{j:02d}.port", p, timeout_s=600, name=f"relay {j}") for j, p in zip(ids, procs)]
    except BaseException:
        stop_processes(procs, timeout_s=5)
        raise
    return [NodeProcess(p, port, out / f"relay-{j:02d}.log") for j, p, port in zip(ids, procs, ports)], cmds[0]


def start_swarmlets(cfg: ModelConfig, out: Path, n: int, peers: list[str], rounds: int, deadline: float, *,
                    processes: int = 1, data_id: str = "", race: bool = False) -> list[subprocess.Popen]:
    """N simulated workers in WORKERS_PER_PROCESS-sized processes (at least `processes` of them)."""
    k = max(processes, math.ceil(n / WORKERS_PER_PROCESS))
    per = math.ceil(n / k)
    sims = []
    for i in range(k):
        first, count = i * per, min(per, n - i * per)
        sim = module_command("bench.swarmlet", "--peer", ",".join(peers), "--config", json.dumps(cfg.to_dict()),
                             "--first", str(first), "--count", str(count), "--rounds", str(rounds),
                             "--batch", str(BATCH), "--lr", str(LR), "--h", str(H), "--wait", str(4 * deadline),
                             "--events", str(out / f"events-{i}.jsonl"), "--ready", str(out / f"ready-{i}"),
                             "--go", str(out / "go"), "--data-id", data_id, *(["--race"] if race else []))
        with open(out / f"swarmlet-{i}.log", "ab") as log:
            sims.append(subprocess.Popen(sim, stdout=log, stderr=subprocess.STDOUT, env=one_thread_env()))
    return sims


def wait_ready(out: Path, sims: list[subprocess.Popen], timeout_s: float = 900) -> None:
    t0 = time.monotonic()
    while not all((out / f"ready-{i}").exists() for i in range(len(sims))):
        if any(p.poll() is not None for p in sims):
            raise SystemExit(f"a swarmlet exited before its workers joined; see {out}")
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"workers did not join within {timeout_s:.0f} s; see {out}")
        time.sleep(0.2)


def kill_in_round(out: Path, victim: NodeProcess, kill_round: int, children: int, timeout_s: float) -> float:
    """SIGKILL relay `victim` in round `kill_round`, once it has told at least half its `children` that
    their update of that round is accepted (work that only a re-push to a spare can save); returns when."""
    t0, want = time.monotonic(), max(1, children // 2)
    while time.monotonic() - t0 < timeout_s:
        told = {e["worker"] for e in events(out) if e["kind"] == "push" and e.get("version") == kill_round
                and e.get("outcome") in ("pending", "accepted") and e.get("peer") == victim.address()}
        if len(told) >= want:
            break
        time.sleep(0.2)
    victim.proc.send_signal(signal.SIGKILL)
    return time.time()


def run_row(cfg: ModelConfig, n: int, topology: str, out: Path, *, rounds: int, deadline: float,
            kill: bool = False, seed: int = 0, root_args: tuple[str, ...] = (), relays_fixed: int = 0,
            kill_round: int = 0, levels: int = 1, race: bool = False) -> dict:
    """One row: start the root (and relays: `relays_fixed` of them, or √N; with `levels` 2, half as many
    again above them, a relay of relays), N simulated workers, `rounds` rounds; measure. `kill_round`:
    the first workers' relay is SIGKILLed in that round (`kill_in_round`); `race`: its children push
    again while their join at the spare is under way."""
    if out.exists():
        shutil.rmtree(out)  # a row starts from an empty state folder, and reads only its own events
    out.mkdir(parents=True)
    notes = Notifications(out / "notify.sock")
    metrics_port = free_port()
    cmd = [*root_command(cfg, out, n, metrics_port, deadline),  # a relay of relays: not under relay audits
           *(["--relay-audit-rate", "0"] if levels == 2 else []), *root_args]
    env = one_thread_env(NOTIFY_SOCKET=str(notes.path), WATCHDOG_USEC=str(WATCHDOG_USEC))
    root = start_node(cmd[len(CLI):], port_file=out / "root.port", log=out / "root.log", env=env, name="aggregator",
                      timeout_s=300)
    procs: list[subprocess.Popen] = []
    relays: list[NodeProcess] = []
    relay_cmd: list[str] = []
    try:
        lowest: list[NodeProcess] = []  # the relays the workers talk to
        if topology == "tree":
            parents = [root.address()]
            if levels == 2:
                tops, _ = start_relays(cfg, out, n, parents, max(1, (relays_fixed or relays_for(n)) // 2), first=50)
                relays += tops
                parents = [r.address() for r in tops]
            lowest, relay_cmd = start_relays(cfg, out, n, parents, relays_fixed)
            relays += lowest
            procs += [r.proc for r in relays]
        sims = start_swarmlets(cfg, out, n, [r.address() for r in lowest] or [root.address()], rounds, deadline,
                               processes=4 if kill and not kill_round else 1, race=race,
                               data_id=BUNDLED if "--audit" in root_args else "")  # an auditing root's own data
        procs += sims
        wait_ready(out, sims)
        m0 = scrape(metrics_port)
        joins_peak, _ = proc_stats(root.proc.pid)  # the peak so far: joins and their full pulls
        (out / "go").touch()
        t_go = time.time()
        killed: dict[str, list] = {"swarmlet": [], "relay": []}  # swarmlet numbers, relay addresses
        t_kill = None
        if kill_round:
            t_kill = kill_in_round(out, lowest[0], kill_round, math.ceil(n / len(lowest)), 4 * deadline)
            killed["relay"].append(lowest[0].address())
        elif kill:  # a quarter of the swarmlet processes and of the relays, SIGKILLed at one random moment mid-round
            rng = random.Random(seed)
            time.sleep(rng.uniform(1.0, 3.0))
            for i in rng.sample(range(len(sims)), max(1, len(sims) // 4)):
                sims[i].send_signal(signal.SIGKILL)
                killed["swarmlet"].append(i)
            for r in rng.sample(relays, max(1, len(relays) // 4) if relays else 0):
                r.proc.send_signal(signal.SIGKILL)
                killed["relay"].append(r.address())
        for p in sims:
            p.wait(timeout=rounds * 4 * deadline + 120)
        m1 = scrape(metrics_port)
        peak_rss, cpu = proc_stats(root.proc.pid)
        relay_stats = [proc_stats(r.proc.pid) for r in relays if r.proc.poll() is None]
        t_end = time.time()
    finally:
        stop_processes(procs, timeout_s=10)
        root.stop(timeout_s=60)
        notes.close()
    row = summarize(n, topology, out, cmd, m0, m1, peak_rss, cpu, notes.max_gap(t_end), t_go, t_end, killed)
    row["root_peak_rss_joins_mb"] = joins_peak
    row.update(block_fp32_mb=4 * block_params(cfg) / MB, levels=levels if topology == "tree" else 0,
               kill_round=kill_round or None, race_rejoin=race)
    if t_kill is not None:  # the kill's round: from the kill to the next version the root published
        after = [t for t in json_log_times(out / "root.log").published.values() if t > t_kill]
        row["next_version_after_kill_s"] = min(after) - t_kill if after else None
    if relays:
        row.update(relays=len(relays), relay_peak_rss_mb=max(r for r, _ in relay_stats),
                   relay_cpu_s_mean=sum(c for _, c in relay_stats) / len(relay_stats), relay_command=shown(relay_cmd))
    return row


@dataclass
class Tally:
    """What the simulated workers saw, from their event lines."""

    accepted_told: Counter = field(default_factory=Counter)  # round version → pushes answered ACCEPTED
    outcomes: Counter = field(default_factory=Counter)  # push outcome → pushes
    refused: Counter = field(default_factory=Counter)  # call → refusals (each retried)
    refused_reasons: Counter = field(default_factory=Counter)  # "call:reason" (else "call:CODE") → refusals
    rejoined: int = 0  # pushes refused not_joined, joined again and pushed once more
    errors: Counter = field(default_factory=Counter)  # call → calls that failed for good
    published: dict[int, dict] = field(default_factory=dict)  # version → its info's accepted and rejected counts
    accepted_ids: dict[str, tuple[int, str, str, int]] = field(default_factory=dict)  # update id → (src, peer, worker, round)
    included: dict[int, set[str]] = field(default_factory=dict)  # version → the update ids it names (where it does)

    @classmethod
    def of(cls, ev: list[dict]) -> Tally:
        t = cls()
        for e in ev:
            if e["kind"] == "push":
                t.outcomes[e["outcome"]] += 1
                if e["outcome"] in ("pending", "accepted"):
                    t.accepted_told[e["version"]] += 1
                    if "update_id" in e:
                        t.accepted_ids[e["update_id"]] = (e.get("src", -1), e.get("peer", ""), e.get("worker", ""),
                                                          e["version"])
            elif e["kind"] == "refused":
                t.refused[e["call"]] += 1
                t.refused_reasons[f"{e['call']}:{e.get('reason') or e.get('code', '')}"] += 1
            elif e["kind"] == "rejoined":
                t.rejoined += 1
            elif e["kind"] == "version":
                t.published[e["version"]] = {"accepted": e["accepted"], "rejected": e["rejected"]}
                if "included" in e:
                    t.included.setdefault(e["version"], set()).update(e["included"])
            elif e["kind"] == "error":
                t.errors[e["call"]] += 1
        return t

    def lost(self) -> int:
        """Updates a worker was told were accepted that no published version includes. Where versions
        name the update ids they include (VersionInfo.included, through relays too), by id; before that,
        by count: the updates told accepted in round v beyond what version v + 1 counts as accepted (a
        round never published counts 0; an update counted whose worker never heard the answer, killed
        in between, cannot make up for another)."""
        if self.included:
            return len(self.lost_ids())
        return sum(max(0, told - self.published.get(v + 1, {"accepted": 0})["accepted"])
                   for v, told in self.accepted_told.items())


    def screened(self, dropped: set[tuple[int, str]]) -> int:
        """Take out of the told-accepted the updates the root's screen dropped at close (round, worker): they
        are the version's rejected ones, not lost. Returns how many."""
        gone = {u for u, (_, _, worker, v) in self.accepted_ids.items() if (v, worker) in dropped}
        for u in gone:
            v = self.accepted_ids.pop(u)[3]
            self.accepted_told[v] -= 1
        return len(gone)

    def lost_ids(self) -> set[str]:
        """By id: the updates told accepted that no published version includes."""
        return set(self.accepted_ids) - set().union(*self.included.values())

    def lost_by_cause(self, killed_srcs: set[int], killed_peers: set[str]) -> dict[str, int]:
        """Lost updates by what befell them: "worker and relay killed" (the update's worker and the relay
        that accepted it both died, so neither could push it again), or "other" (the ones that count)."""
        causes: Counter = Counter()
        for u in self.lost_ids() if self.included else ():
            src, peer = self.accepted_ids[u][:2]
            causes["worker and relay killed" if src in killed_srcs and peer in killed_peers else "other"] += 1
        return dict(causes)


def summarize(n: int, topology: str, out: Path, cmd: list[str], m0: dict, m1: dict, peak_rss: float, cpu: float,
              gap: float, t_go: float, t_end: float, killed: dict[str, list]) -> dict:
    tally = Tally.of(events(out))
    rl = json_log_times(out / "root.log")
    dropped = tally.screened(rl.dropped)  # in a tree the root screens relays' pushes: none match a worker
    outcomes, refused, errors = tally.outcomes, tally.refused, tally.errors
    accepted_told, published, lost = tally.accepted_told, tally.published, tally.lost()
    last_accept, pub_at, closed_by = rl.accepted, rl.published, rl.closed_by
    closes = {v: pub_at[v + 1] - t for v, t in last_accept.items() if v + 1 in pub_at}
    rounds_done = sorted(v for v in pub_at if v > 0)

    def delta(name: str, **labels: str) -> float:
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    per_round = max(1, len(rounds_done))
    return {
        "n_workers": n, "topology": topology,
        "root_peak_rss_mb": peak_rss,
        "relay_peak_rss_mb": None,
        "close_s": max(closes.values()) if closes else None,
        "close_s_by_round": {str(v): c for v, c in sorted(closes.items())},
        "rounds_published": len(rounds_done),
        "closed_by": {str(v): closed_by[v] for v in rounds_done},
        "root_ingress_mb": delta("btnode_transfer_bytes_total", direction="received", form="wire") / MB / per_round,
        "root_egress_mb": delta("btnode_transfer_bytes_total", direction="sent", form="wire") / MB / per_round,
        "join_egress_mb": metric(m0, "btnode_transfer_bytes_total", direction="sent", form="wire") / MB,
        "lost": lost,
        "dropped_at_close": dropped,
        "accepted_told": sum(accepted_told.values()),
        "published_accepted": sum(published.get(v + 1, {"accepted": 0})["accepted"] for v in accepted_told),
        "outcomes": dict(outcomes),
        "refused": sum(refused.values()),
        "refused_by_call": dict(refused),
        "refused_by_reason": dict(tally.refused_reasons),
        "rejoined": tally.rejoined,
        "errors_by_call": dict(errors),
        "root_limited": {dict(lb).get("reason", ""): v for (nm, lb), v in m1.items()
                         if nm == "btnode_swarm_events_total" and dict(lb).get("event") == "limited"},
        "root_queued": metric(m1, "btnode_swarm_events_total", event="queued"),  # transfers that waited for a slot
        "pulls_served": metric(m1, "btnode_rpc_duration_seconds_count", call="pull"),
        "delta_fetches_served": delta("btnode_rpc_duration_seconds_count", call="fetch_delta"),
        "root_cpu_s": cpu,
        "max_watchdog_gap_s": gap,
        "wall_s": t_end - t_go,
        "killed": {k: len(v) for k, v in killed.items()},
        "lost_by_cause": tally.lost_by_cause(set(killed["swarmlet"]), set(killed["relay"])),
        "command": shown(cmd),
    }


# The projection of docs/scale.md: 10,000 workers training a 1 B-parameter model split in 8 blocks
TARGET_WORKERS, TARGET_PARAMS, TARGET_BLOCKS, LINK_MB_S = 10_000, 1_000_000_000, 8, 100e6 / 8 / 1e6
SPARSE = "sparse2:0.01/sparse8:0.03"  # bench/memory.py --traffic --traffic-codecs: bytes per parameter measured at d = 1024


def projection(res: dict) -> dict | None:
    """The measured numbers carried to TARGET_*, per block and round, per tier: wire MB in and out (bytes per
    parameter of int8 pushes and fp32 deltas measured here, of the sparse codecs by bench/memory.py), seconds
    on a 100 Mbit/s link for the larger direction, CPU to take the updates in (bench/codec_speed.py's push of
    a 130 M-parameter block through a real aggregator: int8, and fp32 for a relay's combined push), RAM
    (the runtime + fixed RSS over the unit × the unit + 32 KB a update; docs/swarm.md's rule) and spill disk
    (each update's raw bytes), and a round's time as its serial link stages plus the ingest CPU. Linear;
    nothing was run at that size."""
    rows = [r for r in current(res) if not r.get("kill") and r["rounds_published"]]
    flat = sorted((r for r in rows if r["topology"] == "flat"), key=lambda r: r["n_workers"])
    tree = sorted((r for r in rows if r["topology"] == "tree"), key=lambda r: r["n_workers"])
    if not flat or res.get("fixed_rss_over_unit") is None:
        return None
    params, big = res["block_params"], flat[-1]
    per_push = big["root_ingress_mb"] * MB / big["n_workers"] / params  # wire bytes per parameter, int8 push
    per_delta = big["root_egress_mb"] * MB / big["n_workers"] / params  # ... fp32 published delta
    push = previous(result_path("codec-speed"))["push"]
    ingest = {c: push[c]["trees"]["this tree"]["push_mbps"] for c in ("int8", "fp32")}  # fp32 MB/s of a push
    mem = previous(result_path("memory")).get("traffic_codecs", {}).get(SPARSE)
    codecs = {"int8 / fp32 (defaults)": (per_push, per_delta), "int8 / int8": (per_push, per_push)}
    if mem:
        b = mem["runs"]["block"]
        codecs["sparse2 1 % / sparse8 3 %"] = (b["bytes_pushed_per_round"] / b["parameters"],
                                               b["bytes_delta_per_fetch"] / b["parameters"])
    p = TARGET_PARAMS / TARGET_BLOCKS
    w = TARGET_WORKERS / TARGET_BLOCKS  # workers per block
    r = round(math.sqrt(w))  # relays per block
    kids = w / r
    combined = (tree[-1]["root_ingress_mb"] * MB / tree[-1]["relays"] / params) if tree else 4.0  # relay → root, B/param
    unit_mb = 4 * p / 1e6

    def ram_gb(updates: float) -> float:
        return (res["idle_rss_mb"] + res["fixed_rss_over_unit"] * unit_mb + updates * 0.032) / 1e3

    out = {"workers": TARGET_WORKERS, "params": TARGET_PARAMS, "blocks": TARGET_BLOCKS, "block_params": p,
           "workers_per_block": w, "relays_per_block": r, "link_mb_s": LINK_MB_S, "ingest_mb_s": ingest,
           "bytes_per_param": {k: {"push": a, "delta": d} for k, (a, d) in codecs.items()},
           "relay_push_bytes_per_param": combined,
           "relay_push_from": "measured at the tree's largest row" if tree else "fp32, as relays push; not measured",
           "rows": [], "rounds": []}
    for name, (up, down) in codecs.items():
        mb_up, mb_down, mb_comb = up * p / 1e6, down * p / 1e6, combined * p / 1e6
        t_int8, t_fp32 = unit_mb / ingest["int8"], unit_mb / ingest["fp32"]  # CPU s to take one update in
        tiers = {"worker": (mb_down, mb_up, None, None, None),
                 "root, flat": (w * mb_up, w * mb_down, w * t_int8, ram_gb(w), w * mb_up / 1e3),
                 "relay": (kids * mb_up + mb_down, mb_comb + kids * mb_down, kids * t_int8, ram_gb(kids),
                           kids * mb_up / 1e3),
                 "root, tree": (r * mb_comb, r * mb_down, r * t_fp32, ram_gb(r), r * mb_comb / 1e3)}
        for tier, (mb_in, mb_out, cpu_s, ram, spill) in tiers.items():
            out["rows"].append({"codecs": name, "tier": tier, "mb_in": mb_in, "mb_out": mb_out,
                                "link_s": max(mb_in, mb_out) / LINK_MB_S, "cpu_s": cpu_s, "ram_gb": ram,
                                "spill_gb": spill})
        link = LINK_MB_S
        flat_s = (w * mb_up + w * mb_down) / link + w * t_int8
        tree_s = (kids * mb_up / link + kids * t_int8 + mb_comb / link + r * mb_comb / link + r * t_fp32
                  + r * mb_down / link + kids * mb_down / link)
        out["rounds"].append({"codecs": name, "flat_s": flat_s, "tree_s": tree_s})
    return out


def render(res: dict) -> str:
    def f(x: object, spec: str = ",.1f") -> str:
        return "—" if x is None else format(x, spec)

    rows = res["rows"]
    lines = [
        "## A swarm of a thousand (`bench/scale.py`)",
        "",
        f"Latest command: `{res['command']}` ({res['date']}, {res['machine']}). {res['setup']} Each row names the "
        "code it ran (the last commit touching btnode/ or cli/); `before` rows are main before issue #25's work. "
        "close = the root's last accepted push → that round's version published (the root's log); root in/out = "
        "wire bytes of its tensor streams per round (joins' full pulls left out); lost = updates a worker was told "
        "were accepted that no published version includes (by update id where versions name them); refused = "
        "refused calls the simulated workers retried; CPU = the root's user + system seconds for the whole row; "
        "the watchdog gap is the largest between the root's WATCHDOG=1 datagrams (WatchdogSec 2 s).",
        "",
        *table(["code", "N", "topology", "root peak RSS MB", "relay peak RSS MB", "close s", "root in MB/round",
                "root out MB/round", "lost", "refused", "max watchdog gap s", "root CPU s", "rounds", "closed by"],
               [(r.get("code", ""), r["n_workers"],
                 r["topology"] + (f" ({r['relays']} relays)" if r.get("relays") else "")
                 + (f" + kills {r['killed']}" if r.get("kill") else ""),
                 f(r["root_peak_rss_mb"], ",.0f"), f(r.get("relay_peak_rss_mb"), ",.0f"), f(r["close_s"], ".2f"),
                 f(r["root_ingress_mb"]), f(r["root_egress_mb"]), r["lost"], r["refused"],
                 f(r["max_watchdog_gap_s"], ".2f"), f(r["root_cpu_s"], ",.0f"), r["rounds_published"],
                 ", ".join(sorted(set(r.get("closed_by", {}).values()))) or "—") for r in rows],
               "llrrrrrrrrrrrl"),
        "",
        f"Block: {res['block_params']:,} parameters, **{res['block_fp32_mb']:.1f} MB** in fp32. Root RSS fitted over "
        f"the latest code's flat rows: **{f(res.get('per_update_mb'), '.2f')} MB per extra worker**; fixed RSS above an "
        f"idle Python + torch + btnode process ({(res.get('unit_row') or res).get('idle_rss_mb', res['idle_rss_mb']):,.0f} MB, "
        f"measured in that run) over the block's fp32 size, from "
        f"{res.get('fixed_rss_from', '')}: **fixed_rss_over_unit = {f(res['fixed_rss_over_unit'], '.1f')}**."
        + (f" Unit row: root peak RSS {res['unit_row']['root_peak_rss_mb']:,.0f} MB (by the end of the joins' full "
           f"pulls: {f(res['unit_row'].get('root_peak_rss_joins_mb'), ',.0f')} MB) with a "
           f"{4 * res['unit_row']['block_params'] / MB:,.0f} MB block, close {f(res['unit_row']['close_s'], '.2f')} s, "
           f"lost {res['unit_row']['lost']}; root `{res['unit_row']['command']}`." if res.get("unit_row") else ""),
        "",
        "![root RSS and close time against N](bench/results/scale.png)",
        "",
        "Each row's command (the bench run, then the root it started; a tree row's relays as its first relay):",
        "",
        *[f"- {r.get('code', '')} N={r['n_workers']} {r['topology']}{' kill run' if r.get('kill') else ''}: "
          f"`{r.get('bench_command', '')}`; root `{r['command']}`"
          + (f"; relay `{r['relay_command']}`" if r.get("relay_command") else "") for r in rows],
    ]
    pj = res.get("projection")
    if pj:
        lines += ["", *render_projection(pj)]
    return "\n".join(lines)


def render_projection(pj: dict) -> list[str]:
    def f(x: float | None, spec: str = ",.0f") -> str:
        return "—" if x is None else format(x, spec)

    return [
        f"### Carried to {pj['workers']:,} workers and {pj['params'] / 1e9:g} B parameters (docs/scale.md)",
        "",
        f"{pj['blocks']} blocks of {pj['block_params'] / 1e6:,.0f} M parameters, {pj['workers_per_block']:,.0f} workers "
        f"per block, flat or through {pj['relays_per_block']} relays per block. Per block and round. Link s: the "
        f"larger direction at 100 Mbit/s ({pj['link_mb_s']:.1f} MB/s). CPU s: taking the updates in at "
        f"bench/codec_speed.py's measured push rate through a real aggregator ({pj['ingest_mb_s']['int8']:.0f} MB/s "
        f"of fp32 for int8, {pj['ingest_mb_s']['fp32']:.0f} for fp32), one core. RAM: the runtime + fixed RSS over "
        f"the unit (measured) × the unit + 32 KB an update. Spill: each update's raw bytes on disk. Relays push "
        f"combined updates at {pj['relay_push_bytes_per_param']:.2f} bytes a parameter ({pj['relay_push_from']}). "
        "Linear extrapolation of measured rates, not a run.",
        "",
        *table(["codecs up / down", "tier", "MB in", "MB out", "link s", "CPU s", "RAM GB", "spill GB"],
               [(r["codecs"], r["tier"], f(r["mb_in"]), f(r["mb_out"]), f(r["link_s"]), f(r["cpu_s"]),
                 f(r["ram_gb"], ",.1f"), f(r["spill_gb"], ",.1f")) for r in pj["rows"]], "llrrrrrr"),
        "",
        "A round's time, its serial stages (links at 100 Mbit/s, then ingest CPU; flat: the root's link both ways "
        "plus its CPU; tree: children → relay, relay CPU, relay → root, root CPU, root → relays → children):",
        "",
        *table(["codecs up / down", "flat s", "tree s"],
               [(x["codecs"], f(x["flat_s"]), f(x["tree_s"])) for x in pj["rounds"]], "lrr"),
    ]


def plot(res: dict, path: Path) -> None:
    plt = pyplot("scale")
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    now = current(res)
    fixed = [r for r in res["rows"] if r.get("relays_fixed") and not str(r.get("code", "")).startswith("lever")]
    series = [(topo, [r for r in now if r["topology"] == topo]) for topo in ("flat", "tree")]
    if fixed:  # the last code's tree with the same relays at every N (--relays)
        k = fixed[-1]["relays_fixed"]
        series.append((f"tree, {k} relays at every N", [r for r in fixed if r["code"] == fixed[-1]["code"]]))
    for label, rows in series:
        rows = sorted(rows, key=lambda r: r["n_workers"])
        if rows:
            a.plot([r["n_workers"] for r in rows], [r["root_peak_rss_mb"] for r in rows], "o-", label=label)
            b.plot([r["n_workers"] for r in rows], [r["close_s"] or math.nan for r in rows], "o-", label=label)
    for ax, title in ((a, "root peak RSS (MB)"), (b, "round close (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated workers N")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rss_fit(rows: list[dict]) -> tuple[float, float] | None:
    """Root peak RSS = a + b·N by least squares over `rows` (one row: b = 0): (a MB, b MB per worker)."""
    if not rows:
        return None
    xs, ys = [r["n_workers"] for r in rows], [r["root_peak_rss_mb"] for r in rows]
    if len(set(xs)) < 2:
        return sum(ys) / len(ys), 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def idle_rss() -> float:
    """Peak RSS of a Python process that imported torch and btnode's aggregator, nothing built."""
    from bench.report import measure
    import sys

    return measure([sys.executable, "-c", "import torch, btnode.node.aggregator"]).max_rss_mb


def code_commit() -> str:
    """The last commit that touched the code under test (btnode/, cli/), not this bench's own."""
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", "btnode", "cli"],
                          capture_output=True, text=True).stdout.strip()


def block_params(cfg: ModelConfig) -> int:
    import torch

    from btnode.store.models import init_unit

    with torch.device("meta"):
        return sum(p.numel() for p in init_unit(cfg, 0, 0).parameters())


def main() -> None:
    ap = BenchParser(__doc__.split("\n\n")[0])
    ap.quick(help="Tiny block, N = 4 and 8: a smoke test of the benchmark itself.")
    ap.result("scale")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated N")
    ap.add_argument("--topology", choices=("flat", "tree"), default="flat")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=120.0, help="the root's --deadline")
    ap.add_argument("--kill", action="store_true", help="also the kill run, at the largest N")
    ap.add_argument("--kill-only", action="store_true", help="only the kill run, at the largest N")
    ap.add_argument("--kill-round", type=int, default=0,
                    help="the kill run kills the first workers' relay alone, in this round (R >= 1: a later round), "
                         "once it has accepted half its children's updates")
    ap.add_argument("--race", action="store_true", help="in the kill run, the dead relay's children push again while "
                                                        "their join at the spare is still under way")
    ap.add_argument("--levels", type=int, choices=(1, 2), default=1,
                    help="2: a relay of relays (half as many relays again between the relays and the root)")
    ap.add_argument("--code", default="", help="label of these rows (default: the commit)")
    ap.add_argument("--replace", action="store_true", help="drop earlier rows of the same code and topology")
    ap.add_argument("--root-args", default="", help="more flags for the root, space-separated (a lever to try: "
                                                    "'--max-transfers 16'); they show in each row's command")
    ap.add_argument("--relays", type=int, default=0,
                    help="the tree's relays at every N (default √N, at most 16): the root's fan-in held fixed, so that "
                         "what grows at the root with N is what it keeps per worker, not per relay")
    ap.add_argument("--d-model", type=int, default=0,
                    help="another block width (default 128, 3.0 MB): the rows go to another --out, as the results "
                         "file holds one block size")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-scale")
    ap.add_argument("--unit-row", action="store_true",
                    help=f"also a flat N = {UNIT_N} row at d = 1,024 (43 M parameters), for fixed_rss_over_unit")
    ap.add_argument("--aside", default="", help="record under bench/results/scale/ASIDE/ (kept beside the rendered "
                                                 "record, not in BENCHMARKS.md, which is at its word budget)")
    ap.add_argument("--report", action="store_true", help="only re-render BENCHMARKS.md and the plot from the results")
    args = ap.parse_args()
    if args.setting == "default":  # each topology, fixed fan-in and block size is its own setting
        args.setting = args.topology + (f"-r{args.relays}" if args.relays else "") + (f"-d{args.d_model}" if args.d_model else "")
        args.results = result_path("scale", args.setting, quick=args.quick, results=args.results_dir)
    if args.aside:
        args.results = RESULTS / "scale" / args.aside / f"{args.setting}.json"
    if args.report:
        res = {**previous(args.results), "rows": recorded_rows(args.results)}
        finish(res)
        print(render(res))
        plot(res, ROOT / "bench" / "results" / "scale.png")
        return
    cfg = shape_of(args.quick, args.d_model)
    sizes = (4, 8) if args.quick else tuple(int(s) for s in args.sizes.split(",") if s)
    if args.relays and (args.topology != "tree" or args.relays < 1):
        ap.error("--relays K (K >= 1) is for --topology tree")
    if (args.kill_round or args.levels > 1 or args.race) and args.topology != "tree":
        ap.error("--kill-round, --race and --levels are for --topology tree")
    if args.kill_round and args.rounds <= args.kill_round:
        ap.error(f"--kill-round {args.kill_round} needs --rounds above it")
    tree = {"levels": args.levels, "race": args.race}
    code = args.code or (code_commit() + (f"-r{args.relays}" if args.relays else ""))
    new = []
    for n in () if args.kill_only else sizes:
        row = run_row(cfg, n, args.topology, args.work / f"{code}-{args.topology}-{n}", rounds=args.rounds,
                      deadline=args.deadline, root_args=tuple(args.root_args.split()), relays_fixed=args.relays,
                      levels=args.levels)
        row.update(code=code, kill=False, bench_command=invoked(), **({"relays_fixed": args.relays} if args.relays else {}))
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        new.append(row)
    if args.kill or args.kill_only:
        n = sizes[-1]
        row = run_row(cfg, n, args.topology, args.work / f"{code}-{args.topology}-{n}-l{args.levels}-kill", rounds=args.rounds,
                      deadline=args.deadline, kill=True, seed=1, relays_fixed=args.relays, kill_round=args.kill_round,
                      **tree)
        row.update(code=code, kill=True, bench_command=invoked())
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        new.append(row)
    prior = previous(args.results)
    old = recorded_rows(args.results)
    if args.replace:
        old = [r for r in old if not (r.get("code") == code and r["topology"] == args.topology)]
    params = block_params(cfg)
    res = {
        **{k: v for k, v in prior.items() if k == "unit_row"},
        "command": invoked(), "code": code, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared",
        "setup": (f"Block 0 of d={cfg.d_model}, {cfg.n_heads} heads, {cfg.n_layers} layers (`{shown(shape_flags(cfg))}`); "
                  f"simulated workers push int8 (claims checked: --batch {BATCH} --lr {LR} --steps-per-round {H}), "
                  f"{WORKERS_PER_PROCESS} per process on grpc.aio, one channel each; {args.rounds} rounds per row."),
        "block_params": params, "block_fp32_mb": 4 * params / MB, "idle_rss_mb": idle_rss(),
        "rows": new,
    }
    if args.unit_row:
        big = UNIT_SHAPE
        row = run_row(big, UNIT_N, "flat", args.work / f"{code}-unit", rounds=args.rounds, deadline=args.deadline,
                      root_args=tuple(args.root_args.split()))
        row.update(code=code, kill=False, bench_command=invoked(), block_params=block_params(big),
                   shape=shown(shape_flags(big)), idle_rss_mb=res["idle_rss_mb"])  # measured in the same run
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        res["unit_row"] = row
    shown_res = {**res, "rows": old + new}  # the table and its fits read this setting's earlier rows too
    finish(shown_res)
    res.update({k: v for k, v in shown_res.items() if k != "rows"})
    publish("scale", res, metrics(res), out=args.results)
    print(render(shown_res), flush=True)
    if is_published(args.results):
        plot(shown_res, ROOT / "bench" / "results" / "scale.png")


def recorded_rows(path: Path) -> list[dict]:
    """Every row of every run recorded at `path`, oldest first: the rows a run is shown and fitted beside."""
    return [row for run in (load(path) if path.exists() else []) for row in run.detail.get("rows", [])]


def metrics(res: dict) -> dict[str, Metric]:
    """Per row of this run, largest N first: the root's peak RSS, the round's close time and updates lost
    (the rows that kill a relay in a later round: lost over all of them, and the slowest next version after
    the kill); with a unit row, the root's fixed RSS over the unit."""
    out: dict[str, Metric] = {}
    later = [r for r in res["rows"] if r.get("kill_round")]  # a relay killed in a later round: two numbers for all
    if later:
        at = f"N = {max(r['n_workers'] for r in later):,}, a relay killed in round {later[0]['kill_round']}"
        out[f"{at}: lost"] = sum(r["lost"] for r in later)
        out[f"{at}: next version (s), slowest"] = max(r.get("next_version_after_kill_s") or math.inf for r in later)
    for r in sorted((r for r in res["rows"] if not r.get("kill_round")), key=lambda r: (-r["n_workers"], bool(r.get("kill")))):
        at = f"{r['topology']} N = {r['n_workers']:,}{' (kills)' if r.get('kill') else ''}"
        out.update({f"{at}: root peak RSS (MB)": r["root_peak_rss_mb"], f"{at}: close (s)": r["close_s"],
                    f"{at}: lost": r["lost"]})
    if res.get("unit_row") and res["unit_row"].get("code") == res.get("code"):  # measured in this run, not carried over
        out["unit row: fixed RSS / unit"] = res.get("fixed_rss_over_unit")
    return out


def current(res: dict) -> list[dict]:
    """The rows the derived numbers use: per topology, those of the last code that ran its sizes (not `before`,
    not a `lever-` row run beside them with other root flags, and not a kill run alone: a kill row is shown, but
    fits and projections read the undisturbed rows)."""
    last = {r["topology"]: r.get("code") for r in res["rows"]
            if not str(r.get("code", "")).startswith(("before", "lever")) and not r.get("kill")
            and not r.get("relays_fixed")}
    return [r for r in res["rows"] if last.get(r["topology"]) == r.get("code") and not r.get("kill")]


def latest_kills(res: dict) -> list[dict]:
    """Per topology, the kill run of the last code that ran one."""
    last = {r["topology"]: r.get("code") for r in res["rows"] if r.get("kill")}
    return [r for r in res["rows"] if r.get("kill") and last.get(r["topology"]) == r.get("code")]


def finish(res: dict) -> None:
    """The derived numbers: the root's RSS per extra worker (a line through the current flat rows), its fixed
    RSS over the unit (from the unit row when there is one: a 43 M-parameter block at N = 8, where the
    unit outweighs the runtime's own fixed costs; else the line's intercept at this block), the projection."""
    fit = rss_fit([r for r in current(res) if r["topology"] == "flat" and not r.get("kill")])
    res["per_update_mb"] = fit[1] if fit else None
    unit_row = res.get("unit_row")
    if unit_row:
        res["fixed_rss_over_unit"] = ((unit_row["root_peak_rss_mb"] - unit_row.get("idle_rss_mb", res["idle_rss_mb"]))
                                      / (4 * unit_row["block_params"] / MB))
        res["fixed_rss_from"] = f"the unit row ({unit_row['shape']}, N = {unit_row['n_workers']})"
    else:
        res["fixed_rss_over_unit"] = (fit[0] - res["idle_rss_mb"]) / res["block_fp32_mb"] if fit else None
        res["fixed_rss_from"] = "the intercept of the flat rows' line"
    res["projection"] = projection(res)
    ours = current(res)
    flat = sorted((r for r in ours if r["topology"] == "flat" and not r.get("kill")), key=lambda r: r["n_workers"])
    tree = sorted((r for r in ours if r["topology"] == "tree" and not r.get("kill")), key=lambda r: r["n_workers"])
    res["summary"] = {  # BENCHMARKS.md's summary row (held by tests/unit/test_docs.py)
        "flat_rss_smallest_mb": flat[0]["root_peak_rss_mb"] if flat else None,
        "flat_rss_largest_mb": flat[-1]["root_peak_rss_mb"] if flat else None,
        "flat_close_largest_s": flat[-1]["close_s"] if flat else None,
        "tree_close_largest_s": tree[-1]["close_s"] if tree else None,
        "lost": sum(r["lost"] for r in ours + latest_kills(res)),
        "max_watchdog_gap_s": max((r["max_watchdog_gap_s"] for r in ours), default=None)}

if __name__ == "__main__":
    main()
