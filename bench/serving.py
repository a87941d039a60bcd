"""Serving benchmark (issue #4, design §4 and §6.6): the one-sweep chain of 3 block stages at
K ∈ {1, 16, 64, 256} against the autoregressive baseline split over 3 stages of the same daemon,
generating 256 new bytes, over loopback and over an emulated WAN of 20 ms one-way per hop at
100 Mbit/s (network namespaces, tbf, userspace delay line; needs root).

    .venv/bin/python bench/quality.py --profile serving   # first: trains the model served here
    .venv/bin/python bench/serving.py                     # ~10 min on 2 cores

Latency is the wall time of a whole request seen by the client (median of --reps after a
warm-up); bytes/s = new bytes / latency; traversals = chain traversals the request took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS, update_section  # noqa: E402

CLI = [sys.executable, "-m", "btnode_cli.main"]
KS = (1, 16, 64, 256)
N_BYTES = 256
BLOCK_PORT, AR_PORT = 7100, 7200  # + stage index, inside each host's namespace


def client(entry_block: str, entry_ar: str, reps: int, n_bytes: int, ks: list[int]) -> dict:
    """Runs where the requests come from (inside h0 on the emulated WAN)."""
    from btnode.rpc.stages import generate_remote

    def one(entry: str, k: int) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        first = None
        last = None
        for reply in generate_remote(entry, b"", n_bytes=n_bytes, k=k, seed=0, temperature=0.0):
            first = first or time.perf_counter() - t0
            last = reply
        assert last is not None
        return time.perf_counter() - t0, first or 0.0, last.traversals

    out: dict = {}
    for name, entry, k in [*((f"k{k}", entry_block, k) for k in ks), ("ar", entry_ar, 0)]:
        one(entry, k)  # warm-up
        runs = [one(entry, k) for _ in range(reps)]
        lat = statistics.median(r[0] for r in runs)
        out[name] = {"latency_s": lat, "first_segment_s": statistics.median(r[1] for r in runs),
                     "bytes_per_s": n_bytes / lat, "traversals": runs[0][2], "latencies": [r[0] for r in runs]}
        print(f"[serving] {name}: {lat:.3f} s, {n_bytes / lat:.1f} bytes/s, {runs[0][2]} traversals", flush=True)
    return out


def start_chains(checkpoints: dict, launch, address, workdir: Path) -> list[subprocess.Popen]:
    """Block stages and AR stages at positions 0..2; launch(i, cmd, log) runs cmd on position i's host."""
    procs = []
    for pos in (2, 1, 0):
        nxt_b = [] if pos == 2 else ["--next", f"{address(pos + 1)}:{BLOCK_PORT + pos + 1}"]
        nxt_a = [] if pos == 2 else ["--next", f"{address(pos + 1)}:{AR_PORT + pos + 1}"]
        for kind, port, extra in (("block", BLOCK_PORT, ["--block", str(pos), "--checkpoint", checkpoints["blocks"]] + nxt_b),
                                  ("ar", AR_PORT, ["--model", "ar", "--checkpoint", checkpoints["ar"],
                                                   "--layers-range", f"{2 * pos}:{2 * pos + 2}"] + nxt_a)):
            pf = workdir / f"{kind}{pos}.port"
            pf.unlink(missing_ok=True)
            cmd = CLI + ["join", "--role", "stage", "--listen", f"0.0.0.0:{port + pos}", "--port-file", str(pf),
                         "--worker-id", f"{kind}{pos}", *extra]
            procs.append(launch(pos, cmd, workdir / f"{kind}{pos}.log"))
            deadline = time.monotonic() + 120
            while not pf.exists():
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"stage {kind}{pos} did not start; see {workdir}/{kind}{pos}.log")
                time.sleep(0.1)
    return procs


def run_link(link: str, checkpoints: dict, reps: int, ks: list[int], workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    client_cmd = [sys.executable, __file__, "--client", "--reps", str(reps), "--ks", ",".join(map(str, ks))]
    if link == "loopback":
        procs = start_chains(checkpoints, lambda pos, cmd, log: subprocess.Popen(cmd, stdout=open(log, "w"),
                                                                                stderr=subprocess.STDOUT),
                             lambda pos: "127.0.0.1", workdir)
        try:
            out = subprocess.run(client_cmd + ["--entry-block", f"127.0.0.1:{BLOCK_PORT}", "--entry-ar",
                                               f"127.0.0.1:{AR_PORT}"], check=True, capture_output=True, text=True)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
        return json.loads(out.stdout.strip().splitlines()[-1])
    from btnode.netlab.topology import Chain

    reason = Chain.why_unavailable()
    if reason:
        raise SystemExit(f"cannot emulate the WAN here: {reason}")
    with Chain(4, delay_ms=20, rate_mbit=100) as lab:  # h0 = client, h1..h3 = stage positions 0..2
        procs = start_chains(checkpoints, lambda pos, cmd, log: lab.popen(pos + 1, cmd, stdout=open(log, "w"),
                                                                          stderr=subprocess.STDOUT),
                             lambda pos: lab.address(pos + 1), workdir)
        try:
            out = subprocess.run(["ip", "netns", "exec", lab.host(0), *client_cmd, "--entry-block",
                                  f"{lab.address(1)}:{BLOCK_PORT}", "--entry-ar", f"{lab.address(1)}:{AR_PORT}"],
                                 check=True, capture_output=True, text=True)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one rep, K ∈ {16, 256}, no report")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--entry-block", help=argparse.SUPPRESS)
    ap.add_argument("--entry-ar", help=argparse.SUPPRESS)
    ap.add_argument("--ks", default=",".join(map(str, KS)), help=argparse.SUPPRESS)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.client:
        print(json.dumps(client(args.entry_block, args.entry_ar, args.reps, N_BYTES, ks)))
        return
    qpath = RESULTS / "quality_serving.json"
    if not qpath.exists():
        raise SystemExit(f"{qpath} is missing: run `.venv/bin/python bench/quality.py --profile serving` first")
    quality = json.loads(qpath.read_text())
    if args.quick:
        args.reps, ks = 1, [16, 256]
    workdir = Path(tempfile.mkdtemp(prefix="btnode-serving-"))
    links = {link: run_link(link, quality["checkpoints"], args.reps, ks, workdir / link) for link in ("loopback", "wan")}
    wan = links["wan"]
    res = {"links": links, "sce": quality["sce"], "ar_ce": quality["ar_total_ce"], "n_bytes": N_BYTES,
           "reps": args.reps, "date": time.strftime("%Y-%m-%d"),
           "wan_traversals_ar": wan["ar"]["traversals"]}
    if "k64" in wan:
        res.update(wan_speedup_k64=wan["k64"]["bytes_per_s"] / wan["ar"]["bytes_per_s"],
                   wan_traversals_k64=wan["k64"]["traversals"])
    print(json.dumps(res, indent=1))
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps(res, indent=1) + "\n")
    update_section("serving", render(res))


def render(r: dict) -> str:
    lines = [
        "## Serving: one sweep per segment vs one traversal per byte (`bench/serving.py`)",
        "",
        f"Command: `.venv/bin/python bench/serving.py` ({r['date']}; 2 cores), after "
        "`bench/quality.py --profile serving` trained the model (N = 256). Three stages per chain, each its own "
        "`btnode join --role stage` process; the AR baseline is the 6-layer model split 2/2/2 over three stages of "
        f"the same daemon, with KV caches. {r['n_bytes']} new bytes after an empty prompt, greedy, median of "
        f"{r['reps']} requests after a warm-up. WAN: client and stages in four network namespaces in a row, each hop "
        "20 ms one way (userspace delay line) at 100 Mbit/s (tbf). SCE is the serving model's held-out SCE at that K "
        "(from `bench/quality.py --profile serving`); the AR column shows its teacher-forced CE.",
        "",
        "| link | chain | K | latency (s) | bytes/s | traversals | first segment (s) | SCE-8 (nats/byte) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for link, res in r["links"].items():
        for name, v in res.items():
            k = name[1:] if name.startswith("k") else "—"
            chain = "one-sweep" if name.startswith("k") else "autoregressive"
            q = r["sce"][k]["sce8"] if k in r["sce"] else r["ar_ce"]
            lines.append(f"| {link} | {chain} | {k} | {v['latency_s']:.3f} | {v['bytes_per_s']:.1f} | {v['traversals']} | "
                         f"{v['first_segment_s']:.3f} | {q:.4f} |")
    if "wan_speedup_k64" in r:
        lines += ["", f"Over the emulated WAN the one-sweep chain at K = 64 delivers **{r['wan_speedup_k64']:.1f}×** the "
                  f"autoregressive chain's bytes/s ({r['wan_traversals_k64']} traversals against "
                  f"{r['wan_traversals_ar']}; aim ≥ 20×)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
