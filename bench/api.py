"""The OpenAI-compatible API under load (issues #26, #41): C ∈ {1, 4, 16, 64} concurrent streaming
clients against `btnode api` in front of a chain over the emulated WAN, for the block chain at the
default settings (the request names no readout, K or steps: serve/defaults.py, readout spec at
K = 16; rows marked "default": true) and for the AR chain (one traversal per byte). The block
chain's entry batches concurrent requests into shared traversals (serve/batching.py).

Layout: four hosts in a row, 20 ms one way per hop at 100 Mbit/s (lab.netlab); the clients on
h0, `btnode api` and the entry stage on h1, the next stages on h2 and h3 (the AR chain's three
stages hold two layers each). Every client streams requests one after another for --seconds
(the last one finishes), each from its own seed. Per client: bytes/s = bytes received ÷ its wall
time; in all: bytes ÷ the phase's wall time. ttfb: request sent → first segment's chunk (median
and p99 over all requests); per-segment latency: the gap between successive chunks of a stream
(p50, p99 over all streams).

Before the load: `conformance` (bench/api_conformance.py: OpenAI request cases against `btnode serve
--checkpoint BLOCKS`, `failed` counting those that do not behave as OpenAI's reference says) and
`proxy_rss_mb` (a `btnode api` in front of that process's gRPC entry, after serving requests: no torch).
Both run on loopback; --no-load stops there (no root needed) and keeps the last run's load rows.

    .venv/bin/python -m bench.api                 # trains two small models (~1 min), then ~8 min
    .venv/bin/python -m bench.api --blocks runs/demo --ar runs/ar6 --models block
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from bench.api_conformance import conformance, proxy_rss_mb
from bench.flags import BenchParser
from bench.report import invoked, module_command, previous, publish, shown, table
from bench.runs import Metric
from btnode.node.launch import CLI, start_node, stop_processes

API_PORT, BLOCK_PORT, AR_PORT = 8000, 7100, 7200
# the served models' shape (README's results: d = 128, 3 blocks × 2 layers, 128-byte context; AR: 6 layers)
SHAPE = ["--d-model", "128", "--heads", "4", "--layers", "2", "--blocks", "3", "--context", "128", "--segments",
         "1,4,16,64"]
PROMPT = "The history of the"
MAX_CONCURRENT = 128  # the API's --max-concurrent: above the most clients a phase runs


def stream_one(host: str, port: int, body: dict) -> dict:
    """One streaming request: its chunks' arrival times, bytes and whether it ended well."""
    conn = http.client.HTTPConnection(host, port, timeout=300)
    t0 = time.perf_counter()
    times, n_bytes, error = [], 0, None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {r.read()[:200]!r}", "times": [], "bytes": 0, "t0": t0}
        done = False
        while line := r.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]["message"]
                break
            if chunk.get("btnode"):  # a segment's chunk (the finish chunk has no btnode object)
                times.append(time.perf_counter())
                n_bytes = chunk["btnode"]["bytes"]
        if not done and error is None:
            error = "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return {"error": error, "times": times, "bytes": n_bytes, "t0": t0, "t1": time.perf_counter()}


def load(host: str, port: int, clients: int, seconds: float, body: dict) -> dict:
    """C clients, each streaming requests back to back until `seconds` have passed."""
    results: list[list[dict]] = [[] for _ in range(clients)]
    start = time.perf_counter()

    def client(i: int) -> None:
        seed = 1000 * i
        while time.perf_counter() - start < seconds:
            results[i].append(stream_one(host, port, {**body, "seed": seed}))
            seed += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    per_client, ttfb, gaps, errors, total = [], [], [], 0, 0
    for reqs in results:
        got = sum(r["bytes"] for r in reqs)
        busy = sum(r["t1"] - r["t0"] for r in reqs)
        per_client.append(got / busy if busy > 0 else 0.0)
        total += got
        for r in reqs:
            errors += r["error"] is not None
            if r["times"]:
                ttfb.append(r["times"][0] - r["t0"])
                gaps += [b - a for a, b in zip(r["times"], r["times"][1:])]
    gaps.sort()
    ttfb.sort()

    def q(p: float, xs: list[float] = gaps) -> float | None:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    return {"clients": clients, "requests": sum(len(r) for r in results), "errors": errors,
            "bytes_per_s": statistics.mean(per_client), "bytes_per_s_min": min(per_client),
            "bytes_per_s_total": total / wall, "ttfb_s": statistics.median(ttfb) if ttfb else None,
            "ttfb_p99_s": q(0.99, ttfb), "p50_s": q(0.50), "p99_s": q(0.99), "wall_s": wall,
            "first_error": next((r["error"] for reqs in results for r in reqs if r["error"]), None)}


def train(workdir: Path, kind: str) -> Path:
    """A small checkpoint when none is given: serving speed, not quality, is measured here (though
    spec serves fewer bytes per traversal from a model this young: give --blocks for real rows)."""
    out = workdir / kind
    cmd, extra = ("train-local", []) if kind == "blocks" else ("train-ar", ["--ar-layers", "6"])
    subprocess.run([*CLI, cmd, "--out", str(out), "--steps", "20", "--batch", "4", "--warmup", "1", *SHAPE, *extra],
                   check=True, capture_output=True)
    return out


def start(lab, workdir: Path, blocks: Path, ar: Path | None) -> tuple[list[subprocess.Popen], dict[str, str]]:
    procs: list[subprocess.Popen] = []

    def node(pos: int, name: str, args: list[str]) -> None:
        procs.append(start_node(args, port_file=workdir / f"{name}.port", log=workdir / f"{name}.log",
                                popen=partial(lab.popen, pos + 1), timeout_s=180, name=name).proc)

    try:
        for pos in (2, 1, 0):
            nb = [] if pos == 2 else ["--next", f"{lab.address(pos + 2)}:{BLOCK_PORT + pos + 1}"]
            na = [] if pos == 2 else ["--next", f"{lab.address(pos + 2)}:{AR_PORT + pos + 1}"]
            node(pos, f"block{pos}", ["join", "--role", "stage", "--listen", f"0.0.0.0:{BLOCK_PORT + pos}",
                                      "--worker-id", f"block{pos}", "--block", str(pos), "--checkpoint", str(blocks), *nb])
            if ar is None:
                continue
            node(pos, f"ar{pos}", ["join", "--role", "stage", "--listen", f"0.0.0.0:{AR_PORT + pos}", "--worker-id",
                                   f"ar{pos}", "--model", "ar", "--checkpoint", str(ar), "--layers-range",
                                   f"{2 * pos}:{2 * pos + 2}", *na])
        entry = lab.address(1)
        limit = ["--max-concurrent", str(MAX_CONCURRENT)]
        node(0, "api-block", ["api", "--entry", f"{entry}:{BLOCK_PORT}", "--listen", f"0.0.0.0:{API_PORT}", *limit])
        if ar is not None:
            node(0, "api-ar", ["api", "--entry", f"{entry}:{AR_PORT}", "--listen", f"0.0.0.0:{API_PORT + 1}", *limit])
    except BaseException:
        stop_processes(procs)
        raise
    return procs, {"block": f"{entry}:{API_PORT}", "ar": f"{entry}:{API_PORT + 1}"}


def front(workdir: Path, blocks: Path) -> dict:
    """`btnode serve --checkpoint BLOCKS` on loopback: the conformance cases against it, then a `btnode
    api` in front of its gRPC entry, whose resident memory is read after 20 requests through it."""
    procs: list[subprocess.Popen] = []
    try:
        served = start_node(["serve", "--checkpoint", str(blocks), "--listen", "127.0.0.1:0"],
                            port_file=workdir / "serve.port", log=workdir / "serve.log", timeout_s=180, name="serve")
        procs.append(served.proc)
        deadline = time.monotonic() + 60
        while not (found := re.search(r"gRPC entry (\S+)\)", text := (workdir / "serve.log").read_text())):
            if time.monotonic() > deadline:
                raise SystemExit(f"btnode serve printed no entry:\n{text[-2000:]}")
            time.sleep(0.1)
        entry = found.group(1)  # its printed line: "serving ID at URL (the page: …; gRPC entry E)"
        res = {"conformance": conformance("127.0.0.1", served.port)}
        proxy = start_node(["api", "--entry", entry, "--listen", "127.0.0.1:0"], port_file=workdir / "proxy.port",
                           log=workdir / "proxy.log", name="proxy")
        procs.append(proxy.proc)
        for i in range(20):
            got = stream_one("127.0.0.1", proxy.port, {"prompt": PROMPT, "max_tokens": 64, "stream": True, "seed": i})
            if got["error"]:
                raise SystemExit(f"the proxy failed a request: {got['error']}")
        rss, torch = proxy_rss_mb(proxy.proc.pid)
        return {**res, "proxy_rss_mb": round(rss, 1), "proxy_imports_torch": torch}
    finally:
        stop_processes(procs)


def metrics(res: dict) -> dict[str, Metric]:
    """Bytes/s per client for each chain at the fewest and most clients, and the errors across all rows."""
    ns = sorted({r["clients"] for r in res["rows"]}) or [0]
    out: dict[str, Metric] = {f"{r['model']}, {r['clients']} clients: bytes/s per client": r["bytes_per_s"]
                              for r in res["rows"] if r["clients"] in (ns[0], ns[-1])}
    default = {r["clients"]: r for r in res["rows"] if r.get("default")}
    if 1 in default and 16 in default and default[1]["bytes_per_s_total"]:
        out["default, 16 clients: bytes/s in all ÷ 1 client's"] = (default[16]["bytes_per_s_total"]
                                                                    / default[1]["bytes_per_s_total"])
        out["default, 16 clients: ttfb p99 (s)"] = default[16]["ttfb_p99_s"]
    checks = ({"conformance failed": res["conformance"]["failed"], "proxy RSS (MB)": res["proxy_rss_mb"]}
              if "conformance" in res else {})  # (runs before the conformance cases have none)
    return {**out, "errors": sum(r["errors"] for r in res["rows"]), **checks}


def render(res: dict) -> str:
    def s(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "–"

    rows = [(r["model"], r["clients"], f"{r['load_1m']:.1f}", f"{r['bytes_per_s']:.1f}", f"{r['bytes_per_s_min']:.1f}",
             f"{r['bytes_per_s_total']:.1f}", s(r["ttfb_s"]), s(r.get("ttfb_p99_s")),
             f"{r['p50_s']:.3f}" if r["p50_s"] is not None else "–",
             f"{r['p99_s']:.3f}" if r["p99_s"] is not None else "–", r["requests"], r["errors"]) for r in res["rows"]]
    return "\n".join([
        "## The OpenAI-compatible API under load (`bench/api.py`)", "",
        f"`{res['command']}` ({res['date']}; the machine: 2 shared cores, every stage, the API and the clients "
        "on it). Four hosts in a row over the emulated WAN (20 ms one way per hop, 100 Mbit/s): the clients on h0, "
        "`btnode api` with the entry stage on h1, the next stages on h2, h3. C clients stream requests of "
        f"{res['n_bytes']} bytes back to back for {res['seconds']:g} s. Models: {res['models']}.", "",
        *table(["model", "C", "load (1 min)", "bytes/s per client (mean)", "(slowest)", "bytes/s in all", "ttfb p50 (s)",
                "ttfb p99 (s)", "segment p50 (s)", "segment p99 (s)", "requests", "errors"], rows, "llrrrrrrrrrr"),
        "", "bytes/s per client: a client's bytes ÷ the time its requests took; in all: every byte ÷ the "
        "phase's wall time. \"default\": the request names no readout, K or steps (the chain's serving defaults); the "
        "block chain's entry batches the segments of concurrent requests into shared traversals. Load: the machine's "
        "1-minute load average at the phase's end (other jobs ran "
        "beside it on its 2 cores). Segment latency: the gap between two chunks of one stream (one traversal of the "
        "chain: K bytes for the block chain, one byte for the AR chain).", "",
        f"OpenAI conformance (`btnode serve`, bench/api_conformance.py): {len(res['conformance']['cases'])} request "
        f"cases, {res['conformance']['failed']} failed"
        + "".join(f"; {c['name']} (got {c['got']})" for c in res["conformance"]["cases"] if not c["ok"])
        + f". `btnode api` in front of its entry after 20 requests: {res['proxy_rss_mb']:.1f} MB resident"
        + (" (torch loaded)." if res["proxy_imports_torch"] else " (no torch).")])


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--blocks", type=Path, help="block checkpoint (default: a small one trained here)")
    ap.add_argument("--ar", type=Path, help="6-layer AR checkpoint (default: a small one trained here)")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--models", default="block,ar", help="which chains to load: block (default settings), ar")
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's duration")
    ap.add_argument("--bytes", type=int, default=256, help="bytes per block-chain request")
    ap.add_argument("--ar-bytes", type=int, default=32, help="bytes per AR request (one traversal each)")
    ap.add_argument("--no-load", action="store_true", help="conformance and proxy memory only (no netlab, no root); "
                                                           "the last run's load rows are kept")
    ap.result("api")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--body", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        host, _, port = args.target.rpartition(":")
        print(json.dumps(load(host, int(port), int(args.clients), args.seconds, json.loads(args.body))))
        return
    from lab.netlab.topology import Chain
    from btnode.serve.defaults import serving_defaults
    from btnode.store.models import load_blocks

    reason = Chain.why_unavailable()
    if reason and not args.no_load:
        raise SystemExit(f"cannot emulate the WAN here: {reason} (--no-load measures the rest)")
    workdir = Path(tempfile.mkdtemp(prefix="btnode-api-bench-"))
    blocks = args.blocks or train(workdir, "blocks")
    checks = front(workdir, blocks)
    print(f"[api] conformance: {checks['conformance']['failed']} of {len(checks['conformance']['cases'])} failed; "
          f"proxy {checks['proxy_rss_mb']} MB", file=sys.stderr, flush=True)
    if args.no_load:
        last = previous(args.results)  # its load rows, kept
        res = {"seconds": args.seconds, "n_bytes": "–", "models": f"blocks {shown([str(blocks)])}", "rows": [], **last,
               **checks, "command": invoked(), "date": time.strftime("%Y-%m-%d"),
               "rows_from": last.get("rows_from", last.get("date"))}
        publish("api", res, metrics(res), render, out=args.results)
        return
    ar = args.ar or (train(workdir, "ar") if "ar" in args.models.split(",") else None)
    cfg, _ = load_blocks(blocks)
    d = serving_defaults(cfg, blocks)
    bodies = {"block": {"prompt": PROMPT, "max_tokens": args.bytes, "temperature": 1.0, "stream": True},
              "ar": {"prompt": PROMPT, "max_tokens": args.ar_bytes, "temperature": 1.0, "stream": True}}
    names = {"block": f"block, default ({d.readout.value} K={d.k})", "ar": "ar"}
    rows = []
    with Chain(4, delay_ms=20, rate_mbit=100) as lab:
        procs, targets = start(lab, workdir, blocks, ar)
        try:
            for model in args.models.split(","):
                for c in (int(x) for x in args.clients.split(",")):
                    cmd = ["ip", "netns", "exec", lab.host(0), *module_command(
                        "bench.api", "--client", "--target", targets[model], "--clients", str(c), "--seconds",
                        str(args.seconds), "--body", json.dumps(bodies[model]))]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 600)
                    if done.returncode != 0:
                        raise SystemExit(f"the client failed:\n{done.stderr[-3000:]}")
                    row = {"model": names[model], "default": model == "block",
                           **json.loads(done.stdout.strip().splitlines()[-1]),
                           "load_1m": os.getloadavg()[0]}  # the shared machine's load at the phase's end
                    rows.append(row)
                    print(f"[api] {row['model']} C={c}: {row['bytes_per_s']:.1f} bytes/s per client, "
                          f"{row['bytes_per_s_total']:.1f} in all, ttfb {row['ttfb_s']} (p99 {row['ttfb_p99_s']}), "
                          f"{row['errors']} errors", file=sys.stderr, flush=True)
        finally:
            stop_processes(procs)
    res = {"command": invoked(), "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds,
           "n_bytes": f"{args.bytes} (block chain) and {args.ar_bytes} (AR chain)",
           "models": f"blocks {shown([str(blocks)])}" + (f", AR {shown([str(ar)])}" if ar else "")
                     + ("" if args.blocks and args.ar else f" (trained here for 20 steps: {' '.join(SHAPE)}; AR 6 layers)"),
           "defaults": d.as_dict(),
           "rows": rows, **checks}
    publish("api", res, metrics(res), render, out=args.results)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
