"""Data at scale: `btnode data prepare` on a multi-GB text corpus (its rate and peak memory), and the
peak memory of a worker's training steps on that dataset (local and fed over HTTP) beside the same
steps on the bundled corpus.

The input is the bundled WikiText-2 text (valid + test) repeated verbatim until it reaches --gb: the
only text of that size on this machine. Repeats are identical documents, so every copy of a
paragraph lands in the same split; the split fractions of the manifest are those of the distinct
paragraphs. Each measured command is a child process measured by wait4 (peak RSS of that process
alone). The "worker" is `btnode train-local --block 0` (a swarm worker's training steps, without the
aggregator); its steps draw windows across the whole train split. The HTTP-fed worker reads the
dataset from the standard library's static file server (in this process) on 127.0.0.1 with an empty cache, so its first step downloads
and hashes every shard its first batch touches.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

from bench.flags import BenchParser
from bench.report import invoked, measure, publish, shown, table
from bench.runs import Metric

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # the workers measured here are measured for memory, one thread each

BTNODE = str(Path(sys.executable).with_name("btnode"))
MB = 1e6


def write_input(path: Path, gb: float) -> int:
    """The bundled text repeated to at least `gb` × 10^9 bytes; returns its size."""
    from btnode.data.corpus import bundled_file

    piece = bundled_file("wiki.valid.raw") + bundled_file("wiki.test.raw")
    target, written = int(gb * 1e9), 0
    with open(path, "wb") as f:
        while written < target:
            f.write(piece)
            written += len(piece)
        f.flush()
        os.fsync(f.fileno())
    return written


def drop_caches() -> bool:
    """Empty the page cache (root only), so prepare reads its input from disk; False when not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class QuietHandler(SimpleHTTPRequestHandler):
    """The standard library's static file server (no Range support: a resumed download restarts),
    without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def train(data: str | None, out: Path, steps: int, *extra: str) -> tuple[list[str], float, float]:
    cmd = [BTNODE, "train-local", "--block", "0", "--steps", str(steps), "--out", str(out), *extra]
    if data is not None:
        cmd += ["--data", data]
    m = measure(cmd)
    return cmd, m.wall_s, m.max_rss_mb


def main() -> None:
    p = BenchParser(__doc__)
    p.result("data")
    p.add_argument("--gb", type=float, default=4.2, help="size of the generated input, 10^9 bytes")
    p.add_argument("--steps", type=int, default=3, help="training steps of each measured worker")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    p.quick("0.05 GB, for a smoke run", gb=0.05)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="btnode-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    publish("data", result, metrics(result), render, out=args.results)


def run(args, work: Path) -> dict:
    src, dataset, cache = work / "input.txt", work / "dataset", work / "cache"
    size = write_input(src, args.gb)
    print(f"[data] input {size / 1e9:.2f} GB of repeated WikiText-2 at {src}", flush=True)
    cold = drop_caches()
    prep_cmd = [BTNODE, "data", "prepare", str(src), "--out", str(dataset)]
    prep = measure(prep_cmd)
    shard_bytes = sum(f.stat().st_size for f in dataset.rglob("*.bin"))
    print(f"[data] prepare {size / MB / prep.wall_s:.1f} MB/s, peak {prep.max_rss_mb:.0f} MB "
          f"(page cache {'dropped' if cold else 'warm'})", flush=True)
    src.unlink()  # what follows needs only the dataset

    runs = {}
    for name, data in (("bundled", None), ("large", str(dataset))):
        cmd, wall, rss = train(data, work / f"out-{name}", args.steps)
        runs[name] = {"command": shown(cmd), "wall_s": wall, "peak_rss_mb": rss}
        print(f"[data] worker on {name}: peak {rss:.0f} MB, {wall:.1f} s", flush=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(dataset)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/manifest.json"
        cache_gb = str(max(1.0, 2 * shard_bytes / 1e9))
        for name, steps in (("http_first", 1), ("http", args.steps)):
            shutil.rmtree(cache, ignore_errors=True)
            cmd, wall, rss = train(url, work / f"out-{name}", steps, "--data-cache", str(cache),
                                   "--data-cache-gb", cache_gb)
            cached = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0
            runs[name] = {"command": shown(cmd), "wall_s": wall, "peak_rss_mb": rss, "cache_mb": cached / MB}
            print(f"[data] HTTP worker, {steps} step(s), cold cache: peak {rss:.0f} MB, {wall:.1f} s, "
                  f"{cached / MB:.0f} MB fetched", flush=True)
        _, bundled_one, _ = train(None, work / "out-bundled-1", 1)
        runs["bundled_first"] = {"wall_s": bundled_one}
    finally:
        server.shutdown()
        server.server_close()

    return {
        "command": invoked(),
        "input": f"bundled WikiText-2 valid+test repeated to {size / 1e9:.2f} GB (identical copies)",
        "dataset_gb": shard_bytes / 1e9,
        "prepare_command": shown(prep_cmd).replace(str(work), "WORK"),
        "prepare_s": prep.wall_s,
        "prepare_mb_per_s": size / MB / prep.wall_s,
        "prepare_peak_rss_mb": prep.max_rss_mb,
        "prepare_page_cache": "dropped before" if cold else "warm (could not drop: not root)",
        "worker_rss_mb_bundled": runs["bundled"]["peak_rss_mb"],
        "worker_rss_mb_large": runs["large"]["peak_rss_mb"],
        "worker_rss_mb_http": runs["http"]["peak_rss_mb"],
        "http_first_step_s": runs["http_first"]["wall_s"],
        "bundled_first_step_s": runs["bundled_first"]["wall_s"],
        "runs": {k: {**v, **({"command": v["command"].replace(str(work), "WORK")} if "command" in v else {})}
                 for k, v in runs.items()},
        "steps": args.steps,
        "when": time.strftime("%Y-%m-%d"),
    }


def metrics(res: dict) -> dict[str, Metric]:
    """Preparing a multi-GB dataset (speed, memory) and a worker's memory and first step on each source."""
    return {"prepare MB/s": res["prepare_mb_per_s"], "prepare peak RSS (MB)": res["prepare_peak_rss_mb"],
            "worker RSS, bundled (MB)": res["worker_rss_mb_bundled"],
            "worker RSS, large dataset (MB)": res["worker_rss_mb_large"],
            "worker RSS, over HTTP (MB)": res["worker_rss_mb_http"], "first step over HTTP (s)": res["http_first_step_s"]}


def render(r: dict) -> str:
    lines = ["## Data at scale", "",
             f"`{r['command']}` ({r['when']}). Input: {r['input']}; prepared dataset {r['dataset_gb']:.2f} GB "
             f"(`{r['prepare_command']}`, page cache {r['prepare_page_cache']}). Workers: "
             f"`btnode train-local --block 0 --steps {r['steps']}` (default shape), peak RSS by wait4.", ""]
    lines += table(["measured", "value"], [
        ["prepare rate", f"{r['prepare_mb_per_s']:.1f} MB/s"],
        ["prepare peak RSS", f"{r['prepare_peak_rss_mb']:.0f} MB"],
        ["worker peak RSS, bundled corpus", f"{r['worker_rss_mb_bundled']:.0f} MB"],
        [f"worker peak RSS, {r['dataset_gb']:.1f} GB dataset (read in windows)", f"{r['worker_rss_mb_large']:.0f} MB"],
        ["worker peak RSS, same dataset over HTTP", f"{r['worker_rss_mb_http']:.0f} MB"],
        ["1-step run, bundled (process start to exit)", f"{r['bundled_first_step_s']:.1f} s"],
        ["1-step run over HTTP, cold cache", f"{r['http_first_step_s']:.1f} s "
                                             f"({r['runs']['http_first']['cache_mb']:.0f} MB fetched)"],
    ], "lr")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
