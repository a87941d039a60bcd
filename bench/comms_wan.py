"""bench/comms.py --wan: int8 (fp32 published, today's swarm) against the frontier's best sparse row,
over bench/wan_train.py's lab at a thin link, at equal wall-clock, BlockTrain and DiLoCo.

Every run is bench/diloco.py's `run_once` (real `btnode join` processes, SIGTERM after --seconds from
the workers' start, CE of what the aggregator had published by then), with the codec flags added.
The link (--rate-mbit each way, --delay-ms one way) is chosen so that int8's transfer time per round
(the workers' push + pull seconds) is at least its compute time (seconds inside training steps):
both are measured and reported per run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import diloco
from bench.report import invoked, previous
from bench.wan_train import host_of
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig


def workers_of(model: ModelConfig, replicas: int) -> list[tuple[int, int, int]]:
    """(unit, replica, host) of every worker: the replicas of a unit on different hosts."""
    return [(u, r, host_of(u, r) if model.kind == "block" else 1 + r % 3)
            for u in range(model.total_blocks) for r in range(replicas)]


INT8 = {"codec": "int8", "density": 1.0, "publish_codec": "fp32", "publish_density": 1.0, "aggregator": {}, "outer": None}


def settings_of(out: dict, model: str, args: argparse.Namespace) -> list[tuple[str, dict, str]]:
    """(name, setting, why) of a model's two runs: int8, and the frontier's best sparse row within the
    aim (when it has none, its sparse row of the lowest CE; or the one --wan-codec names)."""
    best = out["best"][model]
    if args.wan_codec:
        chosen, why = {"codec": args.wan_codec, "density": args.wan_density, "publish_codec": "sparse8",
                       "publish_density": args.wan_density, "aggregator": {}, "outer": None}, "--wan-codec"
    elif best["setting"] is not None:
        chosen, why = best["setting"], "best ratio within the aim"
    else:
        chosen, why = best["lowest_ce"]["setting"], "lowest CE (none within the aim)"
    runs = [("int8", INT8, "today's swarm"), ("sparse", chosen, why)]
    if chosen["outer"]:  # the sparse row changes the outer step: int8 with that step too, as a control
        runs.insert(1, ("int8_outer", {**INT8, "outer": chosen["outer"]}, "int8 with the sparse row's outer step"))
    return runs


def flags_of(setting: dict) -> tuple[list[str], list[str]]:
    """(worker flags, aggregator flags) of a frontier row's setting."""
    sparse = Codec[setting["codec"].upper()].sparse
    worker = ["--codec", setting["codec"], *(["--density", str(setting["density"])] if sparse else [])]
    agg = ["--publish-codec", setting["publish_codec"]]
    if setting["publish_codec"] != "fp32":
        agg += ["--publish-density", str(setting["publish_density"])]
    for name, value in setting["aggregator"].items():  # AggregatorConfig fields: sparse_mean, clip
        agg += {"sparse_mean": ["--sparse-mean", str(value)], "clip": ["--clip" if value else "--no-clip"]}[name]
    if setting["outer"]:  # (η, μ) instead of the model's default outer step
        agg += ["--outer-lr", f"{setting['outer'][0]:g}", "--outer-momentum", f"{setting['outer'][1]:g}"]
    if setting.get("warmup"):  # (W, factor): both densities' warm-up (codec/warmup.py)
        rounds, factor = setting["warmup"]
        warm = ["--density-warmup-rounds", str(rounds), "--density-warmup-factor", f"{factor:g}"]
        worker, agg = worker + warm, agg + warm
    return worker, agg


def run_wan(args: argparse.Namespace, out: dict, model_of) -> dict:  # type: ignore[no-untyped-def]
    """The WAN rows (and the link), added to the frontier's result `out`."""
    from lab.netlab.topology import Star

    reason = Star.why_unavailable()
    if reason:
        raise SystemExit(f"bench/comms.py --wan needs network namespaces: {reason}")
    lab_args = argparse.Namespace(h=args.h, batch=args.batch, lr=args.lr, deadline=args.deadline, warmup=args.warmup,
                                  schedule_steps=None, seconds=args.seconds, points=args.points, windows=args.windows)
    rows = []
    with tempfile.TemporaryDirectory(prefix="btnode-comms-wan-") as tmp, \
            Star(4, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as lab:
        for m in args.models:
            cfg = model_of(args.shape, m)
            for name, setting, why in settings_of(out, m, args):
                worker, agg = flags_of(setting)
                r = diloco.run_once(lab, f"{m}_{name}", cfg, workers_of(cfg, args.replicas), lab_args, Path(tmp),
                                    worker_flags=worker, aggregator_flags=agg)
                rows.append({"model": m, **setting, "chosen": why, "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms,
                             "seconds": args.seconds, "rounds": r["versions"], "bytes": r["bytes_per_worker_round"],
                             "bytes_pushed": r["bytes_pushed_per_worker_round"], "ce": r["ce_final"],
                             "ce_by_time": r["ce_by_time"], "accepted": r["accepted"], "pushes": r["pushes"],
                             "compute_s_per_round": r["compute_s_per_round"],
                             "transfer_s_per_round": r["transfer_s_per_round"], "workers": r["workers"],
                             "command": invoked()})
    return {**out, "wan_rows": rows,
            "wan": {"rate_mbit": args.rate_mbit, "delay_ms_one_way": args.delay_ms, "seconds": args.seconds,
                    "h": args.h, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "deadline_s": args.deadline,
                    "replicas": args.replicas, "quick": args.quick, "command": invoked()}}


def render_wan(out: dict) -> list[str]:
    """The WAN part of the comms section (empty before a --wan run)."""
    from bench.report import table

    wan = out.get("wan")
    if not wan:
        return []
    return ["", f"Over the WAN lab (`{wan['command']}`, root, 2 cores): bench/wan_train.py's star, every worker host "
                f"{wan['rate_mbit']:g} Mbit/s each way (tbf) and {wan['delay_ms_one_way']:g} ms one way from the "
                f"aggregator's hub, real `btnode join` processes (1 torch thread each), {wan['seconds']:g} s of "
                f"wall-clock per run from the workers' start; H = {wan['h']}, batch {wan['batch']}, AdamW lr "
                f"{wan['lr']:g} constant after {wan['warmup']} warmup steps, τ = {wan['deadline_s']:g} s, "
                f"{wan['replicas']} replicas per unit. Compute: seconds inside training steps per round; transfer: "
                "the workers' push + pull seconds per round (encoding and the answer included).", "",
            *table(["model", "upload / published", "rounds", "bytes per worker-round", "compute s/round",
                    "transfer s/round", "accepted", "CE at the end"],
                   [(r["model"], f"{r['codec']}" + (f"@{r['density']:g}" if r["density"] < 1 else "")
                     + f" / {r['publish_codec']}" + (f"@{r['publish_density']:g}" if r["publish_density"] < 1 else "")
                     + "".join(f", {k}={v}" for k, v in r["aggregator"].items())
                     + (f", outer η={r['outer'][0]:g} μ={r['outer'][1]:g}" if r["outer"] else ""),
                     r["rounds"], f"{r['bytes']:,.0f}", f"{r['compute_s_per_round']:.2f}",
                     f"{r['transfer_s_per_round']:.2f}", f"{r['accepted']}/{r['pushes']}", f"{r['ce']:.4f}")
                    for r in out["wan_rows"]], "llrrrrrr"),
            "", "The sparse row of each model is the frontier's " + "; ".join(
                f"{r['model']}: {r['chosen']}" for r in out["wan_rows"] if r["codec"] != "int8") + ". CE against "
            "wall-clock (what the aggregator had published by then; BlockTrain SCE-1 at K = 1, DiLoCo teacher-forced):", "",
            *table(["t (s)", *(f"{r['model']} {r['codec']}" + (" (outer η=1 μ=0)" if r["outer"] else "")
                               for r in out["wan_rows"])],
                   [(f"{t:.0f}", *(f"{r['ce_by_time'][i][1]:.4f}" for r in out["wan_rows"]))
                    for i, (t, _) in enumerate(out["wan_rows"][0]["ce_by_time"])], "r" * (len(out["wan_rows"]) + 1))]


def load(path: Path) -> dict:
    if not path.exists():
        raise SystemExit(f"--wan needs the frontier's result first ({path}): run bench/comms.py without --wan")
    return previous(path)
