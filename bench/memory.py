"""Memory at scale (issue #12, item 3): peak RSS and training-state bytes of a process training one
block against a process training the whole model, at several widths, with `btnode plan`'s
prediction beside each measurement.

"The whole model" is the B·L-layer autoregressive model (`btnode train-ar`): what a lab trains
instead, and what every DiLoCo worker holds a replica of. Each run is its own child measured with
wait4, twice: the btnode command itself (which writes a checkpoint with optimizer state at the end)
and a bare training loop without checkpoints (what a swarm worker's steps need). This process
never imports torch, so it stays small and measures nothing of its own.

The capped part (item 4; `--capped` runs it alone and merges it into the results): at the largest
size, every worker in its own cgroup v1 memory group capped between plan's estimate for a block
worker and for a full-replica (--model ar) worker. The full replica must be refused before it
builds anything; the B block workers then train 2 rounds each through a real aggregator, one at a
time (B capped workers at once would not fit this host), under the same cap. Needs root and the
cgroup v1 memory controller.

The traffic part (`--traffic` runs it alone and merges it into the results, ~8 min): bytes per
worker-round at d = 1024, where the model and not the runtime is what moves, for a block
worker at full-rank and at low-rank σ-conditioning (--ada-rank) and for a DiLoCo worker of the
B·L-layer AR model (issue #12's bytes aim; bench/diloco.py measures the same at d = 128 over a WAN).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench.flags import BenchParser, shape_flags
from bench.report import ROOT, measure, module_command, previous, publish, shown, table
from bench.runs import Metric
from btnode.model.config import ModelConfig
from btnode.node.launch import start_node

# One thread: this benchmark measures bytes, not speed, and the machine is shared; the children inherit it.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

BTNODE = str(Path(sys.executable).with_name("btnode"))
BLOCKS, LAYERS, CONTEXT, BATCH, STEPS = 4, 2, 128, 2, 2
# (d_model, heads, batch). Head width 64; the largest AR model has 310 M parameters. The first row is
# the project's default width at its default batch, where activations, not the state, dominate.
SIZES = [(128, 4, 32), (512, 8, BATCH), (1024, 16, BATCH), (1792, 28, BATCH)]
QUICK_SIZES = [(64, 2, 8), (96, 2, BATCH), (128, 2, BATCH)]
GB, MB = 1e9, 2**20
V1 = Path("/sys/fs/cgroup/memory")
CAPPED_ROUNDS, CAPPED_H = 2, 2
TRAFFIC_ROUNDS, TRAFFIC_RANK = 3, 32


def config(d: int, heads: int) -> ModelConfig:
    """The measured model at width d: B blocks of L layers over N bytes."""
    return ModelConfig(d_model=d, n_heads=heads, n_layers=LAYERS, n_blocks=BLOCKS, context=CONTEXT, segments=(1, 16))


def shape(d: int, heads: int) -> list[str]:
    return shape_flags(config(d, heads))


def parameters(folder: Path, stem: str) -> int:
    """Parameter count of a written checkpoint, from its safetensors header (no torch needed)."""
    with open(folder / f"{stem}.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, spec in header.items():
        if name != "__metadata__":
            count = 1
            for s in spec["shape"]:
                count *= s
            total += count
    return total


def train_loop(kind: str, cfg: ModelConfig, steps: int, batch: int) -> None:
    """Child: `steps` training steps of block 0 or of the AR model, no checkpoint (a swarm worker's steps)."""
    import torch

    from btnode.data import corpus
    from btnode.data.windows import WindowSampler
    from btnode.model.targets import target_table
    from btnode.store.models import init_ar, init_block
    from btnode.train.config import TrainConfig
    from btnode.train.trainers import ARTrainer, BlockTrainer

    tc = TrainConfig(batch=batch, steps=steps, warmup=0)
    cpu = torch.device("cpu")
    trainer = (BlockTrainer(init_block(cfg, 0, 0), tc, block=0, table=target_table(cfg), device=cpu) if kind == "block"
               else ARTrainer(init_ar(cfg, BLOCKS * LAYERS, 0), tc, cpu))
    sampler = WindowSampler(corpus.load(None).train, cfg.context)
    for step in range(steps):
        trainer.train_step(sampler.batch(0, 0, step, batch), 0)


def plan_mb(doc: dict, part: str, key: str) -> float:
    return doc[part][key] / MB


def one_size(d: int, heads: int, out: Path, steps: int, batch: int) -> dict:
    sh = shape(d, heads)
    common = ["--steps", str(steps), "--batch", str(batch), "--warmup", "0", "--checkpoint-every", str(steps)]
    cmds = {
        "block": [BTNODE, "train-local", "--out", str(out / "block"), *common, "--block", "0", *sh],
        "full": [BTNODE, "train-ar", "--out", str(out / "full"), *common, "--ar-layers", str(BLOCKS * LAYERS), *sh],
        "block_train": module_command("bench.memory", "--child", "block", "--d-model", str(d), "--heads", str(heads),
                                      "--steps", str(steps), "--batch", str(batch)),
        "full_train": module_command("bench.memory", "--child", "ar", "--d-model", str(d), "--heads", str(heads),
                                     "--steps", str(steps), "--batch", str(batch)),
        "plan": [BTNODE, "plan", "--json", "--batch", str(batch), *sh],
    }
    rss, walls = {}, {}
    for name in ("block", "full", "block_train", "full_train"):  # one at a time: the big ones never overlap
        m = measure(cmds[name])
        rss[name], walls[name] = m.max_rss_mb, m.wall_s
        print(f"[memory] d={d} {name}: peak RSS {m.max_rss_mb:,.0f} MB in {m.wall_s:.0f} s", flush=True)
    n_block, n_full = parameters(out / "block", "block-0"), parameters(out / "full", "ar")
    shutil.rmtree(out)  # gigabytes of checkpoints, read for their headers only
    p = measure(cmds["plan"])
    doc = json.loads(p.stdout)
    row = {
        "d_model": d, "heads": heads, "batch": batch, "block_params": n_block, "full_params": n_full,
        # training state: fp32 parameters, gradients and AdamW's two moments, 16 bytes per parameter
        "block_state_gb": 16 * n_block / GB, "full_state_gb": 16 * n_full / GB,
        "block_rss_mb": rss["block"], "full_rss_mb": rss["full"],
        "block_train_rss_mb": rss["block_train"], "full_train_rss_mb": rss["full_train"],
        "plan_block_mb": plan_mb(doc, "worker", "peak_bytes"), "plan_full_mb": plan_mb(doc, "end_to_end", "peak_bytes"),
        "plan_block_train_mb": plan_mb(doc, "worker", "train_peak_bytes"),
        "plan_full_train_mb": plan_mb(doc, "end_to_end", "train_peak_bytes"),
        "plan_block_params": doc["worker"]["parameters"], "plan_full_params": doc["end_to_end"]["parameters"],
        "plan_s": p.wall_s, "wall_s": walls,
        "commands": {k: shown(v) for k, v in cmds.items()},
    }
    for part in ("block", "full", "block_train", "full_train"):
        row[f"error_{part}"] = abs(row[f"plan_{part}_mb"] - row[f"{part}_rss_mb"]) / row[f"{part}_rss_mb"]
    print(f"[memory] d={d}: plan {row['plan_block_mb']:,.0f} / {row['plan_full_mb']:,.0f} MB, errors "
          f"{row['error_block']:.1%} / {row['error_full']:.1%} (training only {row['error_block_train']:.1%} / "
          f"{row['error_full_train']:.1%})", flush=True)
    return row


def memory_group(name: str, limit: int) -> Path:
    """A child of this process's cgroup v1 memory group with memory.limit_in_bytes = limit."""
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if "memory" in line.split(":", 2)[1].split(","))
    group = V1 / own.lstrip("/") / f"btnode-bench-{os.getpid()}-{name}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return group


def remove_group(group: Path) -> None:
    deadline = time.monotonic() + 10
    while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    group.rmdir()


def run_capped(group: Path, args: list[str], log: Path) -> dict:
    """`btnode ARGS` moved into `group` before it execs; exit code, wall, wait4 peak RSS and the group's
    peak usage (memory.max_usage_in_bytes: RSS plus page cache charged to it) and failcnt."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), BTNODE, *args],
                                stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit_code": proc.returncode, "wall_s": time.perf_counter() - t0, "max_rss_mb": usage.ru_maxrss / 1024,
            "group_max_usage_mb": int((group / "memory.max_usage_in_bytes").read_text()) / MB,
            "group_failcnt": int((group / "memory.failcnt").read_text()),
            "command": shown([BTNODE, *args]), "log_tail": log.read_text(errors="replace").strip().splitlines()[-3:]}


def start_aggregator(out: Path, sh: list[str], training: list[str],
                     extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, list[str], str]:
    """A real aggregator on loopback owning every unit of the model `sh` describes, checking claims by
    the workers' `training` flags (--steps-per-round, --batch): (process, command, peer)."""
    args = ["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(out / "agg"),
            "--deadline", "300", "--min-updates", "1", "--keep", "2", *training, *extra, *sh,
            "--no-identities", "--audit", "0"]  # as measured before #38's defaults (identities, audits); docs/security.md for the defaults' costs
    agg = start_node(args, port_file=out / "port", log=out / "aggregator.log", timeout_s=600, name="aggregator")
    return agg.proc, [BTNODE, *args, "--port-file", str(out / "port")], agg.address()


def unit_parameters(d: int, heads: int, rank: int, ar: bool) -> int:
    """Parameters of block 0 (or of the B·L-layer AR model), counted in a child on torch's meta device."""
    code = ("import torch; from btnode.model.config import ModelConfig; from btnode.store.models import init_unit\n"
            f"cfg = ModelConfig(d_model={d}, n_heads={heads}, n_layers={LAYERS}, n_blocks={BLOCKS}, context={CONTEXT}, "
            f"segments=(1, 16), ada_rank={rank}" + (f", kind='ar', ar_layers={BLOCKS * LAYERS})" if ar else ")") + "\n"
            "with torch.device('meta'):\n    print(sum(p.numel() for p in init_unit(cfg, 0, 0).parameters()))")
    return int(measure([sys.executable, "-c", code]).stdout.split()[-1])


def codec_flags(spec: str) -> tuple[list[str], list[str]]:
    """"sparse2:0.01/sparse8:0.03" → the worker's (--codec, --density) and the aggregator's
    (--publish-codec, --publish-density) flags; "int8" → int8 updates, published as today."""
    up, _, down = spec.partition("/")
    codec, _, density = up.partition(":")
    worker = ["--codec", codec, *(["--density", density] if density else [])]
    if not down:
        return worker, []
    pub, _, pub_density = down.partition(":")
    return worker, ["--publish-codec", pub, *(["--publish-density", pub_density] if pub_density else [])]


def traffic(d: int, heads: int, batch: int, rank: int, out: Path, spec: str = "int8") -> dict:
    """Bytes per worker-round at one size (issue #12's bytes aim, measured where the model is large): a
    worker of block 0 with full-rank σ-conditioning, one with --ada-rank RANK, and a DiLoCo worker of the
    B·L-layer AR model (--model ar), each through its own aggregator for TRAFFIC_ROUNDS rounds of one step,
    int8 updates (or `spec`'s codecs, codec_flags; then without the low-rank run). Bytes per worker-round =
    (wire bytes pushed + pulled) / pushes, from the worker's stats file, as bench/diloco.py counts them."""
    runs = {"block": [], "block_lowrank": ["--ada-rank", str(rank)], "ar": ["--model", "ar"]}
    if spec != "int8":
        del runs["block_lowrank"]
    worker_codec, publish = codec_flags(spec)
    res: dict = {"d_model": d, "heads": heads, "batch": batch, "ada_rank": rank, "rounds": TRAFFIC_ROUNDS, "runs": {},
                 "codecs": spec}
    for name, flags in runs.items():
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        sh = [*shape(d, heads), *flags]
        training = ["--steps-per-round", "1", "--batch", str(batch)]
        agg, _, peer = start_aggregator(folder, sh, training, tuple(publish))
        unit = [] if name == "ar" else ["--block", "0"]
        cmd = [BTNODE, "join", "--role", "worker", *unit, "--peer", peer, "--worker-id", f"traffic-{name}",
               "--rounds", str(TRAFFIC_ROUNDS), *training, *worker_codec,
               "--stats-file", str(folder / "stats.json"), *sh]
        try:
            w = measure(cmd)
        finally:
            agg.terminate()
            _, _, usage = os.wait4(agg.pid, 0)  # the aggregator's own peak: it owns every unit of the model
        st = json.loads((folder / "stats.json").read_text())
        if st["outcomes"] != {"pending": TRAFFIC_ROUNDS}:
            raise SystemExit(f"traffic {name}: outcomes {st['outcomes']}, logs in {folder}")
        res["runs"][name] = {"command": shown(cmd), "pushes": st["pushes"], "peak_rss_mb": w.max_rss_mb,
                             "aggregator_peak_rss_mb": usage.ru_maxrss / 1024,
                             "bytes_per_worker_round": (st["bytes_pushed_wire"] + st["bytes_pulled_wire"]) / st["pushes"],
                             "bytes_pushed_per_round": st["bytes_pushed_wire"] / st["pushes"],
                             "bytes_delta_per_fetch": st["bytes_delta_wire"] / max(1, st["delta_fetches"]),
                             "parameters": unit_parameters(d, heads, rank if name == "block_lowrank" else 0, name == "ar")}
        print(f"[memory] traffic {name}: {res['runs'][name]['bytes_per_worker_round'] / 1e6:,.1f} MB per worker-round, "
              f"{res['runs'][name]['parameters']:,} parameters", flush=True)
        shutil.rmtree(folder)
    ar = res["runs"]["ar"]["bytes_per_worker_round"]
    res["ratio_ar_over_block"] = ar / res["runs"]["block"]["bytes_per_worker_round"]
    if "block_lowrank" in res["runs"]:
        res["ratio_ar_over_block_lowrank"] = ar / res["runs"]["block_lowrank"]["bytes_per_worker_round"]
    return res


def capped(d: int, heads: int, batch: int, out: Path) -> dict:
    """Item 4 at one size: the cap, the full replica's refusal, and the block workers' rounds under it."""
    if os.geteuid() != 0 or not (V1 / "memory.limit_in_bytes").exists():
        raise SystemExit("the capped part needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    sh = shape(d, heads)
    doc = json.loads(measure([BTNODE, "plan", "--json", "--batch", str(batch), *sh]).stdout)
    block_need, full_need = doc["worker"]["swarm_worker_peak_bytes"], doc["end_to_end"]["swarm_worker_peak_bytes"]
    # A quarter above the block worker's estimate, rounded up to 0.5 GiB: room for plan's error
    cap = math.ceil(1.25 * block_need / 2**29) * 2**29
    if not block_need < cap < full_need:
        raise SystemExit(f"no cap between the block worker ({block_need / GB:.2f} GB) and the full replica "
                         f"({full_need / GB:.2f} GB) at d={d}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    training = ["--steps-per-round", str(CAPPED_H), "--batch", str(batch)]
    worker = ["--rounds", str(CAPPED_ROUNDS), *training, "--codec", "int8"]
    agg, agg_cmd, peer = start_aggregator(out, sh, training)
    res: dict = {"d_model": d, "heads": heads, "batch": batch, "rounds": CAPPED_ROUNDS, "steps_per_round": CAPPED_H,
                 "cap_bytes": cap, "cap_gb": cap / GB, "plan_block_worker_gb": block_need / GB,
                 "plan_full_worker_gb": full_need / GB, "aggregator": shown(agg_cmd), "blocks": []}
    groups: list[Path] = []
    try:
        groups.append(memory_group("ar", cap))
        ar = run_capped(groups[-1], ["join", "--role", "worker", "--model", "ar", "--peer", peer, "--worker-id",
                                     "ar-capped", *worker, *sh], out / "ar.log")
        line = ar["log_tail"][-1] if ar["log_tail"] else ""
        ar["refused"] = ar["exit_code"] == 9 and line.startswith("error: a --model ar worker")
        ar["message"] = line
        res["full_replica"] = ar
        print(f"[memory] capped at {cap / GB:.2f} GB: full replica exit {ar['exit_code']} in {ar['wall_s']:.0f} s: "
              f"{line}", flush=True)
        for b in range(BLOCKS):  # one at a time: the host holds one capped worker beside the aggregator
            groups.append(memory_group(f"block{b}", cap))
            stats = out / f"block{b}.json"
            w = run_capped(groups[-1], ["join", "--role", "worker", "--block", str(b), "--peer", peer, "--worker-id",
                                        f"capped-{b}", "--stats-file", str(stats), *worker, *sh], out / f"block{b}.log")
            st = json.loads(stats.read_text()) if stats.exists() else {}
            w.update(block=b, pushes=st.get("pushes", 0), outcomes=st.get("outcomes", {}), version=st.get("version"))
            res["blocks"].append(w)
            print(f"[memory] capped block {b}: exit {w['exit_code']}, {w['pushes']} pushes {w['outcomes']}, peak RSS "
                  f"{w['max_rss_mb']:,.0f} MB (group {w['group_max_usage_mb']:,.0f} MB) in {w['wall_s']:.0f} s",
                  flush=True)
    finally:
        agg.terminate()
        agg.wait(timeout=120)
        for group in groups:
            remove_group(group)
    shutil.rmtree(out)
    res["blocks_trained"] = all(w["exit_code"] == 0 and w["outcomes"] == {"pending": CAPPED_ROUNDS}
                                for w in res["blocks"])
    res["block_worker_peak_rss_mb"] = max(w["max_rss_mb"] for w in res["blocks"])
    res["plan_block_worker_error"] = abs(block_need / MB - res["block_worker_peak_rss_mb"]) / res["block_worker_peak_rss_mb"]
    return res


def metrics(res: dict) -> dict[str, Metric]:
    """A block worker's peak RSS against a full replica's at the largest width, and `btnode plan`'s error."""
    big = res["sizes"][-1]
    out: dict[str, Metric] = {"block / full-model peak RSS": res["largest_block_over_full_rss"],
                              "plan error, largest": res["plan_error_largest"],
                              f"block worker peak RSS, d = {big['d_model']} (MB)": big["block_rss_mb"],
                              f"full replica peak RSS, d = {big['d_model']} (MB)": big["full_rss_mb"]}
    if "traffic_bytes_ratio_ar_over_block" in res:
        out["AR / block bytes per worker-round (×)"] = res["traffic_bytes_ratio_ar_over_block"]
    return out


def render(res: dict) -> str:
    def measured(r: dict, part: str) -> tuple[str, str, str]:  # peak RSS, plan's estimate, plan's error
        return f"{r[f'{part}_rss_mb']:,.0f}", f"{r[f'plan_{part}_mb']:,.0f}", f"{r[f'error_{part}']:.1%}"

    rows = res["sizes"]
    c = rows[-1]["commands"]
    lines = [
        "## Memory at scale (`bench/memory.py`)",
        "",
        f"Command: `.venv/bin/python -m bench.memory` ({res['date']}, {res['machine']}; OMP/MKL threads 1 in every "
        f"child). B={BLOCKS} blocks × L={LAYERS} layers, N={CONTEXT}, {STEPS} steps at the batch shown, fp32, AdamW. "
        f"**Block**: `btnode train-local --block 0` (one worker's block). **Full**: `btnode train-ar --ar-layers "
        f"{BLOCKS * LAYERS}`, the B·L-layer AR model a lab would train instead (and what each DiLoCo worker holds). "
        "Training state = 16 bytes per parameter (parameters, gradients, two AdamW moments), the parameter count "
        "read from the checkpoint each run wrote. Peak RSS from wait4 on each child; the plan column is "
        "`btnode plan --json --batch <batch>` of the same shape (`peak_bytes` of its worker and end-to-end parts: "
        "measured runtime + 16 bytes per parameter + the larger of saved activations and AdamW's temporary + heap "
        "glibc keeps + the checkpoint write, 20 bytes per parameter; see btnode/train/plan.py). MB = MiB.",
        "",
        *table(["d / heads / batch", "block params", "full params", "block state GB", "full state GB", "block peak RSS",
                "plan", "error", "full peak RSS", "plan", "error", "block / full RSS"],
               [(f"{r['d_model']} / {r['heads']} / {r['batch']}", f"{r['block_params'] / 1e6:,.1f} M",
                 f"{r['full_params'] / 1e6:,.1f} M", f"{r['block_state_gb']:.2f}", f"{r['full_state_gb']:.2f}",
                 *measured(r, "block"), *measured(r, "full"), f"{r['block_rss_mb'] / r['full_rss_mb']:.3f}")
                for r in rows], "l" + "r" * 11),
        "",
        "The same steps without the checkpoint write (a bare loop of `BlockTrainer` / `ARTrainer` steps, "
        "`python -m bench.memory --child block|ar ...`), against plan's `train_peak_bytes`:",
        "",
        *table(["d / heads / batch", "block peak RSS", "plan", "error", "full peak RSS", "plan", "error", "block / full RSS"],
               [(f"{r['d_model']} / {r['heads']} / {r['batch']}", *measured(r, "block_train"), *measured(r, "full_train"),
                 f"{r['block_train_rss_mb'] / r['full_train_rss_mb']:.3f}") for r in rows], "l" + "r" * 7),
        "",
        f"Largest size: full-model training state **{res['largest_full_state_gb']:.2f} GB**; block worker peak RSS / "
        f"full-model peak RSS **{res['largest_block_over_full_rss']:.3f}** (aim ≤ 2/B = {2 / BLOCKS:.3f}); plan error "
        f"**{res['plan_error_largest']:.1%}** (the worse of block and full; aim ≤ 15 %). Python + torch + btnode "
        f"imported, nothing built: {res['runtime_rss_mb']:,.0f} MB.",
        "",
        "Commands of the largest row (the other rows: the same with their `--d-model`, `--heads` and `--batch`):",
        "",
        *[f"- {k}: `{v}`" for k, v in c.items()],
    ]
    if res.get("capped"):
        lines += ["", *render_capped(res["capped"], res.get("capped_full_replica_refused"))]
    if res.get("traffic"):
        lines += ["", *render_traffic(res["traffic"])]
    for spec, tr in res.get("traffic_codecs", {}).items():
        lines += ["", *render_traffic_codecs(spec, tr, res.get("traffic"))]
    return "\n".join(lines)


def render_traffic(r: dict) -> list[str]:
    """Bytes per worker-round at one size (issue #12's bytes aim)."""
    names = {"block": "block 0, full-rank σ-conditioning (default)",
             "block_lowrank": f"block 0, `--ada-rank {r['ada_rank']}`",
             "ar": f"DiLoCo replica, {BLOCKS * LAYERS}-layer AR (`--model ar`)"}
    return [
        f"### Bytes per worker-round at d = {r['d_model']} (`bench/memory.py --traffic`, {r.get('date', '')})",
        "",
        f"One worker per row through its own loopback aggregator, {r['rounds']} rounds of one step at batch "
        f"{r['batch']}, int8 updates with error feedback; (wire bytes pushed + pulled) / pushes from the worker's "
        f"stats file, as `bench/diloco.py` counts them. B = {BLOCKS}, L = {LAYERS}. A block run's aggregator owns all "
        f"{BLOCKS} blocks (one of them training); the AR run's owns its one unit.",
        "",
        *table(["worker", "parameters", "MB per worker-round", "MB pushed per round", "worker peak RSS MB",
                "aggregator peak RSS MB", "command"],
               [(names[n], f"{w['parameters']:,}", f"{w['bytes_per_worker_round'] / 1e6:,.1f}",
                 f"{w['bytes_pushed_per_round'] / 1e6:,.1f}", f"{w['peak_rss_mb']:,.0f}",
                 f"{w['aggregator_peak_rss_mb']:,.0f}", f"`{w['command']}`") for n, w in r["runs"].items()], "lrrrrrl"),
        "",
        f"DiLoCo over BlockTrain, bytes per worker-round: **{r['ratio_ar_over_block']:.2f}×** at full rank, "
        f"**{r['ratio_ar_over_block_lowrank']:.2f}×** with `--ada-rank {r['ada_rank']}` (aim ≥ B = {BLOCKS}).",
    ]


def render_traffic_codecs(spec: str, r: dict, int8: dict | None) -> list[str]:
    """The traffic table again with other codecs (issue #24), against the int8 table's bytes."""
    names = {"block": "block 0", "ar": f"DiLoCo replica, {BLOCKS * LAYERS}-layer AR (`--model ar`)"}

    def steady(w: dict) -> float:
        """A round once joined: one push and one published delta (the join's full pull left out)."""
        return w["bytes_pushed_per_round"] + w["bytes_delta_per_fetch"]

    def fewer(n: str, w: dict) -> str:
        base = (int8 or {}).get("runs", {}).get(n)
        return f"{base['bytes_per_worker_round'] / steady(w):,.0f}×" if base else "—"

    return [
        f"### Bytes per worker-round at d = {r['d_model']} with `{spec}` (`bench/memory.py --traffic "
        f"--traffic-codecs {spec}`, {r.get('date', '')})",
        "",
        "The same runs as the table above with these codecs (worker codec:density / publish codec:density). "
        "A round once joined moves one push and one published delta; the join's full fp32 pull, which the int8 "
        "table spreads over its rounds, is left out here (it is paid once per join). Bits per parameter = "
        "8 × (push + delta) / parameters; fewer bytes = the int8 table's MB per worker-round over push + delta.",
        "",
        *table(["worker", "parameters", "MB pushed per round", "MB per published delta", "bits/param up + down",
                "fewer bytes than int8", "command"],
               [(names[n], f"{w['parameters']:,}", f"{w['bytes_pushed_per_round'] / 1e6:,.3f}",
                 f"{w['bytes_delta_per_fetch'] / 1e6:,.3f}", f"{8 * steady(w) / w['parameters']:.3f}",
                 fewer(n, w), f"`{w['command']}`") for n, w in r["runs"].items()], "lrrrrrl"),
    ]


def render_capped(r: dict, refused: bool | None) -> list[str]:
    """The memory-capped workers row (item 4)."""
    ar, blocks = r["full_replica"], r["blocks"]

    def run(w: dict) -> tuple[object, ...]:
        return w["exit_code"], f"{w['wall_s']:.0f}", f"{w['max_rss_mb']:,.0f}", f"{w['group_max_usage_mb']:,.0f}"

    return [
        f"### Memory-capped workers (`bench/memory.py --capped`, {r.get('date', '')})",
        "",
        f"Each worker in its own cgroup v1 memory group, `memory.limit_in_bytes` = **{r['cap_gb']:.2f} GB** "
        f"(1.25 × plan's block-worker estimate, rounded up to 0.5 GiB), at d={r['d_model']} / {r['heads']} heads / "
        f"batch {r['batch']}, against one aggregator owning all {BLOCKS} blocks; {r['rounds']} rounds of "
        f"H={r['steps_per_round']}, int8 updates. `btnode plan`'s swarm-worker estimate (training peak + the "
        f"worker's copies): block {r['plan_block_worker_gb']:.2f} GB, full replica ({BLOCKS * LAYERS}-layer AR, "
        f"`--model ar`) {r['plan_full_worker_gb']:.2f} GB.",
        "",
        *table(["worker", "exit", "wall s", "peak RSS MB", "group peak MB", "outcome"],
               [("full replica (`--model ar`)", *run(ar), "refused before building it" if ar["refused"] else "NOT refused"),
                *((f"block {w['block']}", *run(w), f"{w['pushes']} pushes {w['outcomes']}") for w in blocks)], "lrrrrl"),
        "",
        f"Refusal line: `{ar['message']}`",
        "",
        f"capped_full_replica_refused = **{str(refused).lower()}**; block workers trained under the cap: "
        f"**{str(r['blocks_trained']).lower()}**; block worker peak RSS {r['block_worker_peak_rss_mb']:,.0f} MB against plan's "
        f"{r['plan_block_worker_gb'] * GB / MB:,.0f} MB ({r['plan_block_worker_error']:.1%} off). Aggregator: "
        f"`{r['aggregator']}`; block worker: `{blocks[0]['command'] if blocks else ''}`.",
    ]


def merge(args: argparse.Namespace, **part) -> None:
    """One part run alone (--capped, --traffic): merge its keys into the existing results and report."""
    res = {**previous(args.results), **part}
    publish("memory", res, metrics(res), None if args.no_report else render, out=args.results)


def main() -> None:
    ap = BenchParser(__doc__.split("\n\n")[0])
    ap.quick(help="Tiny widths: a smoke test of the benchmark itself.")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-memory")
    ap.result("memory", flag="--json")
    ap.add_argument("--no-report", action="store_true", help="Leave BENCHMARKS.md alone.")
    ap.add_argument("--capped", action="store_true",
                    help="Only the memory-capped workers part (item 4), merged into the existing results.")
    ap.add_argument("--traffic", action="store_true",
                    help="Only the bytes-per-worker-round part (d = 1024), merged into the existing results.")
    ap.add_argument("--traffic-codecs", default="int8", metavar="SPEC",
                    help="With --traffic: the codecs, UP[:DENSITY][/PUBLISH[:DENSITY]], e.g. sparse2:0.01/sparse8:0.03 "
                         "(results under traffic_codecs[SPEC]; int8, the default, is the main traffic table).")
    ap.add_argument("--child", choices=("block", "ar"), help=argparse.SUPPRESS)
    ap.shape(config(128, 4), "d_model", "n_heads", hidden=True)  # the --child's width
    ap.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train_loop(args.child, args.shape, args.steps, args.batch)
        return
    t0 = time.perf_counter()
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.traffic:
        # d = 1024, not the largest size: at d = 1792 the DiLoCo run's aggregator (14.9 GB resident for
        # the 310 M-parameter unit) and its worker do not fit this 24 GB host together (OOM-killed).
        d, h, b = (64, 2, BATCH) if args.quick else sizes[-2]
        tr = {**traffic(d, h, b, TRAFFIC_RANK, args.out / "traffic", args.traffic_codecs),
              "date": time.strftime("%Y-%m-%d")}
        print(json.dumps({k: v for k, v in tr.items() if k != "runs"}, indent=1))
        if args.quick:
            return
        if args.traffic_codecs != "int8":
            others = previous(args.results).get("traffic_codecs", {})
            merge(args, traffic_codecs={**others, args.traffic_codecs: tr})
            return
        merge(args, traffic=tr, traffic_bytes_ratio_ar_over_block=tr["ratio_ar_over_block"],
              traffic_bytes_ratio_ar_over_block_lowrank=tr["ratio_ar_over_block_lowrank"])
        return
    if args.capped:
        d, h, b = (512, 8, BATCH) if args.quick else sizes[-1]  # quick: the integration test's shape
        cap = {**capped(d, h, b, args.out / "capped"), "date": time.strftime("%Y-%m-%d")}
        refused = cap["full_replica"]["refused"]
        print(json.dumps({k: v for k, v in cap.items() if k != "blocks"}, indent=1))
        if args.quick:
            return
        merge(args, capped=cap, capped_full_replica_refused=refused,
              notes="capped_full_replica_refused: observed in the capped part (bench/memory.py --capped).")
        return
    rows = [one_size(d, h, args.out / f"d{d}-b{b}", STEPS, b) for d, h, b in sizes]
    base = measure([sys.executable, "-c", "import torch, btnode.train.loops; print(torch.__version__)"])
    big = rows[-1]
    res = {
        "config": {"n_blocks": BLOCKS, "n_layers": LAYERS, "context": CONTEXT, "steps": STEPS,
                   "threads": 1, "full_model": f"AR, {BLOCKS * LAYERS} layers (btnode train-ar)",
                   "block_worker": "btnode train-local --block 0"},
        "sizes": rows,
        "largest_full_state_gb": big["full_state_gb"],
        "largest_block_over_full_rss": big["block_rss_mb"] / big["full_rss_mb"],
        "plan_error_largest": max(big["error_block"], big["error_full"]),
        "plan_error_largest_training_only": max(big["error_block_train"], big["error_full_train"]),
        "capped_full_replica_refused": None,
        "notes": "capped_full_replica_refused: observed in the capped part (bench/memory.py --capped).",
        "runtime_rss_mb": base.max_rss_mb,
        "machine": f"{platform.machine()}, torch {base.stdout.strip()}",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "sizes"}, indent=1))
    if not args.quick:
        d, h, b = sizes[-1]
        res["capped"] = {**capped(d, h, b, args.out / "capped"), "date": time.strftime("%Y-%m-%d")}
        res["capped_full_replica_refused"] = res["capped"]["full_replica"]["refused"]
        res["wall_s"] = time.perf_counter() - t0
    publish("memory", res, metrics(res), None if args.no_report else render, out=args.results)


if __name__ == "__main__":
    main()
