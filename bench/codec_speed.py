"""Codec speed (issue #24, item 5): how fast each codec encodes and decodes the largest block of
bench/memory.py, what the frames add (zstd and sha256 out, unzstd, sha256 and the checks back in),
and how a push of that block through a real aggregator compares with a plain gRPC client stream of
the same bytes.

    .venv/bin/python -m bench.codec_speed                  # ~10 min on 2 cores
    .venv/bin/python -m bench.codec_speed --quick          # a smoke run (a small block)
    .venv/bin/python -m bench.codec_speed --against main   # also push with git ref main's btnode, interleaved

The update is synthetic: every parameter moves N(0, σ²), σ = lr·√H / 2 (H AdamW steps of about lr
each, uncorrelated in sign: a random walk; halved so that no coordinate nears the claims bound the
aggregator checks). Codec speeds are single-threaded (torch.set_num_threads(1), one process), in MB
of the block's fp32 size (10^6 bytes) per second, medians of --reps after a warm-up. Pushes run from
a client process per btnode tree to an aggregator process of that tree, each push as a worker makes
it (codec bytes ready, frames compressed and hashed as gRPC sends); the plain stream sends the
push's wire bytes in 1 MiB messages to bench/transport.py's raw gRPC server. The trees and the
plain stream take turns, so that load on the machine hits each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.flags import BenchParser
from bench.report import ROOT, invoked, module_command, publish, table
from bench.runs import Metric
from bench.transport import child, timed
from btnode.model.config import ModelConfig
from btnode.node.launch import stop_processes

# The largest block of bench/memory.py (d = 1792, 28 heads, 2 layers per block, 4 blocks, context 128)
SHAPE = ModelConfig(d_model=1792, n_heads=28, n_layers=2, n_blocks=4, context=128)
QUICK_SHAPE = ModelConfig(d_model=128, n_heads=2, n_layers=2, n_blocks=2, context=32)
BLOCK, SEED, BATCH = 0, 0, 32
PUSH_CODECS = ("int8", "fp32", "sparse8@0.01")  # --link lan's upload, the lossless one, and a sparse upload
LINK_CODECS = {"wan": "sparse8@0.03", "lan": "int8"}  # each link profile's upload (codec/profiles.py)


def synthetic_delta(cfg: ModelConfig, h: int, lr: float):
    """Block BLOCK's parameters, each moved N(0, (lr·√H / 2)²) (module doc)."""
    import torch

    from btnode.store.models import init_unit

    g = torch.Generator().manual_seed(SEED)
    sigma = lr * h ** 0.5 / 2
    return {n: torch.randn(t.shape, generator=g) * sigma for n, t in init_unit(cfg, BLOCK, SEED).state_dict().items()}


def variants(densities: list[float]):
    """(codec, label, encode keywords) of every codec: a sparse one once per density."""
    from btnode.codec.codecs import Codec

    for codec in Codec:
        if not codec.sparse:
            yield codec, codec.name.lower(), {}
            continue
        from btnode.codec.sparse import keep_of

        for d in densities:
            yield codec, f"{codec.name.lower()} @ {d:g}", {"keep": keep_of(d)}


def codec_speeds(delta, reps: int, densities: list[float]) -> list[dict]:
    """Per codec: encode and decode alone, a worker's encode with error feedback (Δ + β·residual,
    encoded, decoded again for the next residual: encode_update), then the bundle's work on each side
    (compress + sha256; FrameAssembler: unzstd, sha256, decode and the finite check), single-threaded."""
    import torch

    from btnode.codec.codecs import decode, encode
    from btnode.codec.frames import Bundle, FrameAssembler, encode_update, spec_of

    spec = spec_of(delta)
    mb = 4 * sum(t.numel() for t in delta.values()) / 1e6
    base = {n: torch.zeros_like(t) for n, t in delta.items()}
    residual = {n: t * 0.5 for n, t in delta.items()}  # a residual as large as half an update
    rows = []
    for codec, label, kw in variants(densities):
        raw = {n: encode(codec, t, **kw) for n, t in delta.items()}
        enc_s = timed(lambda: [encode(codec, t, **kw) for t in delta.values()], reps)  # noqa: B023
        dec_s = timed(lambda: [decode(codec, raw[n], s) for n, s in spec.items()], reps)  # noqa: B023
        ef_s = timed(lambda: encode_update(delta, base, residual, codec, error_feedback=True, **kw), reps)  # noqa: B023

        def bundled():
            return list(Bundle(codec, [(n, raw[n]) for n in spec]).chunks())  # noqa: B023

        chunks = bundled()

        def receive():
            asm = FrameAssembler.for_spec(spec, [codec])  # noqa: B023
            for c in chunks:  # noqa: B023
                asm.add(c)
            asm.finish()

        frame_s, recv_s = timed(bundled, reps), timed(receive, reps)
        rows.append({"codec": label, "raw_bytes": sum(map(len, raw.values())),
                     "wire_bytes": sum(len(c.data) for c in chunks), "encode_s": enc_s, "decode_s": dec_s,
                     "frame_s": frame_s, "receive_s": recv_s, "encode_mbps": mb / enc_s, "decode_mbps": mb / dec_s,
                     "codec_mbps": mb / (enc_s + dec_s), "ef_encode_s": ef_s, "ef_encode_mbps": mb / ef_s,
                     "frame_mbps": mb / frame_s, "receive_mbps": mb / recv_s})
        print(f"[codec_speed] {label}: encode {mb / enc_s:.0f} MB/s, decode {mb / dec_s:.0f}, encode with error "
              f"feedback {mb / ef_s:.0f}, bundle {mb / frame_s:.0f}, receive {mb / recv_s:.0f}", flush=True)
    return rows


# -- the push against a plain stream ----------------------------------------------------------
def push_client(agg: str, raw_grpc: str, codec_name: str, workers: int, cfg: ModelConfig, h: int) -> None:
    """A worker's side, run as a child with the btnode on its PYTHONPATH: join `workers` ids, then per
    line on stdin push once ("push") or send the same wire bytes to the plain server ("raw"), and
    print the seconds it took."""
    import grpc
    import torch
    import zstandard

    from btnode.codec.codecs import encode, parse
    from btnode.codec.frames import ZSTD_LEVEL, frame_from_raw, iter_chunks
    from btnode.codec.sparse import CHUNK, keep_of
    from btnode.protocol import Outcome, PushHeader
    from btnode.rpc.client import SwarmClient
    from btnode.rpc.server import CHANNEL_OPTIONS
    from btnode.train.config import TrainConfig
    from btnode.train.terms import TrainingTerms

    torch.set_num_threads(1)
    tc = TrainConfig(steps=1000, batch=BATCH)
    codec, _, density = codec_name.partition("@")
    codec, keep = parse(codec), keep_of(float(density)) if density else CHUNK
    delta = synthetic_delta(cfg, h, tc.lr)
    spec = {n: tuple(t.shape) for n, t in delta.items()}
    raw = {n: encode(codec, t, keep=keep) for n, t in delta.items()}
    del delta

    try:  # as BlockWorker._frames: one bundle, compressed as gRPC asks for its chunks
        from btnode.codec.frames import Bundle

        def frames():
            return [Bundle(codec, [(n, raw[n]) for n in spec])]
    except ImportError:  # a tree from before bundles (--against): a frame a tensor, compressed and hashed as gRPC asks
        def frames():
            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            return (frame_from_raw(n, s, codec, raw[n], compressor) for n, s in spec.items())

    parts = [c.data for c in iter_chunks(frames())]
    client = SwarmClient(agg, timeout_s=600)
    ids = [f"w{i}" for i in range(workers)]
    for w in ids:
        client.join(w, BLOCK, cfg.fingerprint(), json.dumps(cfg.to_dict()), training_json=TrainingTerms(tc, h).to_json())
    who = iter(ids)
    sink = grpc.insecure_channel(raw_grpc, options=CHANNEL_OPTIONS).stream_unary("/bench.Raw/Sink")

    def push() -> None:
        header = PushHeader(worker_id=next(who), block=BLOCK, base_version=0, samples=float(h * BATCH), loss=0.0,
                            codec=codec, update_id=uuid.uuid4().hex, steps=tuple(range(h)))
        j = client.push(header, frames())
        assert j.outcome is Outcome.PENDING, j

    def plain() -> None:
        assert int.from_bytes(sink(iter(parts), timeout=600), "little") == sum(map(len, parts))

    source = grpc.insecure_channel(raw_grpc, options=CHANNEL_OPTIONS).unary_stream("/bench.Raw/Source")

    def close() -> str:
        """The workers that have not pushed push, so the round closes; then, once version 1 is out, the wire
        bytes of a fetch of its published delta and of a pull of the block."""
        for w in who:
            client.push(PushHeader(worker_id=w, block=BLOCK, base_version=0, samples=float(h * BATCH), loss=0.0,
                                   codec=codec, update_id=uuid.uuid4().hex, steps=tuple(range(h))), frames())
        deadline = time.monotonic() + 1800
        while client.pull(BLOCK, ids[0], spec).info.version < 1:
            if time.monotonic() > deadline:
                raise SystemExit("version 1 did not come")
            time.sleep(1.0)
        return f"{client.fetch_delta(BLOCK, 1, spec).transfer.wire} {client.pull(BLOCK, ids[0], spec).transfer.wire}"

    def plain_from(n: int) -> None:
        assert sum(len(m) for m in source(n.to_bytes(8, "little"), timeout=600)) == n

    actions = {"push": push, "raw": plain, "fetch": lambda: client.fetch_delta(BLOCK, 1, spec),
               "pull": lambda: client.pull(BLOCK, ids[0], spec)}

    import btnode

    print(f"ready {btnode.__file__}", flush=True)
    for line in sys.stdin:
        what, *arg = line.split()
        if what == "close":
            print(close(), flush=True)
            continue
        t0 = time.perf_counter()
        plain_from(int(arg[0])) if what == "raw-from" else actions[what]()
        print(f"{time.perf_counter() - t0:.6f}", flush=True)


TREE = "BENCH_BTNODE_TREE"  # in a child's environment: the folder holding the btnode it must import


def tree_env(ref: str, workdir: Path) -> dict[str, str]:
    """An environment for children that import git ref `ref`'s btnode package (bench/ stays this one): they
    must also run in `tree_cwd(env)`, since `python -m` puts the working folder before PYTHONPATH (run from
    this repository, a child imported this tree's btnode whatever PYTHONPATH said)."""
    dest = Path(tempfile.mkdtemp(prefix="btnode-", dir=workdir))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "btnode"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return {**os.environ, TREE: str(dest),
            "PYTHONPATH": os.pathsep.join([str(dest), os.environ.get("PYTHONPATH", ""), str(ROOT)])}


def tree_cwd(env: dict[str, str] | None) -> str | None:
    """Where a child of `env` runs: its tree's folder (tree_env), or this one's."""
    return (env or {}).get(TREE)


def push_speeds(workdir: Path, cfg: ModelConfig, h: int, reps: int, trees: dict[str, dict[str, str]],
                quick: bool, codecs: dict[str, str | None] | None = None, fetch: bool = False) -> dict:
    """Per codec (`codecs`: codec → the --link its aggregators run, None: none; PUSH_CODECS by default) and per
    btnode tree: median push seconds, against the plain stream's. `fetch`: then the round closes and a fetch of
    the published delta and a pull of version 1 are timed too, each against a plain gRPC server stream of
    the same wire bytes, taking turns as the pushes."""
    from btnode.train.config import TrainConfig

    tc = TrainConfig(steps=1000, batch=BATCH)
    mb = 4 * sum(t.numel() for t in synthetic_delta(cfg, 1, 1.0).values()) / 1e6
    out = {}
    for codec, link in (codecs or dict.fromkeys(PUSH_CODECS)).items():
        procs: list[subprocess.Popen] = []
        try:
            raw_proc, raw_port = child("raw-grpc", workdir)
            procs.append(raw_proc)
            clients = {}
            for name, env in trees.items():
                agg, port = child("aggregator", workdir, "--deadline", "3600", "--batch", str(BATCH), "--lr", str(tc.lr),
                                  "--steps-per-round", str(h), *(["--link", link] if link else []), shape=cfg, env=env)
                procs.append(agg)
                cmd = module_command("bench.codec_speed", "--push-client", f"127.0.0.1:{port}",
                                     f"127.0.0.1:{raw_port}", codec, str(reps + 2), "--h", str(h),
                                     *(["--quick"] if quick else []))
                clients[name] = subprocess.Popen(cmd, env=env, cwd=tree_cwd(env), stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, text=True)
                procs.append(clients[name])
            for name, c in clients.items():
                assert c.stdout is not None
                ready = c.stdout.readline().split()
                assert ready[:1] == ["ready"], f"the push client of {name} failed"
                assert Path(ready[1]).is_relative_to(tree_cwd(trees[name]) or ROOT), f"{name}: imported {ready[1]}"
            os.sync()  # the aggregators' version-0 checkpoints on disk, not written back during the pushes
            first = next(iter(clients.values()))
            times: dict[str, list[float]] = {name: [] for name in [*trees, "plain gRPC"]}
            for _ in range(reps + 1):  # the first round of turns is the warm-up
                for name, c in [*clients.items(), ("plain gRPC", first)]:
                    times[name].append(_ask(c, "push" if name != "plain gRPC" else "raw"))
            medians = {name: statistics.median(t[1:]) for name, t in times.items()}
            plain = medians["plain gRPC"]
            out[codec] = {"block_fp32_mb": mb, "plain_grpc_s": plain, "plain_grpc_mbps": mb / plain,
                          "trees": {name: {"push_s": s, "push_mbps": mb / s, "vs_plain": plain / s, "all_s": times[name]}
                                    for name, s in medians.items() if name != "plain gRPC"}}
            if link:
                out[codec]["link"] = link
            print(f"[codec_speed] push {codec}: " + ", ".join(f"{n} {mb / s:.0f} MB/s" for n, s in medians.items()),
                  flush=True)
            if fetch:
                out[codec].update(_fetches(clients, reps, mb))
        finally:
            for p in procs:
                if p.stdin is not None:
                    p.stdin.close()
            stop_processes(procs[::-1], timeout_s=60.0)
    return out


def _fetches(clients: dict[str, subprocess.Popen], reps: int, mb: float) -> dict:
    """Each tree's round closed, then its fetch of the published delta and its pull of the block, against a plain
    gRPC server stream of the same wire bytes (this tree's), taking turns; medians after a warm-up turn."""
    wire = {name: [int(x) for x in _line(c, "close").split()] for name, c in clients.items()}
    first_name, first = next(iter(clients.items()))
    out = {}
    for kind, at in (("fetch", 0), ("pull", 1)):
        times: dict[str, list[float]] = {name: [] for name in [*clients, "plain gRPC"]}
        for _ in range(reps + 1):
            for name, c in [*clients.items(), ("plain gRPC", first)]:
                times[name].append(_ask(c, kind if name != "plain gRPC" else f"raw-from {wire[first_name][at]}"))
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        plain = medians["plain gRPC"]
        out[kind] = {"wire_bytes": {name: w[at] for name, w in wire.items()}, "plain_grpc_s": plain,
                     "plain_grpc_mbps": mb / plain,
                     "trees": {name: {"s": s, "mbps": mb / s, "vs_plain": plain / s, "all_s": times[name]}
                               for name, s in medians.items() if name != "plain gRPC"}}
        print(f"[codec_speed] {kind}: " + ", ".join(f"{n} {mb / s:.0f} MB/s" for n, s in medians.items()), flush=True)
    return out


def _line(client: subprocess.Popen, what: str) -> str:
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(what + "\n")
    client.stdin.flush()
    line = client.stdout.readline()
    if not line:
        raise SystemExit(f"the push client died during a {what}")
    return line


def _ask(client: subprocess.Popen, what: str) -> float:
    return float(_line(client, what))


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("codec-speed")
    ap.quick(help="smoke run: a small block, 2 reps, no report", reps=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--densities", type=lambda s: [float(x) for x in s.split(",")], default=[0.01, 0.03],
                    help="sparse codecs' densities (values kept / values), comma-separated: an upload's, a publish's")
    ap.rounds(h=50, h_help="local steps the synthetic update stands for (H)")
    ap.add_argument("--against", metavar="REF", help="also push with git ref REF's btnode, interleaved")
    ap.add_argument("--skip-codecs", action="store_true", help="the push part only")
    ap.add_argument("--push-codecs", type=lambda s: [c for c in s.split(",") if c], default=list(PUSH_CODECS),
                    help="the codecs pushed, comma-separated ('' for none: the codec part only; bench/scale.py reads "
                         "the default setting's int8 and fp32 pushes)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-codec-speed")
    ap.add_argument("--push-client", nargs=4, metavar=("AGG", "RAW", "CODEC", "WORKERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg = QUICK_SHAPE if args.quick else SHAPE
    if args.push_client:
        agg, raw, codec, workers = args.push_client
        return push_client(agg, raw, codec, int(workers), cfg, args.h)
    import torch

    from btnode.train.config import TrainConfig

    torch.set_num_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    params = sum(t.numel() for t in synthetic_delta(cfg, 1, 1.0).values())
    codecs = [] if args.skip_codecs else codec_speeds(synthetic_delta(cfg, args.h, TrainConfig().lr), args.reps,
                                                      args.densities)
    trees = {"this tree": {**os.environ}}
    if args.against:
        trees[args.against] = tree_env(args.against, args.workdir)
    pushes = push_speeds(args.workdir, cfg, args.h, args.reps, trees, args.quick, dict.fromkeys(args.push_codecs)
                         ) if args.push_codecs else {}
    res = {"shape": cfg.to_dict(), "block": BLOCK, "params": params, "h": args.h, "lr": TrainConfig().lr,
           "error_feedback_bytes_per_worker": 4 * params, "codecs": codecs, "push": pushes, "reps": args.reps,
           "densities": args.densities, "command": invoked(), "date": time.strftime("%Y-%m-%d")}
    publish("codec-speed", res, metrics(res), render, out=args.results)


def metrics(res: dict) -> dict[str, Metric]:
    """Encode + decode MB/s per core for each codec, and each codec's push against plain gRPC."""
    out: dict[str, Metric] = {f"{c['codec']}: encode + decode MB/s": c["codec_mbps"] for c in res["codecs"]}
    return {**out, **{f"{codec} push / plain gRPC": p["trees"]["this tree"]["vs_plain"] for codec, p in res["push"].items()}}


def render(r: dict) -> str:
    s = r["shape"]
    mb = 4 * r["params"] / 1e6
    cmd = f"`{r['command']}`"
    rows = [(c["codec"], f"{c['encode_mbps']:.0f}", f"{c['decode_mbps']:.0f}", f"**{c['codec_mbps']:.0f}**",
             f"{c['ef_encode_mbps']:.0f}" if "ef_encode_mbps" in c else "—",
             f"{c['frame_mbps']:.0f}", f"{c['receive_mbps']:.0f}", f"{c['wire_bytes'] / 1e6:.1f} MB", cmd)
            for c in r["codecs"]]
    pushes = [(codec, tree, f"{t['push_mbps']:.0f}", f"{p['plain_grpc_mbps']:.0f}", f"**{t['vs_plain']:.2f}**", cmd)
              for codec, p in r["push"].items() for tree, t in p["trees"].items()]
    return "\n".join([
        "## Codec speed: the largest block through each codec and one push (`bench/codec_speed.py`)",
        "",
        f"{r['date']}; 2 cores shared with other work. Block {r['block']} of bench/memory.py's largest model "
        f"(d = {s['d_model']}, {s['n_heads']} heads, {s['n_layers']} layers per block, {s['n_blocks']} blocks, context "
        f"{s['context']}): {r['params']:,} parameters, {mb:.1f} MB in fp32. The update: every parameter moved "
        f"N(0, σ²), σ = lr·√H / 2 with lr = {r['lr']:g}, H = {r['h']}. MB/s of the block's fp32 size, one thread, "
        f"medians of {r['reps']} after a warm-up. *with error feedback*: a worker's encode_update (Δ + β·residual, "
        "encoded, and decoded again for the next residual); *bundle*: zstd level 1 + sha256 of each tensor into one "
        "bundle's chunks; *receive*: FrameAssembler over the 1 MiB chunks (unzstd, sha256, decode, finite check).",
        "",
        *table(["codec", "encode MB/s", "decode MB/s", "encode + decode MB/s", "encode with error feedback MB/s",
                "bundle MB/s", "receive MB/s", "bytes on the wire", "command"], rows, "lrrrrrrrl"),
        "",
        f"Error feedback keeps one fp32 residual per parameter: **{r['error_feedback_bytes_per_worker'] / 1e6:.0f} MB "
        "per worker** at this block (4 bytes × parameters), beside its parameters and AdamW state.",
        *(["",
           "Push through a real aggregator (claims checked, as a worker that stated its training at Join) against a "
           "plain gRPC client stream of the push's wire bytes, both from a client process, taking turns:",
           "",
           *table(["codec", "btnode", "push MB/s", "plain gRPC MB/s", "push / plain", "command"], pushes, "llrrrl")]
          if pushes else []),
    ])


if __name__ == "__main__":
    main()
