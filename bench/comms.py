"""Bytes on the wire at the frontier (issue #24, item 4): held-out CE against the bytes a worker moves
per round (upload + download), at equal steps, for the dense codecs and the sparse ones.

    .venv/bin/python -m bench.comms --jobs 2          # the frontier (~25 min on 2 cores)
    .venv/bin/python -m bench.comms --quick           # a smoke run
    .venv/bin/python -m bench.comms --wan             # then the WAN part (~20 min, root; bench/comms_wan.py)
    .venv/bin/python -m bench.comms --models ar --densities 0.02 0.015 --publish-codec sparse2 --publish-factor 2 \
        --lever outer --seed S --aside diloco --setting ar-50x     # DiLoCo's default (#40 item 2), per seed S

The frontier runs the in-process simulator (btnode/sim: the daemon's own aggregator and workers,
pushes through the real frame checks) in lockstep: every replica takes part in every round and τ is
long enough that every round closes on all_reported, so every row trains the same steps from the
same seeds (model init, data, σ) with the same H, batch and learning rate. Two models of the same
width: BlockTrain (B blocks × --replicas replicas, the aggregator averages) and DiLoCo (kind "ar",
B·L layers, --replicas full replicas, the aggregator's outer step for --model ar: DILOCO_OUTER).

Rows: `fp32` (fp32 up, fp32 published), `int8` (int8 up, fp32 published: the swarm as it is today),
`int8 + int8 publish`, and sparse8 / sparse2 uploads at each of --densities, their published delta
--publish-codec (sparse8) at --publish-factor (3) × the workers' density (two replicas' top-k overlap little:
their mean has up to twice the nonzeros; measured against 1× in the `publish` lever), averaged with the aggregator's defaults
(--sparse-mean senders, no clip). Levers: see `levers`.
With --density-warmup-rounds W [W' …] the sparse rows run once per density warm-up (codec/warmup.py: both
densities from --density-warmup-factor × down to theirs over the first W versions): each row keeps its bytes
round by round (`bytes_by_round`) and after the warm-up (`bytes_up_steady`, `bytes_down_steady`), and the
record's `steady` their ratios against int8 over the run and after the warm-up.
An interrupted run resumes: the rows it finished are kept in bench/results/comms.rows.jsonl.

bytes_up: the zstd payload bytes a worker pushed per round, mean over workers. bytes_down: the zstd
(level 1) payload bytes of each published delta, mean over versions and units: in lockstep every
worker fetches each version of its unit once. Headers (the protobuf BundleHeader and chunk framing
of each push and fetch, ~50 bytes; ~60 bytes a tensor before bundles) are not in either: they are
reported apart (header_up, header_down); gRPC's and HTTP/2's own framing is not counted at all. CE: SCE-1 at K = 1 on
--windows windows of wiki.test.raw for BlockTrain, teacher-forced CE for DiLoCo, the same windows
and rows for every row (btnode.evaluation.metrics.swarm_ce).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.comms_wan import load, render_wan, run_wan
from bench.flags import QUICK_SHAPE, BenchParser
from bench.report import RESULTS, invoked, is_published, previous, publish, pyplot, table
from bench.runs import Metric
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.sums.averaging import DILOCO_OUTER, DILOCO_PAPER_OUTER, OuterConfig
from btnode.codec.codecs import Codec
from btnode.codec.frames import Bundle, ChunkData, Frame, iter_chunks
from btnode.codec.warmup import FACTOR, DensityWarmup
from btnode.data.corpus import bundled
from btnode.evaluation.metrics import swarm_ce
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, PushHeader
from btnode.rpc.convert import chunk_to_pb
from btnode.sim.link import LocalLink
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.train.config import TrainConfig

SHAPE = ModelConfig(d_model=64, n_heads=4, n_layers=2, n_blocks=3, context=64)
DENSITIES = (0.1, 0.03, 0.01, 0.003)
SPARSE = (Codec.SPARSE8, Codec.SPARSE2)
VALUE_BITS = {Codec.FP32: 32, Codec.BF16: 16, Codec.INT8: 8, Codec.SPARSE8: 8, Codec.SPARSE2: 2}
LEVER_AT = (Codec.SPARSE2, 0.01)  # the setting the publish levers vary
LEVER_PUBLISH = ((Codec.SPARSE8, 0.01), (Codec.SPARSE8, 0.1), (Codec.FP32, 1.0))  # the grid row: sparse8 at 3 %
PUBLISH_FACTOR = 3  # a sparse row publishes at 3× its density: two replicas' top-k overlap little
# AggregatorConfig.sparse_mean × clip at LEVER_AT, less the default (senders, no clip) that the grid row has and
# (all, no clip), which the mean_all table has at every density
LEVER_AGGREGATOR = (("senders", True), ("all", True))
PLAIN = (1.0, 0.0)  # (η, μ): the outer step as plain averaging
PAPER = (DILOCO_PAPER_OUTER.lr, DILOCO_PAPER_OUTER.momentum)  # DiLoCo's own step, --model ar's default before #40
AIM_CE, AIM_RATIO = 0.02, 50.0  # the aim: ≥ 50× fewer bytes at ≤ +0.02 nats/byte against int8
NAMES = {"block": "BlockTrain", "ar": "DiLoCo"}
STEP_S = 0.1  # virtual seconds per step (lockstep: the clock only orders events)
_corpus = functools.cache(bundled)  # once per process


@dataclass(frozen=True)
class Row:
    """One swarm: what workers push, what the aggregator publishes, and any AggregatorConfig fields
    the row changes (plain keyword arguments, applied with dataclasses.replace)."""

    model: str  # "block" (BlockTrain) or "ar" (DiLoCo)
    codec: Codec
    density: float = 1.0  # share of values a sparse upload keeps (1 for the dense codecs)
    publish: Codec = Codec.FP32
    publish_density: float = 1.0
    lever: str = ""  # the lever table it belongs to; "" for the frontier grid
    aggregator: tuple[tuple[str, object], ...] = ()
    outer: tuple[float, float] | None = None  # (η, μ) of the outer step; None: the model's default
    warmup: DensityWarmup = DensityWarmup()  # both sparse densities over the first versions (codec/warmup.py)

    @property
    def label(self) -> str:
        up = self.codec.name.lower() + (f"@{self.density:.3g}" if self.codec.sparse else "")
        down = self.publish.name.lower() + (f"@{self.publish_density:.3g}" if self.publish.sparse else "")
        extra = "".join(f", {k}={v}" for k, v in self.aggregator)
        outer = f", outer η={self.outer[0]:g} μ={self.outer[1]:g}" if self.outer else ""
        w = self.warmup
        sparse = self.codec.sparse or self.publish.sparse
        warm = f", warm-up {w.rounds} from {w.factor:g}×" if w.rounds and sparse else ""
        return f"{up} / publish {down}{extra}{outer}{warm}"

    def outer_config(self) -> OuterConfig:
        base = OuterConfig.from_flags({"model": self.model})
        return replace(base, lr=self.outer[0], momentum=self.outer[1]) if self.outer else base


def grid(models: Iterable[str], densities: Iterable[float], publish: Codec = Codec.SPARSE8,
         factor: float = PUBLISH_FACTOR, codecs: Iterable[Codec] = SPARSE,
         warmups: Iterable[DensityWarmup] = (DensityWarmup(),)) -> list[Row]:
    """The dense rows and each sparse codec at each density, once per density warm-up (`warmups`)."""
    rows = []
    for m in models:
        rows += [Row(m, Codec.FP32), Row(m, Codec.INT8), Row(m, Codec.INT8, publish=Codec.INT8)]
        rows += [Row(m, c, d, publish, min(1.0, factor * d), warmup=w) for c in codecs for d in densities
                 for w in warmups]
    return rows


def levers(models: Iterable[str], densities: Iterable[float], publish: Codec = Codec.SPARSE8,
           factor: float = PUBLISH_FACTOR) -> list[Row]:
    """sparse2 at 1 % with other publish codecs and densities, and with each other sparse_mean × clip;
    BlockTrain's sparse rows averaged over all updates (mean_all); DiLoCo's rows (int8 and sparse) with
    plain averaging as the outer step (η = 1, μ = 0: SparseLoCo lets error feedback stand for momentum),
    and its int8 row with DiLoCo's own step (PAPER, the default before #40) (outer). The grid's sparse rows
    publish `publish` at `factor` × their density; so do the outer lever's."""
    codec, d = LEVER_AT
    pd = min(1.0, PUBLISH_FACTOR * d)
    sparse = [(c, x) for c in SPARSE for x in densities]
    return [*(Row(m, codec, d, pub, p, lever="publish") for m in models for pub, p in LEVER_PUBLISH),
            *(Row(m, codec, d, Codec.SPARSE8, pd, lever="aggregator", aggregator=(("sparse_mean", mean), ("clip", clip)))
              for m in models for mean, clip in LEVER_AGGREGATOR),
            *(Row("block", c, x, Codec.SPARSE8, min(1.0, PUBLISH_FACTOR * x), lever="mean_all",
                  aggregator=(("sparse_mean", "all"),)) for c, x in sparse if "block" in models),
            *(Row("ar", c, x, publish if c.sparse else Codec.FP32, min(1.0, factor * x) if c.sparse else 1.0,
                  lever="outer", outer=PLAIN) for c, x in [(Codec.INT8, 1.0), *sparse] if "ar" in models),
            *([Row("ar", Codec.INT8, lever="outer", outer=PAPER)] if "ar" in models else [])]


def model_of(shape: ModelConfig, kind: str) -> ModelConfig:
    """BlockTrain's shape, or DiLoCo's AR model of the same width and B·L layers."""
    return shape if kind == "block" else replace(shape, kind="ar", ar_layers=shape.n_blocks * shape.n_layers)


@dataclass(frozen=True)
class Settings:
    """What every row of a run shares (picklable: it goes to the pool's processes)."""

    shape: ModelConfig
    rounds: int
    h: int
    batch: int
    lr: float
    replicas: int
    windows: int
    seed: int = 0  # model init, windows and noise (TrainConfig.seed); the held-out windows do not depend on it

    @property
    def tc(self) -> TrainConfig:
        total = self.rounds * self.h
        return TrainConfig(batch=self.batch, lr=self.lr, steps=total, warmup=min(20, max(1, total // 10)),
                           seed=self.seed)


@dataclass
class HeaderTap:
    """A worker's link: the shared LocalLink, counting the protobuf bytes of each push's chunks beyond
    their payload (the bundle header and the chunk framing: what the payload bytes leave out)."""

    link: LocalLink
    header_bytes: int = 0
    frames: int = 0
    payload_by_round: dict[int, list[int]] = field(default_factory=dict)  # base version → each push's zstd payload

    def __getattr__(self, name: str) -> object:
        return getattr(self.link, name)

    def push(self, header: PushHeader, frames: Iterable[Frame | Bundle]) -> Judgement:
        sent = list(iter_chunks(frames))
        self.header_bytes += framing(sent)
        self.frames += sum(c.header is not None for c in sent)
        self.payload_by_round.setdefault(header.base_version, []).append(sum(len(c.data) for c in sent))
        return self.link.push(header, [Sent(sent)])


@dataclass(frozen=True)
class Sent:
    """Chunks already made, passed on as a frame list."""

    sent: list[ChunkData]

    def chunks(self, chunk_bytes: int = 0) -> Iterator[ChunkData]:
        return iter(self.sent)


def framing(chunks: Iterable[ChunkData]) -> int:
    """Protobuf bytes of a stream's chunk messages beyond their payload: headers and the chunks' fields."""
    return sum(chunk_to_pb(c).ByteSize() - len(c.data) for c in chunks)


@dataclass
class Taps:
    """Every replica's HeaderTap, by worker id."""

    taps: dict[str, HeaderTap] = field(default_factory=dict)

    def factory(self, cfg, tc, wcfg, link, corpus, **kw) -> BlockWorker:  # type: ignore[no-untyped-def]
        tap = self.taps[wcfg.worker_id] = HeaderTap(link)
        return BlockWorker(cfg, tc, wcfg, tap, corpus, **kw)


def downloads(sim: Simulation) -> tuple[float, float, int, dict[int, list[int]]]:
    """(zstd payload bytes, framing bytes, versions) of the published deltas per version, mean over units:
    the bundle each FetchDelta sends (BlockAggregator.delta_frames); and each delta's payload by the
    version it builds on."""
    payload, header, versions, by_round = [], [], 0, {}
    for agg in sim.agg.blocks.values():
        for v in range(1, agg.info.version + 1):
            stored = agg.delta_frames(v)
            try:
                sent = list(iter_chunks(stored.frames))
            finally:
                stored.close()
            payload.append(sum(len(c.data) for c in sent))
            by_round.setdefault(v - 1, []).append(payload[-1])
            header.append(framing(sent))
            versions += 1
    return statistics.mean(payload), statistics.mean(header), versions, by_round


def by_round(up: dict[int, list[int]], down: dict[int, list[int]]) -> list[tuple[float, float]]:
    """(bytes up per worker, bytes down per version) of each round, mean over workers and units."""
    return [(statistics.mean(up.get(r, [0])), statistics.mean(down.get(r, [0]))) for r in sorted(set(up) | set(down))]


def steady(rounds: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """(up, down) per worker-round over the rounds after the density warm-up (all of them without one)."""
    after = rounds[warmup:] or rounds[-1:]
    return statistics.mean(u for u, _ in after), statistics.mean(d for _, d in after)


def run_row(row: Row, s: Settings) -> dict:
    """One lockstep swarm: its bytes per worker-round, CE and outcomes."""
    torch.set_num_threads(1)  # a small model: more threads only contend
    t0 = time.perf_counter()
    cfg, corpus, taps = model_of(s.shape, row.model), _corpus(), Taps()
    scfg = SimConfig(rounds=s.rounds, replicas=s.replicas, steps_per_round=s.h, step_time_s=STEP_S, delays_s=(0.0,),
                     delay_dist="fixed", codec=row.codec, density=row.density, warmup=row.warmup)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1e6), outer=row.outer_config(),
                            publish_codec=row.publish, publish_density=row.publish_density, keep=s.rounds + 1,
                            warmup=row.warmup)
    acfg = replace(acfg, **dict(row.aggregator))
    workers = {f"b{b}r{r}": taps.factory for b in range(cfg.total_blocks) for r in range(s.replicas)}
    with tempfile.TemporaryDirectory(prefix="btnode-comms-") as tmp:
        sim = Simulation(cfg, s.tc, acfg, scfg, corpus.train, Path(tmp), device=torch.device("cpu"), workers=workers)
        res = sim.run()
        ce = swarm_ce(sim.blocks(), corpus.test, s.windows, torch.device("cpu"))
        down, header_down, versions, down_by = downloads(sim)
    stats = [r.worker.stats for r in sim.replicas]
    rounds = by_round(_merged(t.payload_by_round for t in taps.taps.values()), down_by)
    up_steady, down_steady = steady(rounds, row.warmup.rounds)
    params = sum(t.numel() for t in sim.blocks()[0].state_dict().values())
    up = statistics.mean(w.bytes_pushed_wire / w.pushes for w in stats)
    header_up = statistics.mean(t.header_bytes / sim.worker(w).stats.pushes for w, t in taps.taps.items())
    out = {"model": row.model, "codec": row.codec.name.lower(), "density": row.density,
           "value_bits": VALUE_BITS[row.codec], "publish_codec": row.publish.name.lower(),
           "publish_density": row.publish_density, "lever": row.lever, "aggregator": dict(row.aggregator),
           "outer": row.outer,
           "label": row.label, "bytes_up": up, "bytes_down": down, "header_up": header_up, "header_down": header_down,
           "warmup": [row.warmup.rounds, row.warmup.factor], "bytes_by_round": rounds,
           "bytes_up_steady": up_steady, "bytes_down_steady": down_steady,
           "params": params, "bits_per_param": 8 * (up + down) / params, "bits_per_param_up": 8 * up / params,
           "bits_per_param_down": 8 * down / params, "ce": ce, "versions": versions / cfg.total_blocks,
           "pushes": sum(w.pushes for w in stats), "outcomes": res.outcomes, "closed_by": res.closed_by,
           "steps_per_worker": statistics.mean(w.steps for w in stats), "wall_s": time.perf_counter() - t0}
    print(f"[comms] {row.model} {row.label}: CE {ce:.4f}, {up:,.0f} B up + {down:,.0f} B down per worker-round "
          f"({out['bits_per_param']:.3f} bits/param; after the warm-up {up_steady:,.0f} + {down_steady:,.0f}), "
          f"outcomes {res.outcomes}, {out['wall_s']:.0f} s", flush=True)
    return out


def _merged(maps: Iterable[dict[int, list[int]]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in maps:
        for r, xs in m.items():
            out.setdefault(r, []).extend(xs)
    return out


def all_accepted(row: dict) -> bool:
    """Every push accepted and every round closed on all_reported: the row trained the steps it claims."""
    return (row["outcomes"].get("pending", 0) == row["pushes"] and set(row["closed_by"]) == {"all_reported"})


def setting(row: dict) -> dict:
    """What a row sets: enough to run it again (bench/comms_wan.py turns it into node flags)."""
    out = {k: row[k] for k in ("codec", "density", "publish_codec", "publish_density", "aggregator", "outer")}
    return {**out, "warmup": row["warmup"]} if (row.get("warmup") or [0])[0] else out


def steady_ratios(rows: list[dict]) -> list[dict]:
    """Each sparse row against its model's int8 row (int8 up, fp32 published): the ratio of bytes over the
    run and after the density warm-up (without and with the frame headers), and ΔCE."""
    out = []
    for r in rows:
        ref = next((x for x in rows if x["model"] == r["model"] and x["codec"] == "int8"
                    and x["publish_codec"] == "fp32" and not x["lever"] and not x["outer"]), None)
        if ref is None or not Codec[r["codec"].upper()].sparse or "bytes_up_steady" not in r:
            continue
        total, heads = ref["bytes_up"] + ref["bytes_down"], ref["header_up"] + ref["header_down"]
        steady_bytes = r["bytes_up_steady"] + r["bytes_down_steady"]
        out.append({"model": r["model"], "row": r["label"], "warmup": r.get("warmup"), "delta_ce": r["ce"] - ref["ce"],
                    "ratio": total / (r["bytes_up"] + r["bytes_down"]), "ratio_steady": total / steady_bytes,
                    "ratio_steady_with_headers": (total + heads) / (steady_bytes + r["header_up"] + r["header_down"])})
    return out


def best_ratios(rows: list[dict], outer: tuple[float, float] | None = None) -> dict[str, dict]:
    """Per model, the sparse row with the most int8 bytes per its own bytes among those within
    AIM_CE of int8's CE (int8 = int8 up, fp32 published: today's swarm), and the sparse row with
    the lowest CE. `outer`: only the rows with that outer step (η, μ), against the int8 row with it;
    None: the model's own outer step on both sides (a sparse row with another outer step against the
    default int8 row would credit the codec with what the outer step did)."""
    def has(r: dict) -> bool:
        return tuple(r["outer"] or ()) == outer if outer else not r["outer"]

    out = {}
    for m in dict.fromkeys(r["model"] for r in rows):
        ref = next((r for r in rows if r["model"] == m and r["codec"] == "int8" and r["publish_codec"] == "fp32"
                    and (has(r) if outer else not r["lever"])), None)
        if ref is None:
            continue
        sparse = [r for r in rows if r["model"] == m and Codec[r["codec"].upper()].sparse and has(r)]
        total = ref["bytes_up"] + ref["bytes_down"]
        within = [(total / (r["bytes_up"] + r["bytes_down"]), r) for r in sparse if r["ce"] <= ref["ce"] + AIM_CE]
        ratio, best = max(within, key=lambda x: x[0], default=(None, None))
        closest = min(sparse, key=lambda r: r["ce"])
        with_headers = best and (total + ref["header_up"] + ref["header_down"]) / sum(
            best[k] for k in ("bytes_up", "bytes_down", "header_up", "header_down"))
        out[m] = {"ratio": ratio, "ratio_with_headers": with_headers, "row": best and best["label"],
                  "ce": best and best["ce"], "int8_row": ref["label"], "int8_ce": ref["ce"], "int8_bytes": total,
                  "setting": best and setting(best),
                  "lowest_ce": {"row": closest["label"], "ce": closest["ce"], "setting": setting(closest)}}
    return out


def run_plan(plan: list[Row], s: Settings, jobs: int, done: Path) -> list[dict]:
    """Every row of `plan`, in its order. Each finished row is appended to `done` at once, and a row
    found there (same label, same settings) is not run again: an interrupted run resumes. `done` is
    removed when the plan is through."""
    key = repr(s)
    have = {(r["model"], r["label"]): r for r in map(json.loads, done.read_text().splitlines() if done.exists() else [])
            if r["settings"] == key}
    todo = [r for r in plan if (r.model, r.label) not in have]
    done.parent.mkdir(parents=True, exist_ok=True)  # a record kept aside (--aside) may be the folder's first
    print(f"[comms] {len(plan) - len(todo)} of {len(plan)} rows from {done}", flush=True)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for fut in as_completed([pool.submit(run_row, r, s) for r in todo]):
            row = {**fut.result(), "settings": key}
            have[(row["model"], row["label"])] = row
            with done.open("a") as f:
                f.write(json.dumps(row) + "\n")
    done.unlink(missing_ok=True)
    return [have[(r.model, r.label)] for r in plan]


def frontier(args: argparse.Namespace) -> None:
    s = Settings(args.shape, args.rounds, args.h, args.batch, args.lr, args.replicas, args.windows, args.seed)
    unique: dict[tuple[str, str], Row] = {}  # a lever's row that another table has is run and shown once
    publish_codec = Codec[args.publish_codec.upper()]
    chosen = [r for r in levers(args.models, args.densities, publish_codec, args.publish_factor)
              if args.levers and (not args.lever or r.lever in args.lever)]
    warmups = [DensityWarmup(w, args.density_warmup_factor) for w in args.density_warmup_rounds]
    codecs = [Codec[c.upper()] for c in args.codecs]
    for r in grid(args.models, args.densities, publish_codec, args.publish_factor, codecs, warmups) + chosen:
        unique.setdefault((r.model, r.label), r)
    plan = list(unique.values())
    plan.sort(key=lambda r: r.model != "block")  # the longer block rows first, so the pool ends together
    rows = run_plan(plan, s, args.jobs, args.results.with_suffix(".rows.jsonl"))
    command = invoked()
    for r in rows:
        r["command"] = command
    bad = [r["label"] for r in rows if not all_accepted(r)]
    best = best_ratios(rows)
    out = {"rows": [r for r in rows if not r["lever"]], "levers": [r for r in rows if r["lever"]],
           "best_ratio_vs_int8_at_002": {m: b["ratio"] for m, b in best.items()}, "best": best,
           "best_plain_outer": best_ratios(rows, PLAIN), "steady": steady_ratios(rows),
           "not_all_accepted": bad, "shape": args.shape.to_dict(), "replicas": args.replicas, "rounds": args.rounds,
           "h": args.h, "batch": args.batch, "lr": args.lr, "windows": args.windows, "quick": args.quick,
           "seed": args.seed, "publish_codec": args.publish_codec, "publish_factor": args.publish_factor,
           "ar_outer": [DILOCO_OUTER.lr, DILOCO_OUTER.momentum],
           "command": command, "date": datetime.date.today().isoformat()}
    before = previous(args.results)  # the WAN part keeps its rows
    if before:
        out.update(wan=before.get("wan"), wan_rows=before.get("wan_rows", []))
    out["png"] = is_published(args.results) and plot(out, RESULTS / "comms.png") is not None
    publish("comms", out, metrics(out), render, out=args.results)
    print(json.dumps({"best": best, "not_all_accepted": bad}, indent=1))
    for x in out["steady"]:
        print(f"[comms] {x['model']} {x['row']}: ΔCE {x['delta_ce']:+.4f}, {x['ratio']:.1f}× fewer bytes than int8 "
              f"over the run, {x['ratio_steady']:.1f}× after the warm-up ({x['ratio_steady_with_headers']:.1f}× with "
              "headers)")


def plot(out: dict, path: Path) -> Path | None:
    plt = pyplot("comms")
    if plt is None:
        return None
    models = list(dict.fromkeys(r["model"] for r in out["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    marks = {"fp32": "s", "int8": "D", "sparse8": "o", "sparse2": "^"}  # the codec by marker, the table by colour
    colours = {"": "C0", "mean_all": "C1", "outer": "C2", "publish": "C3", "aggregator": "C4"}
    for ax, m in zip(axes[0], models):
        rows = [r for r in out["rows"] + out["levers"] if r["model"] == m]
        for lever in dict.fromkeys(r["lever"] for r in rows):
            for codec in marks:
                pts = sorted((r["bytes_up"] + r["bytes_down"], r["ce"]) for r in rows
                             if r["codec"] == codec and r["lever"] == lever)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marks[codec], color=colours.get(lever),
                            ls="-" if lever in ("", "mean_all", "outer") else "", mfc="none" if codec == "sparse2" else None,
                            label=f"{codec} ({lever or 'grid'})")
        ref = out["best"][m]
        ax.axhline(ref["int8_ce"] + AIM_CE, color="grey", ls=":", lw=1, label="int8 CE + 0.02")
        ax.axvline(ref["int8_bytes"] / AIM_RATIO, color="grey", ls="--", lw=1, label="int8 bytes / 50")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per worker-round (upload + download, zstd payloads)")
        ax.set_ylabel("held-out CE (nats/byte)")
        ax.set_title(NAMES[m] + f", {out['rounds']} rounds of H = {out['h']}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _rows_table(rows: list[dict], best: dict) -> list[str]:
    """One line per row, with its bytes and CE against int8's (today's swarm) of the same model."""
    def versus(r: dict) -> tuple[str, str]:
        ref = best[r["model"]]
        return f"{ref['int8_bytes'] / (r['bytes_up'] + r['bytes_down']):.1f}×", f"{r['ce'] - ref['int8_ce']:+.4f}"

    return table(["model", "upload / published", "bytes up", "bytes down", "headers up + down", "bits/param",
                  "fewer bytes than int8", "CE", "ΔCE vs int8", "accepted"],
                 [(r["model"], r["label"], f"{r['bytes_up']:,.0f}", f"{r['bytes_down']:,.0f}",
                   f"{r['header_up']:,.0f} + {r['header_down']:,.0f}", f"{r['bits_per_param']:.3f}", versus(r)[0],
                   f"{r['ce']:.4f}", versus(r)[1], f"{r['outcomes'].get('accepted', 0)}/{r['pushes']}")
                  for r in rows], "llrrrrrrrr")


def metrics(res: dict) -> dict[str, Metric]:
    """Best byte saving against int8 within the CE aim, and on the thin WAN link CE at equal wall-clock."""
    out: dict[str, Metric] = {f"{m}: best saving vs int8 (×)": v for m, v in res["best_ratio_vs_int8_at_002"].items()}
    for m, b in (res.get("best") or {}).items():  # the two rows the saving compares: a change of either's CE shows
        out[f"{m}: CE, int8 row"] = b.get("int8_ce")
        out[f"{m}: CE, best-saving row"] = b.get("ce")
    out.update({f"{m}, plain outer step: best saving vs int8 (×)": b["ratio"]
                for m, b in (res.get("best_plain_outer") or {}).items() if b})
    out.update({"ar, int8 with DiLoCo's own outer step (η 0.7, μ 0.9): CE": r["ce"] for r in res.get("levers") or []
                if r["model"] == "ar" and tuple(r["outer"] or ()) == PAPER})
    out.update({f"WAN {r['model']}, {r['codec']}: CE ({r['chosen']})": r["ce"] for r in res.get("wan_rows") or []})
    return out


def render(out: dict) -> str:
    shape = ModelConfig.from_dict(out["shape"])
    best = out["best"]
    params = {r["model"]: r["params"] for r in out["rows"]}
    eta, mu = out.get("ar_outer", PAPER)  # a record without it ran under DiLoCo's own step, the default then
    lines = ["## Bytes on the wire: the sparse frontier (`bench/comms.py`)", "",
             f"Command: `{out['command']}` ({out['date']}, 2 cores). The in-process simulator in lockstep (every "
             f"replica in every round, every round closed on all_reported), {out['rounds']} rounds of H = {out['h']} "
             f"steps of batch {out['batch']} (AdamW lr {out['lr']:g}, cosine), the same seeds in every row. "
             f"BlockTrain: d = {shape.d_model}, {shape.n_heads} heads, B = {shape.n_blocks} blocks of L = "
             f"{shape.n_layers} layers, N = {shape.context}, {out['replicas']} replicas per block, averaged. DiLoCo: "
             f"the {shape.n_blocks * shape.n_layers}-layer AR model of the same width, {out['replicas']} full "
             f"replicas, outer Nesterov step (η = {eta:g}, μ = {mu:g}). Sparse rows publish {out.get('publish_codec', 'sparse8')} "
             f"at {out.get('publish_factor', PUBLISH_FACTOR):g}× the workers' density; "
             "the aggregator averages each coordinate over the updates that sent it (`--sparse-mean senders`, the "
             "default), no clip. "
             "Bytes per worker-round: zstd payloads (bytes up: what a worker pushed per round; bytes down: a "
             "published delta, mean over versions and units); the frame headers and chunk framing (protobuf) are "
             "apart, gRPC/HTTP2 framing not counted. Bits/param: (up + down) payload bits per parameter of the "
             "unit a worker trains (" + ", ".join(f"{NAMES[m]} {n:,}" for m, n in params.items()) + "). CE: SCE-1 at K = 1 (BlockTrain) or teacher-forced (DiLoCo) on "
             f"{out['windows']} held-out windows, nats/byte.", "",
             *_rows_table(out["rows"], best), ""]
    for m, b in best.items():
        name = NAMES[m]
        if b["ratio"] is None:
            lines.append(f"- {name}: no sparse row within +{AIM_CE} nats/byte of int8 ({b['int8_ce']:.4f}).")
        else:
            lines.append(f"- {name}: best ratio against int8 (int8 up, fp32 published: {b['int8_bytes']:,.0f} B per "
                         f"worker-round, CE {b['int8_ce']:.4f}) within +{AIM_CE} nats/byte: **{b['ratio']:.1f}×** "
                         f"({b['row']}, CE {b['ce']:.4f}); aim ≥ {AIM_RATIO:g}×. With the frame headers "
                         f"counted on both sides: {b['ratio_with_headers']:.1f}×.")
    for m, b in out.get("best_plain_outer", {}).items():
        lines.append(f"- {NAMES[m]}, every row with the outer step as plain averaging (η = 1, μ = 0; the int8 row too: "
                     f"CE {b['int8_ce']:.4f}): " + (f"best ratio within +{AIM_CE}: **{b['ratio']:.1f}×** ({b['row']}, CE "
                                                   f"{b['ce']:.4f}; {b['ratio_with_headers']:.1f}× with headers)."
                                                   if b["ratio"] else f"no sparse row within +{AIM_CE}."))
    if out["not_all_accepted"]:
        lines += ["", "Rows with a push not accepted or a round not closed on all_reported: "
                  + ", ".join(out["not_all_accepted"]) + "."]
    if out["levers"]:
        lines += ["", "Levers (same command; `levers` in bench/comms.py): sparse2 at 1 % with other publish codecs and "
                      "densities (publish) and each other sparse_mean × clip (aggregator); every BlockTrain sparse row "
                      "averaged over all updates (mean_all); DiLoCo with plain averaging as the outer step, η = 1, "
                      "μ = 0, and int8 with DiLoCo's own, η = 0.7, μ = 0.9 (outer).", ""]
        for lever in dict.fromkeys(r["lever"] for r in out["levers"]):
            lines += [f"`{lever}`:", "", *_rows_table([r for r in out["levers"] if r["lever"] == lever], best), ""]
    if out["png"]:
        lines += ["", "![CE against bytes per worker-round](bench/results/comms.png)"]
    return "\n".join(lines + render_wan(out))


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("comms")
    ap.rounds(rounds=30, h=5, batch=8)
    ap.add_argument("--lr", type=float, default=2e-3, help="inner AdamW peak lr (cosine to 0.1× over the run)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas per block (BlockTrain), full replicas (DiLoCo)")
    ap.add_argument("--densities", type=float, nargs="*", default=list(DENSITIES), help="sparse upload densities")
    ap.add_argument("--models", nargs="*", default=["block", "ar"], choices=["block", "ar"])
    ap.add_argument("--no-levers", dest="levers", action="store_false", help="the grid only")
    ap.add_argument("--lever", action="append", choices=["publish", "aggregator", "mean_all", "outer"],
                    help="only this lever table (repeatable; default: all)")
    ap.add_argument("--publish-codec", default="sparse8", choices=["sparse8", "sparse2"],
                    help="what the grid's sparse rows publish")
    ap.add_argument("--publish-factor", type=float, default=PUBLISH_FACTOR,
                    help="the grid's sparse rows publish at this × their density")
    names = [c.name.lower() for c in SPARSE]
    ap.add_argument("--codecs", nargs="*", default=names, choices=names, help="the grid's sparse upload codecs")
    ap.add_argument("--density-warmup-rounds", type=int, nargs="*", default=[0],
                    help="the grid's sparse rows once per density warm-up length W (codec/warmup.py; 0: none)")
    ap.add_argument("--density-warmup-factor", type=float, default=FACTOR,
                    help="a warm-up's start, × the final density")
    ap.add_argument("--seed", type=int, default=0, help="TrainConfig.seed of every row: model init, windows, noise")
    ap.add_argument("--aside", metavar="FOLDER", help="keep the record beside, unrendered: "
                                                     "bench/results/comms/FOLDER/<setting>.json")
    ap.add_argument("--jobs", type=int, default=2, help="rows simulated at once (one process and one thread each)")
    ap.windows(256)
    ap.shape(SHAPE)
    wan = ap.add_argument_group("--wan: int8 against the best sparse row over the WAN lab (root)")
    wan.add_argument("--wan", action="store_true", help="run the WAN part (after the frontier) and add its rows")
    wan.add_argument("--seconds", type=float, default=240.0, help="wall-clock of each WAN run from the workers' start")
    wan.add_argument("--rate-mbit", type=float, default=10.0, help="each worker host's link, each way")
    wan.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    wan.add_argument("--deadline", type=float, default=120.0, help="τ (s): long, rounds close when all reported")
    wan.add_argument("--warmup", type=int, default=20, help="inner warmup steps (constant lr after: no run knows its "
                                                            "step count in advance)")
    wan.add_argument("--points", type=int, default=4, help="CE time points after t = 0")
    wan.add_argument("--wan-codec", choices=["sparse8", "sparse2"], help="the sparse setting to run instead of the "
                                                                         "frontier's best (published sparse8 at the same density)")
    wan.add_argument("--wan-density", type=float, default=0.01)
    ap.quick(rounds=3, h=2, batch=4, windows=8, densities=[0.1, 0.01], shape=QUICK_SHAPE, seconds=90.0, points=2,
             warmup=2)
    args = ap.parse_args()
    if args.aside:  # kept beside the rendered record, unrendered (BENCHMARKS.md's word budget)
        args.results = args.results.parent / args.aside / args.results.name
    if args.wan:
        out = run_wan(args, load(args.results), model_of)
        publish("comms", out, metrics(out), render, out=args.results)
        print(json.dumps(out["wan_rows"], indent=1))
    else:
        frontier(args)


if __name__ == "__main__":
    main()
