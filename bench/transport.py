"""Transport benchmark (issue #3, design §6.3–6.4): how fast a block moves end to end, against
plain gRPC streaming and a raw TCP socket on the same loopback, how many bytes a round costs per
worker and codec, the traffic ratio against data-parallel all-reduce, and the CE reached with
fp32 versus int8 updates.

    .venv/bin/python -m bench.transport          # ~15 min on 2 cores
    .venv/bin/python -m bench.transport --quick  # a smoke run
    .venv/bin/python -m bench.transport --largest-block --setting largest-block  # push_vs_grpc at bench/memory.py's
        # largest block (521 MB in fp32) per link profile (wan: sparse8 3 % up, lan: int8), then a fetch of the
        # published delta and a pull, each against plain gRPC moving the same bytes, in turns (bench/codec_speed.py)

Servers run in their own processes; the client side runs here. Throughputs are in MB/s of the
block's fp32 size (10^6 bytes), medians of `--reps` after one warm-up, measured in one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import time
import uuid
from concurrent import futures
from pathlib import Path

from bench.flags import SHAPE, BenchParser, shape_flags
from bench.report import ROOT, module_command, publish, table
from bench.runs import Metric
from btnode.node.launch import CLI, start_node, stop_processes, wait_port

CHUNK = 1 << 20


# -- servers (run as child processes) ---------------------------------------------------------
def serve_raw_grpc(port_file: Path) -> None:
    """A gRPC server with one client-streaming method that swallows raw byte messages."""
    import grpc

    from btnode.rpc.server import SERVER_OPTIONS

    def sink(request_iterator, context):
        n = sum(len(m) for m in request_iterator)
        return n.to_bytes(8, "little")

    held = {}

    def source(request, context):  # n bytes (an 8-byte request) in CHUNK-byte messages, as a Pull sends them
        n = int.from_bytes(request, "little")
        payload = held.setdefault(n, os.urandom(n))
        for lo in range(0, n, CHUNK):
            yield payload[lo:lo + CHUNK]

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Sink": grpc.stream_unary_rpc_method_handler(sink),
                      "Source": grpc.unary_stream_rpc_method_handler(source)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(str(port))
    server.wait_for_termination()


def serve_tcp(port_file: Path) -> None:
    """Read an 8-byte length, then that many bytes; answer one byte. Forever."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(srv.getsockname()[1]))
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                left = int.from_bytes(head, "little")
                buf = bytearray(CHUNK)
                while left:
                    got = conn.recv_into(buf, min(left, CHUNK))
                    if not got:
                        break
                    left -= got
                conn.sendall(b"k")


def child(kind: str, workdir: Path, *args: str, shape=SHAPE, env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, int]:
    """A server in its own process, returned once it listens: an aggregator (`btnode join`, of model
    `shape`) or one of this module's plain servers (`--serve-raw-grpc`, `--serve-tcp`), which write
    their port the same way. `env`: the child's environment (another PYTHONPATH: another btnode)."""
    port_file = workdir / f"{kind}-{uuid.uuid4().hex[:6]}.port"
    log = workdir / f"{port_file.stem}.log"
    cwd = (env or {}).get("BENCH_BTNODE_TREE")  # another tree's btnode (codec_speed.tree_env): `-m` imports the cwd's first
    if kind == "aggregator":
        node = start_node([*(["-v"] if os.environ.get("BENCH_VERBOSE") else []), "join", "--role", "aggregator",
                           "--listen", "127.0.0.1:0", "--state-dir", str(workdir / f"state-{port_file.stem}"),
                           *shape_flags(shape), *args, "--no-identities", "--audit", "0"],  # as measured before #38's defaults (identities, audits); docs/security.md for the defaults' costs
                          port_file=port_file, log=log, env=env, popen=functools.partial(subprocess.Popen, cwd=cwd),
                          name=f"{kind} server", timeout_s=600.0)
        return node.proc, node.port
    proc = subprocess.Popen(module_command("bench.transport", f"--serve-{kind}", str(port_file)),
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env, cwd=cwd)
    try:
        return proc, wait_port(port_file, proc, name=f"{kind} server")
    except BaseException:
        stop_processes([proc], timeout_s=5.0)
        raise


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- measurements -----------------------------------------------------------------------------
def trained_delta(steps: int):
    """A real update: block 1 after `steps` local steps from its seeded initialisation, and the
    training terms its worker would state at Join (H = `steps`)."""
    import torch

    from btnode.data import corpus
    from btnode.data.windows import WindowSampler
    from btnode.model.targets import target_table
    from btnode.store.models import init_block
    from btnode.train.config import TrainConfig
    from btnode.train.terms import TrainingTerms
    from btnode.train.trainers import BlockTrainer

    cfg, tc = SHAPE, TrainConfig(steps=1000, batch=32)
    init = init_block(cfg, 1, 0)
    base = {n: t.clone() for n, t in init.state_dict().items()}
    tr = BlockTrainer(init, tc, block=1, table=target_table(cfg), device=torch.device("cpu"))
    data = WindowSampler(corpus.bundled().train, cfg.context)
    t0 = time.perf_counter()
    for i in range(steps):
        tr.train_step(data.batch(0, "bench", i, tc.batch), "bench")
    step_s = (time.perf_counter() - t0) / steps
    return cfg, {n: t.detach() - base[n] for n, t in tr.model.state_dict().items()}, step_s, TrainingTerms(tc, steps)


def block_transfers(workdir: Path, cfg, delta, terms, reps: int) -> dict:
    """Push, pull and fetch one block through an aggregator process that checks the pushes' claims
    against `terms` (the trained update's batch, lr and H), as by default."""
    from btnode.codec.codecs import Codec
    from btnode.codec.frames import encode_frames, lazy_frames, wire_bytes
    from btnode.protocol import Outcome, PushHeader
    from btnode.rpc.client import SwarmClient

    spec = {n: tuple(t.shape) for n, t in delta.items()}
    block_bytes = 4 * sum(t.numel() for t in delta.values())
    out: dict = {"block_fp32_bytes": block_bytes, "codecs": {}}
    for codec in Codec:
        tc, h = terms.train, terms.steps_per_round
        proc, port = child("aggregator", workdir, "--deadline", "3600", "--publish-codec", codec.name.lower(),
                           "--batch", str(tc.batch), "--lr", str(tc.lr), "--steps-per-round", str(h))
        try:
            c = SwarmClient(f"127.0.0.1:{port}", timeout_s=120)
            workers = [f"w{i}" for i in range(reps + 2)]
            for w in workers:
                c.join(w, 1, cfg.fingerprint(), json.dumps(cfg.to_dict()), training_json=terms.to_json())
            who = iter(workers)

            def push_once():
                frames = lazy_frames(delta, codec)  # codec included, encoded as the stream goes (as workers do)
                header = PushHeader(worker_id=next(who), block=1, base_version=0, samples=float(h * tc.batch), loss=0.0,
                                    codec=codec, update_id=uuid.uuid4().hex, steps=tuple(range(h)))
                assert c.push(header, frames).outcome is Outcome.PENDING

            push_s = timed(push_once, reps)
            for w in who:  # the rest report, so the round closes and version 1 exists
                push_once_as = PushHeader(worker_id=w, block=1, base_version=0, samples=float(h * tc.batch), loss=0.0,
                                          codec=codec, update_id=uuid.uuid4().hex, steps=tuple(range(h)))
                c.push(push_once_as, encode_frames(delta, codec))
            raw, wire = wire_bytes(encode_frames(delta, codec))
            pull_s = timed(lambda: c.pull(1, "w0", spec), reps)
            fetch = c.fetch_delta(1, 1, spec)
            fetch_s = timed(lambda: c.fetch_delta(1, 1, spec), reps)
            out["codecs"][codec.name.lower()] = {
                "push_s": push_s, "push_mbps": block_bytes / push_s / 1e6, "push_raw_bytes": raw,
                "push_wire_bytes": wire, "pull_fp32_s": pull_s, "pull_mbps": block_bytes / pull_s / 1e6,
                "delta_wire_bytes": fetch.transfer.wire, "fetch_delta_s": fetch_s,
                "fetch_delta_mbps": block_bytes / fetch_s / 1e6}
            c.close()
        finally:
            stop_processes([proc])
    return out


def raw_transfers(workdir: Path, n_bytes: int, reps: int) -> dict:
    import grpc

    from btnode.rpc.server import CHANNEL_OPTIONS

    payload = os.urandom(n_bytes)
    proc, port = child("raw-grpc", workdir)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        sink = ch.stream_unary("/bench.Raw/Sink")

        def grpc_once():
            got = sink(iter([payload[i:i + CHUNK] for i in range(0, n_bytes, CHUNK)]), timeout=120)
            assert int.from_bytes(got, "little") == n_bytes

        grpc_s = timed(grpc_once, reps)
        ch.close()
    finally:
        stop_processes([proc])
    proc, port = child("tcp", workdir)
    try:
        sock = socket.create_connection(("127.0.0.1", port))

        def tcp_once():
            sock.sendall(n_bytes.to_bytes(8, "little"))
            sock.sendall(payload)
            assert sock.recv(1) == b"k"

        tcp_s = timed(tcp_once, reps)
        sock.close()
    finally:
        stop_processes([proc])
    return {"bytes": n_bytes, "grpc_s": grpc_s, "grpc_raw_mbps": n_bytes / grpc_s / 1e6,
            "tcp_s": tcp_s, "tcp_raw_mbps": n_bytes / tcp_s / 1e6}


def swarm_ce(workdir: Path, codec: str, rounds: int, h: int, windows: int) -> dict:
    """Run `btnode swarm` (3 blocks × 2 replicas) and score the result with `btnode eval`."""
    state = workdir / f"swarm-{codec}"
    cmd = CLI + ["swarm", "--state-dir", str(state), "--replicas", "2", "--rounds", str(rounds), "--steps-per-round",
                 str(h), "--codec", codec, "--deadline", "600", *shape_flags(SHAPE)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    ev = state / "eval.json"
    subprocess.run(CLI + ["eval", "--checkpoint", str(state), "--segments", "1", "--windows", str(windows),
                          "--seeds", "8", "--json", str(ev)], check=True, stdout=subprocess.DEVNULL)
    res = json.loads(ev.read_text())
    return {"sce8_k1": res["per_k"]["1"]["sce8"], "sce1_k1": res["per_k"]["1"]["sce1"], "wall_s": wall,
            "command": " ".join(["btnode"] + cmd[len(CLI):]).replace(str(ROOT) + "/", "")}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("transport")
    ap.quick(help="smoke run: fewer reps, tiny swarm runs, no report", reps=2, h=3, rounds=2, windows=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.rounds(rounds=4, h=50, h_help="local steps per round (H) for the update and the swarm")
    ap.windows(256)
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-transport")
    ap.add_argument("--largest-block", action="store_true",
                    help="only the push of the largest block against plain gRPC, per codec (push_vs_grpc)")
    ap.add_argument("--against", metavar="REF", help="with --largest-block: also push with git ref REF's btnode")
    ap.add_argument("--links", default="wan,lan", help="with --largest-block: the link profiles whose uploads are pushed")
    ap.add_argument("--serve-raw-grpc", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--serve-tcp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_raw_grpc:
        return serve_raw_grpc(args.serve_raw_grpc)
    if args.serve_tcp:
        return serve_tcp(args.serve_tcp)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.largest_block:
        return largest_block(args)

    cfg, delta, step_s, terms = trained_delta(args.h)
    blocks = block_transfers(args.workdir, cfg, delta, terms, args.reps)
    raw = raw_transfers(args.workdir, blocks["codecs"]["fp32"]["push_wire_bytes"], args.reps)
    ce = {c: swarm_ce(args.workdir, c, args.rounds, args.h, args.windows) for c in ("fp32", "int8")}

    import torch  # noqa: F401  (already loaded by the measurements)

    from btnode.store.models import init_block

    total_params = sum(sum(t.numel() for t in init_block(cfg, b, 0).state_dict().values()) for b in range(cfg.n_blocks))
    n_workers = cfg.n_blocks * 2
    allreduce_per_step = 2 * (n_workers - 1) / n_workers * 4 * total_params * 2  # ring: sent + received, fp32 grads
    per_codec = {}
    for name, c in blocks["codecs"].items():
        round_bytes = c["push_wire_bytes"] + blocks["codecs"]["fp32"]["delta_wire_bytes"]  # push + fp32-published delta
        per_codec[name] = {"push_wire_bytes": c["push_wire_bytes"], "round_bytes_per_worker": round_bytes,
                           "allreduce_ratio": allreduce_per_step * args.h / round_bytes}
    fp32, int8 = blocks["codecs"]["fp32"], blocks["codecs"]["int8"]
    res = {
        "fp32_push_mbps": fp32["push_mbps"], "grpc_raw_mbps": raw["grpc_raw_mbps"], "tcp_raw_mbps": raw["tcp_raw_mbps"],
        "push_vs_grpc": fp32["push_mbps"] / raw["grpc_raw_mbps"],
        "int8_bytes_ratio": fp32["push_wire_bytes"] / int8["push_wire_bytes"],
        "ce_fp32_updates": ce["fp32"]["sce8_k1"], "ce_int8_updates": ce["int8"]["sce8_k1"],
        "allreduce_traffic_ratio": per_codec["int8"]["allreduce_ratio"],
        "h": args.h, "step_s": step_s, "n_workers": n_workers, "total_params": total_params,
        "allreduce_bytes_per_step_per_worker": allreduce_per_step,
        "blocks": blocks, "raw": raw, "per_codec": per_codec, "swarm": ce, "reps": args.reps,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(res, indent=1))
    publish("transport", res, metrics(res), render, out=args.results)


def largest_block(args: argparse.Namespace) -> None:
    """A push of bench/codec_speed.py's block (the largest of bench/memory.py) per link profile's upload codec
    (its aggregators run that --link), against a plain gRPC client stream of the same wire bytes; then the
    round closes and a fetch of the published delta and a pull of the block are timed against a plain gRPC
    server stream of the same bytes; all taking turns (codec_speed.push_speeds; H = 50)."""
    from bench.codec_speed import LINK_CODECS, QUICK_SHAPE, tree_env
    from bench.codec_speed import SHAPE as LARGEST
    from bench.codec_speed import push_speeds

    trees = {"this tree": {**os.environ}}
    if args.against:
        trees[args.against] = tree_env(args.against, args.workdir)
    cfg = QUICK_SHAPE if args.quick else LARGEST
    pushes = push_speeds(args.workdir, cfg, 50, args.reps, trees, args.quick,
                         {LINK_CODECS[link]: link for link in args.links.split(",")}, fetch=True)
    mine = lambda p, part: p[part]["trees"]["this tree"]["vs_plain"]  # noqa: E731
    res = {"shape": cfg.to_dict(), "push": pushes, "reps": args.reps, "date": time.strftime("%Y-%m-%d"),
           "push_vs_grpc": {codec: p["trees"]["this tree"]["vs_plain"] for codec, p in pushes.items()},
           "fetch_vs_grpc": {codec: mine(p, "fetch") for codec, p in pushes.items()},
           "pull_vs_grpc": {codec: mine(p, "pull") for codec, p in pushes.items()}}
    print(json.dumps(res, indent=1))
    named = lambda codec: f"{pushes[codec]['link']} ({codec})"  # noqa: E731
    publish("transport", res, {f"{named(c)} {part} / plain gRPC": v for part in ("push", "fetch", "pull")
                               for c, v in res[f"{part}_vs_grpc"].items()}, render_largest, out=args.results)


def render_largest(r: dict) -> str:
    def rows(codec: str, p: dict, part: str) -> list[tuple]:
        at = p if part == "push" else p[part]
        return [(p.get("link", "—"), codec, part, tree, f"{t['push_mbps' if part == 'push' else 'mbps']:.0f}",
                 f"{at['plain_grpc_mbps']:.0f}", f"**{t['vs_plain']:.2f}**") for tree, t in at["trees"].items()]

    mb = next(iter(r["push"].values()))["block_fp32_mb"]
    return "\n".join([
        "## Transport: the largest block pushed, fetched and pulled against plain gRPC (`bench/transport.py --largest-block`)",
        "",
        f"{r['date']}; 2 cores shared with other work, loopback. A {mb:.0f} MB block (fp32) pushed by a client process "
        "to an aggregator process of that --link, as a worker pushes (codec bytes ready, the bundle compressed as gRPC "
        "sends; the reply is the judgement), against a plain gRPC client stream of the push's wire bytes; then the round "
        "closes and the published delta is fetched and the block pulled, each against a plain gRPC server stream of "
        f"the same bytes; all in turns. MB/s of the block's fp32 size, medians of {r['reps']} after a warm-up turn.",
        "",
        *table(["link", "codec", "transfer", "btnode", "MB/s", "plain gRPC MB/s", "btnode / plain"],
               [row for codec, p in r["push"].items() for part in ("push", *(k for k in ("fetch", "pull") if k in p))
                for row in rows(codec, p, part)], "llllrrr")])


def metrics(res: dict) -> dict[str, Metric]:
    """A block's push against raw gRPC, int8's byte saving, and CE after int8 against fp32 updates."""
    return {"fp32 push MB/s": res["fp32_push_mbps"], "raw gRPC MB/s": res["grpc_raw_mbps"],
            "int8 bytes saving (×)": res["int8_bytes_ratio"], "CE after int8 updates": res["ce_int8_updates"],
            "CE after fp32 updates": res["ce_fp32_updates"], "ring all-reduce / swarm traffic (×)": res["allreduce_traffic_ratio"]}


def render(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:.3f} MB"  # noqa: E731
    b = r["blocks"]
    fp32 = b["codecs"]["fp32"]
    transfers = [*(("push (encode, send, decode, validate, judge)", name, f"{c['push_mbps']:.1f}", mb(c["push_wire_bytes"]))
                   for name, c in b["codecs"].items()),
                 *(("fetch published delta", name, f"{c['fetch_delta_mbps']:.1f}", mb(c["delta_wire_bytes"]))
                   for name, c in b["codecs"].items()),
                 ("pull full block", "fp32", f"{fp32['pull_mbps']:.1f}", mb(fp32["push_wire_bytes"])),
                 ("plain gRPC client stream of the same bytes (1 MiB messages)", "—", f"{r['grpc_raw_mbps']:.1f}",
                  mb(r["raw"]["bytes"])),
                 ("raw TCP socket, same bytes", "—", f"{r['tcp_raw_mbps']:.1f}", mb(r["raw"]["bytes"]))]
    return "\n".join([
        "## Transport: a block on the wire (`bench/transport.py`)",
        "",
        f"Command: `.venv/bin/python -m bench.transport` ({r['date']}; 2 cores, loopback). The block is block 1 of the "
        f"quality configuration ({b['block_fp32_bytes'] / 1e6:.2f} MB in fp32); the update is its real delta after "
        f"H = {r['h']} local steps. Throughput = fp32 block bytes / seconds, median of {r['reps']} after a warm-up, "
        "servers in their own processes, all measured in the same run.",
        "",
        *table(["transfer", "codec", "MB/s", "bytes on the wire"], transfers, "llrr"),
        "",
        f"fp32 push reaches **{100 * r['push_vs_grpc']:.0f}%** of plain gRPC streaming (aim ≥ 60%). int8 pushes "
        f"**{r['int8_bytes_ratio']:.2f}×** fewer bytes than fp32 (aim ≥ 4.5×).",
        "",
        *table(["codec", "push bytes per round per worker", "+ fp32 published delta", "vs. ring all-reduce every step"],
               [(name, mb(c["push_wire_bytes"]), mb(c["round_bytes_per_worker"]), f"{c['allreduce_ratio']:.0f}× less")
                for name, c in r["per_codec"].items()], "lrrr"),
        "",
        f"All-reduce baseline: data-parallel training of the whole model ({r['total_params']:,} parameters, "
        f"all {r['n_workers'] // 2} blocks) on {r['n_workers']} workers, ring all-reduce of fp32 gradients every step: "
        f"{r['allreduce_bytes_per_step_per_worker'] / 1e6:.2f} MB sent + received per worker per step, × H = {r['h']} "
        "steps per round. A BlockTrain worker holds one block and moves one push and one delta per round.",
        "",
        *table(["updates", "held-out SCE-8, K=1 (nats/byte)", "SCE-1", "swarm wall-clock", "command"],
               [(name, f"{s['sce8_k1']:.4f}", f"{s['sce1_k1']:.4f}", f"{s['wall_s']:.0f} s", f"`{s['command']}`")
                for name, s in r["swarm"].items()], "lrrrl"),
        "",
        f"int8 − fp32: {r['ce_int8_updates'] - r['ce_fp32_updates']:+.4f} nats/byte (aim: within 0.02)."])


if __name__ == "__main__":
    main()
