"""The root's memory per connected worker (issue #25): one real aggregator process (bench/scale.py's
root command, started as every node is, so with glibc's thread cache off unless --env sets
GLIBC_TUNABLES), and from this process N connections to it on grpc.aio, one channel (one TCP
connection) each, opened in steps up to each size in --sizes; at each size, once every connection
holds what --hold says and a settling pause has passed, the root's /proc is sampled: VmRSS, RssAnon,
RssFile, threads, open fds, and its anonymous memory by mapping (smaps): thread stacks (mappings of
one thread stack's size: `ulimit -s`, or BTNODE_PROBE_STACK_KB), glibc's heaps ([heap] and its 64 MiB
arenas) and the rest. Per-connection MB is the least-squares slope of each over N.

--hold, without pushes: `connect` (the connection only, made ready), `watch` (+ a Watch version
stream, as a worker holds; its first message received), `join` (Join first, then Watch, as
bench/swarmlet.py's workers do, without their full Pull), `pull` (Join, Pull the block in full, then
Watch). With them: `round` runs one round as the load test's workers do (bench/swarmlet.py's
SimWorker: Join, Pull, Watch; then all push at once, wait for the version and FetchDelta it), on a
fresh root per size; per size the root's VmHWM at the end, and its VmRSS polled every 50 ms (by a
thread of this busy process, so it can miss a short peak that VmHWM keeps) for each phase's peak.
--shared-connections: the connections of this process share one TCP connection, as the load test's
workers of one swarmlet process do (channels with equal arguments share gRPC's global subchannel).
--root-arg passes extra flags to the root, --env extra environment: one lever per run, named by --lever.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import torch

from bench.flags import BenchParser
from bench.report import ROOT, publish, result_path, shown
from bench.runs import RESULTS, Metric, slug
from bench.scale import BATCH, H, LR, SHAPE, free_port, root_command
from btnode.model.config import ModelConfig
from btnode.node.launch import CLI, one_thread_env, start_node
from btnode.rpc import convert
from btnode.rpc.server import CHANNEL_OPTIONS
from btnode.train.config import TrainConfig
from btnode.train.recipe import Recipe
from btnode.train.terms import TrainingTerms
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

HOLDS = ("connect", "watch", "join", "pull", "round")
OPEN_AT_ONCE = 32  # connections being set up at once (joins are rate-limited per IP; the root has 2 cores)
BLOCK = 0
KB = 1024


def status(pid: int) -> dict[str, int]:
    """/proc/PID/status fields in kB (Threads as a count)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "Threads"):
            out[key] = int(rest.split()[0])
    return out


def anon_by_kind(pid: int, stack_kb: int) -> dict[str, int]:
    """RSS kB of the process's private anonymous mappings by kind: `stacks` (mappings of exactly one
    thread stack's size, `stack_kb`, the way glibc allocates them), `heap` ([heap] and glibc's arenas:
    the 64 MiB-aligned heaps it reserves, seen as mappings whose sizes add to 64 MiB), `other`."""
    out = {"stacks": 0, "heap": 0, "other": 0, "stack_mappings": 0}
    maps: list[tuple[int, int, str, int]] = []  # (start, size kB, name, rss kB)
    cur: list = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ (\S+) (\d+)\s*(.*)", line):
            cur = [int(m[1], 16), (int(m[2], 16) - int(m[1], 16)) // KB, m[6].strip(), 0, m[5] == "0"]
            maps.append(cur)
        elif line.startswith("Rss:") and cur:
            cur[3] = int(line.split()[1])
    arena = 64 * KB
    for start, size, name, rss, anon in maps:
        if not anon or (name and name != "[heap]"):
            continue
        if name == "[heap]" or (start % (arena * KB) == 0 and size <= arena) or _in_arena(start, maps, arena):
            out["heap"] += rss
        elif size == stack_kb:
            out["stacks"] += rss
            out["stack_mappings"] += 1
        else:
            out["other"] += rss
    return out


def _in_arena(start: int, maps: list, arena_kb: int) -> bool:
    """Whether `start` lies in a 64 MiB-aligned glibc heap whose first mapping begins at that alignment."""
    base = start - start % (arena_kb * KB)
    return base != start and any(s == base and anon and not name for s, _, name, _, anon in maps)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(pid: int, n: int, stack_kb: int) -> dict:
    s, a = status(pid), anon_by_kind(pid, stack_kb)
    return {"n": n, "rss_mb": s["VmRSS"] / KB, "hwm_mb": s["VmHWM"] / KB, "anon_mb": s["RssAnon"] / KB,
            "file_mb": s["RssFile"] / KB, "threads": s["Threads"], "fds": fds(pid),
            "stacks_mb": a["stacks"] / KB, "stack_mappings": a["stack_mappings"], "heap_mb": a["heap"] / KB,
            "other_anon_mb": a["other"] / KB}


def slope(points: list[dict], key: str) -> float:
    """Least-squares MB (or count) per connection of `key` over the sampled N."""
    xs, ys = [p["n"] for p in points], [p[key] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


class Conn:
    """One simulated worker's connection: its own channel, holding what `hold` says."""

    def __init__(self, address: str, name: str, cfg: ModelConfig, hold: str, *, shared: bool = False):
        # a local subchannel pool each: channels with equal arguments may otherwise share one TCP connection
        own = [] if shared else [("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *own])
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.name, self.cfg, self.hold = name, cfg, hold
        self.ready = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def open(self) -> None:
        await self.channel.channel_ready()
        if self.hold in ("join", "pull"):
            await self.stub.Join(pb.JoinRequest(worker_id=self.name, block=BLOCK, fingerprint=self.cfg.fingerprint(),
                                                config=convert.model_to_pb(self.cfg),
                                                training=convert.training_to_pb(TrainingTerms(TrainConfig(batch=BATCH, lr=LR), H))))
        if self.hold == "pull":
            async for _ in self.stub.Pull(pb.PullRequest(block=BLOCK, worker_id=self.name)):
                pass
        if self.hold == "connect":
            self.ready.set()
            return
        self.task = asyncio.create_task(self._watch())
        await self.ready.wait()

    async def _watch(self) -> None:
        async for _ in self.stub.Watch(pb.WatchRequest(block=BLOCK, worker_id=self.name if self.hold != "watch" else "")):
            self.ready.set()

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
        await self.channel.close()


async def probe(address: str, pid: int, cfg: ModelConfig, sizes: list[int], hold: str, settle_s: float,
                stack_kb: int, shared: bool) -> list[dict]:
    conns: list[Conn] = []
    points = []
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def opened(c: Conn) -> None:
        async with gate:
            await asyncio.wait_for(c.open(), 120)

    await asyncio.sleep(settle_s)
    points.append(sample(pid, 0, stack_kb))
    try:
        for n in sizes:
            new = [Conn(address, f"conn{i:04d}", cfg, hold, shared=shared) for i in range(len(conns), n)]
            conns += new
            await asyncio.gather(*(opened(c) for c in new))
            await asyncio.sleep(settle_s)
            points.append(sample(pid, n, stack_kb))
            p = points[-1]
            print(f"[conn_memory] N={n} ({hold}): RSS {p['rss_mb']:.1f} MB (anon {p['anon_mb']:.1f}: stacks "
                  f"{p['stacks_mb']:.1f} in {p['stack_mappings']}, heap {p['heap_mb']:.1f}, other "
                  f"{p['other_anon_mb']:.1f}; file {p['file_mb']:.1f}), {p['threads']} threads, {p['fds']} fds",
                  flush=True)
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return points


class Events:
    """What SimWorkers log, counted by kind (the probe's phases end on these counts)."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def __call__(self, kind: str, **fields: object) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


class Peaks(threading.Thread):
    """Polls the root's VmRSS every 50 ms; keeps the highest per phase (`phase` is set by the probe) and,
    within a second of each phase's peak, a full sample there (threads, smaps by kind)."""

    def __init__(self, pid: int, n: int, stack_kb: int):
        super().__init__(daemon=True)
        self.pid, self.n, self.stack_kb, self.phase = pid, n, stack_kb, "start"
        self.peak: dict[str, float] = {}
        self.at_peak: dict[str, dict] = {}
        self.done = threading.Event()

    def run(self) -> None:
        last, stale = 0.0, ""
        while not self.done.is_set():
            try:
                rss = status(self.pid)["VmRSS"] / KB
                phase = self.phase
                if rss > self.peak.get(phase, 0.0):
                    self.peak[phase], stale = rss, phase
                if stale == phase and time.monotonic() - last > 1.0:  # within a second of the peak's last rise
                    self.at_peak[phase], stale = sample(self.pid, self.n, self.stack_kb), ""
                    last = time.monotonic()
            except (OSError, KeyError):
                return
            time.sleep(0.05)


async def one_round(address: str, pid: int, cfg: ModelConfig, n: int, settle_s: float, stack_kb: int,
                    shared: bool) -> dict:
    """N SimWorkers through one round; the root's peak RSS by phase and a full sample after each."""
    from bench.swarmlet import SimWorker, updates

    tc = TrainConfig(batch=BATCH, lr=LR)
    _, variants = updates(cfg, lr=LR, h=H, seed=0)
    recipe = Recipe.here(torch.device("cpu"), tc.precision.value, error_feedback=True).to_json()
    ev, go = Events(), asyncio.Event()
    options = CHANNEL_OPTIONS if shared else [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    workers = [SimWorker(f"sim{i:04d}", [address], cfg, TrainingTerms(tc, H), variants[i % len(variants)], ev,
                         rounds=1, wait_s=600, recipe=recipe, go=go, logged=set(), options=options) for i in range(n)]
    peaks = Peaks(pid, n, stack_kb)
    peaks.start()
    out: dict = {"n": n, "samples": {}}
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def started(w: SimWorker) -> asyncio.Task:
        async with gate:  # joins and their pulls a few at a time, as bench/scale.py's processes roughly do
            t = asyncio.create_task(w.run())
            while w.info is None and not t.done():
                await asyncio.sleep(0.05)
            return t

    peaks.phase = "joined"
    runs = await asyncio.gather(*(started(w) for w in workers))
    await asyncio.sleep(settle_s)
    out["samples"]["joined"] = sample(pid, n, stack_kb)
    for phase, kind in (("pushes", "push"), ("fetches", "fetched")):
        peaks.phase = phase
        go.set()
        while ev.kinds.get(kind, 0) + ev.kinds.get("error", 0) < n:
            await asyncio.sleep(0.05)
        out["samples"][phase] = sample(pid, n, stack_kb)
    await asyncio.gather(*runs, return_exceptions=True)
    peaks.done.set()
    peaks.join()
    out["peak_rss_mb"] = dict(peaks.peak)
    out["near_peak"] = dict(peaks.at_peak)
    out["hwm_mb"] = status(pid)["VmHWM"] / KB
    out["events"] = dict(ev.kinds)
    print(f"[conn_memory] N={n} round: peak RSS by phase {({k: round(v, 1) for k, v in peaks.peak.items()})}, "
          f"VmHWM {out['hwm_mb']:.1f} MB, events {ev.kinds}", flush=True)
    for phase, p in peaks.at_peak.items():
        print(f"[conn_memory]   near the {phase} peak: RSS {p['rss_mb']:.1f} MB (stacks {p['stacks_mb']:.1f} in "
              f"{p['stack_mappings']}, heap {p['heap_mb']:.1f}, other {p['other_anon_mb']:.1f}), {p['threads']} threads",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--sizes", default="16,256,1024", help="connections held at each sample, ascending")
    ap.add_argument("--hold", choices=HOLDS, default="join")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between the last connection and a sample")
    ap.add_argument("--lever", default="none", help="the name this run's row goes under")
    ap.add_argument("--root-arg", action="append", default=[], help="an extra flag for the root (repeat)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE in the root's environment (repeat)")
    ap.add_argument("--shared-connections", action="store_true", help="one TCP connection for all (as a swarmlet's)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder; the run is appended to DIR/conn-memory/<lever>.json")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-conn")
    args = ap.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    env = one_thread_env(**dict(e.split("=", 1) for e in args.env))
    stack_kb = int(env.get("BTNODE_PROBE_STACK_KB", 0)) or int(
        subprocess.run(["bash", "-c", "ulimit -s"], capture_output=True, text=True).stdout)

    def with_root(n: int, run):  # noqa: ANN001, ANN202 - run(address, pid) -> a coroutine
        work = args.work
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        cmd = [*root_command(SHAPE, work, n, free_port(), 600.0), *args.root_arg]
        root = start_node(cmd[len(CLI):], port_file=work / "root.port", log=work / "root.log", env=env,
                          name="aggregator", timeout_s=300)
        try:
            return asyncio.run(run(root.address(), root.proc.pid)), cmd
        finally:
            root.stop(timeout_s=60)

    keys = ("rss_mb", "anon_mb", "file_mb", "stacks_mb", "heap_mb", "other_anon_mb", "threads", "fds")
    if args.hold == "round":
        rounds = []
        for n in sizes:
            got, cmd = with_root(n, lambda a, pid, n=n: one_round(a, pid, SHAPE, n, args.settle, stack_kb,
                                                                   args.shared_connections))
            rounds.append(got)
        points = [r["samples"]["joined"] for r in rounds]
        per = {f"peak_{k}_mb": slope([{"n": r["n"], "v": r["peak_rss_mb"].get(k, 0.0)} for r in rounds], "v")
               for k in ("joined", "pushes", "fetches")} if len(rounds) > 1 else {}
        per["hwm_mb"] = slope([{"n": r["n"], "v": r["hwm_mb"]} for r in rounds], "v") if len(rounds) > 1 else None
        extra = {"rounds": rounds}
    else:
        points, cmd = with_root(max(sizes), lambda a, pid: probe(a, pid, SHAPE, sizes, args.hold, args.settle,
                                                                  stack_kb, args.shared_connections))
        fit = [p for p in points if p["n"] > 0]
        per = {k: slope(fit, k) for k in keys} if len(fit) > 1 else {}
        extra = {}
    row = {"lever": args.lever, "hold": args.hold, "shared_connections": args.shared_connections,
           "root_command": shown(cmd), "root_env": args.env, "per_connection": per, "points": points, **extra}
    for k, v in per.items():
        if v is not None:
            print(f"[conn_memory] per connection: {k} {v * (1 if k in ('threads', 'fds') else KB):.2f}"
                  f"{'' if k in ('threads', 'fds') else ' KB'}", flush=True)
    publish("conn-memory", row, metrics(row), out=result_path("conn-memory", slug(args.lever), results=args.out))


def metrics(row: dict) -> dict[str, Metric]:
    """What one more connection costs the root (KB, threads, descriptors), and its peak RSS at the most."""
    per = row["per_connection"]
    out: dict[str, Metric] = {f"{k.removesuffix('_mb')} per connection{'' if k in ('threads', 'fds') else ' (KB)'}":
                              None if v is None else v * (1 if k in ("threads", "fds") else 1024) for k, v in per.items()}
    top = max(row["points"], key=lambda p: p["n"])
    return {**out, f"RSS at {top['n']:,} connections (MB)": top["rss_mb"]}


if __name__ == "__main__":
    main()
