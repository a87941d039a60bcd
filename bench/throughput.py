"""Throughput against the hardware (issue #22, item 5): bytes trained per second, counted model FLOPs
per step and MFU of one block's training step and of the AR step at several widths, against this
host's dense matmul peak measured in the same run; and where the block step's time goes.

    .venv/bin/python -m bench.throughput          # ~5 min on 2 cores
    .venv/bin/python -m bench.throughput --quick  # a smoke run

A step is the trainer's own `train_step` (BlockTrainer: σ, noise, mask, both streams, loss, backward,
clip, AdamW; ARTrainer the same for the AR model), on fixed windows. FLOPs are counted by
torch.utils.flop_counter over one whole step (forward and backward; the optimizer's elementwise work is
not counted), attention at its full T_q × T_k (neither the causal nor the segment mask is discounted).
The peak is the fastest square matmul of the step's dtype, measured before and after the rows.
"""

from __future__ import annotations

import collections
import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from bench.flags import BenchParser
from bench.report import invoked, publish, table
from bench.runs import Metric
from btnode.model.config import ModelConfig
from btnode.model.layout import Layout
from btnode.model.targets import target_table
from btnode.store.models import init_ar, init_block
from btnode.train.config import Precision, TrainConfig
from btnode.train.trainers import ARTrainer, BlockTrainer

LAYERS, CONTEXT, BATCH = 2, 128, 8  # L of a block and of the AR model; N; windows per step
WIDTHS = [(128, 4), (256, 4), (512, 8), (1024, 16)]  # (d, heads)
QUICK_WIDTHS = [(64, 2), (128, 4)]
WARMUP, TIMED = 2, 5  # steps before timing (after the counted one), timed steps (median)
PEAK_SIZES, QUICK_PEAK_SIZES = (256, 512, 1024, 2048), (256, 512)
PEAK_REPS = 5
PROFILE_STEPS = 5
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}


# On a CPU, SDPA runs the "flash attention for CPU" kernel, which torch's counter does not know: without
# these the attention FLOPs (causal and masked alike) would be missing. Same formulas as the GPU kernels'.
def _cpu_sdpa(q: tuple, k: tuple, v: tuple, *args: object, out_shape: object = None, **kwargs: object) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward(grad: tuple, q: tuple, k: tuple, v: tuple, *args: object, out_shape: object = None,
                       **kwargs: object) -> int:
    return sdpa_backward_flop_count(grad, q, k, v)


CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}


def config(d: int, heads: int) -> ModelConfig:
    """The measured shape at width d: the project's default block (L = 2, N = 128, K ∈ {1, 16})."""
    return ModelConfig(d_model=d, n_heads=heads, n_layers=LAYERS, context=CONTEXT)


def make_trainer(model: str, cfg: ModelConfig, precision: Precision, batch: int,
                 device: torch.device, **train: Any) -> BlockTrainer | ARTrainer:
    """Block 0's trainer, or the trainer of an AR model of the block's depth and per-layer shape
    (`train`: TrainConfig fields other than btnode's defaults)."""
    tc = TrainConfig(batch=batch, precision=precision, **train)
    if model == "block":
        return BlockTrainer(init_block(cfg, 0, tc.seed), tc, block=0, table=target_table(cfg), device=device)
    return ARTrainer(init_ar(cfg, LAYERS, tc.seed), tc, device)


def windows(cfg: ModelConfig, batch: int) -> torch.Tensor:
    """Fixed byte windows: a step's cost does not depend on which bytes it reads."""
    return torch.randint(0, cfg.vocab, (batch, cfg.context + 1), generator=torch.Generator().manual_seed(0))


def synchronizer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


# -- pure arithmetic of a row (tests/unit/test_bench_throughput.py) ---------------------------
def bytes_per_s(batch: int, context: int, step_s: float) -> float:
    """Target bytes trained per second: every window trains N targets (x_1 … x_N)."""
    return batch * context / step_s


def mfu(flops_per_step: int, step_s: float, peak_gflops: float) -> float:
    """Achieved FLOP/s over the peak FLOP/s."""
    return flops_per_step / step_s / (peak_gflops * 1e9)


def peak_of(samples: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """The peak of each dtype: the fastest size of any of the measurements (before and after the rows)."""
    return {dtype: max(m[dtype][size] for m in samples for size in m[dtype]) for dtype in samples[0]}


def phases(spent: dict[str, float], step_s: float) -> list[dict[str, float | str]]:
    """The flat breakdown of one step from its nested timers: each part's seconds and share of the step;
    an enclosing timer (forward, backward + optimizer) less the parts it encloses; the rest of the step.
    A block's forward splits into its streams, the mask and the rest; the AR model's stays whole."""
    parts: dict[str, float] = {}
    if "clean" in spent:
        parts = {"clean stream (forward)": spent["clean"], "mask": spent.get("mask", 0.0),
                 "noisy stream layers (forward)": spent["noisy"]}
        parts["embeddings, σ-embedding, head (forward)"] = spent["forward"] - sum(parts.values())
    else:
        parts["forward"] = spent["forward"]
    parts["backward"] = spent["apply"] - spent["clip"] - spent["optimizer"]
    parts["grad-norm clip"], parts["AdamW step"] = spent["clip"], spent["optimizer"]
    parts["inputs and loss (rest of the step: σ, noise ε, z, layout, CE)"] = step_s - spent["forward"] - spent["apply"]
    return [{"part": name, "s": sec, "share": sec / step_s} for name, sec in parts.items()]


# -- measurements -----------------------------------------------------------------------------
def matmul_gflops(n: int, dtype: torch.dtype, device: torch.device) -> float:
    """Dense n × n × n matmul GFLOP/s: median of PEAK_REPS after two warm-ups."""
    g = torch.Generator().manual_seed(n)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    sync, times = synchronizer(device), []
    for i in range(2 + PEAK_REPS):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def measure_peak(sizes: tuple[int, ...], precisions: list[Precision], device: torch.device) -> dict[str, dict[str, float]]:
    return {p.value: {str(n): matmul_gflops(n, DTYPES[p], device) for n in sizes} for p in precisions}


def count_flops(tr: BlockTrainer | ARTrainer, x: torch.Tensor) -> int:
    """FLOPs of one whole training step (it runs the step)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        tr.train_step(x)
    return counter.get_total_flops()


def step_times(tr: BlockTrainer | ARTrainer, x: torch.Tensor, n: int) -> list[float]:
    sync, times = synchronizer(tr.device), []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        tr.train_step(x)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def pair(d: int, heads: int, precision: Precision, batch: int, device: torch.device) -> list[dict]:
    """The block row and the AR row of one width and precision. Their timed steps alternate, so that
    whatever else the machine runs meanwhile slows both alike and their ratio stays fair."""
    cfg = config(d, heads)
    x = windows(cfg, batch)
    trainers = {m: make_trainer(m, cfg, precision, batch, device) for m in ("block", "ar")}
    flops = {m: count_flops(tr, x) for m, tr in trainers.items()}
    for tr in trainers.values():
        step_times(tr, x, WARMUP)
    times: dict[str, list[float]] = {m: [] for m in trainers}
    for _ in range(TIMED):
        for m, tr in trainers.items():
            times[m] += step_times(tr, x, 1)
    rows = []
    for m in trainers:
        step_s = statistics.median(times[m])
        rows.append({"model": m, "d_model": d, "heads": heads, "precision": precision.value, "batch": batch,
                     "device": str(device), "step_s": step_s, "step_s_all": times[m],
                     "bytes_per_s": bytes_per_s(batch, CONTEXT, step_s), "flops_per_step": flops[m],
                     "gflops_per_s": flops[m] / step_s / 1e9})
        print(f"[throughput] {m} d={d} {precision.value}: {step_s:.3f} s, {rows[-1]['bytes_per_s']:,.0f} B/s, "
              f"{flops[m] / 1e9:.1f} GFLOP/step, {rows[-1]['gflops_per_s']:.1f} GFLOP/s", flush=True)
    return rows


@contextlib.contextmanager
def patched(obj: object, name: str, fn: Callable) -> Iterator[None]:
    """obj.name = fn inside the block; restored after, whether it was the object's own or inherited."""
    own, old = name in vars(obj), getattr(obj, name)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def timers(tr: BlockTrainer | ARTrainer) -> Iterator[dict[str, float]]:
    """Seconds spent in the parts of the trainer's own step, summed over the steps run inside. The
    trainer's calls are wrapped where they are made; nothing of the step is re-implemented here."""
    spent: dict[str, float] = collections.defaultdict(float)
    sync = synchronizer(tr.device)

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[name] += time.perf_counter() - t0
        return run

    hooks = [(tr, "_fp32", "forward"), (tr, "_apply", "apply"), (tr.opt, "step", "optimizer"),
             (torch.nn.utils, "clip_grad_norm_", "clip")]
    if isinstance(tr, BlockTrainer):
        hooks += [(tr.model, "encode_context", "clean"), (Layout, "mask", "mask"),
                  *((layer, "noisy", "noisy") for layer in tr.model.layers)]
    with contextlib.ExitStack() as stack:
        for obj, name, part in hooks:
            stack.enter_context(patched(obj, name, timed(part, getattr(obj, name))))
        yield spent


def profile(model: str, d: int, heads: int, batch: int, device: torch.device, top: int = 8) -> dict:
    """Where one width's fp32 step goes: the timed parts of the step, and torch.profiler's top ops."""
    cfg = config(d, heads)
    tr, x = make_trainer(model, cfg, Precision.FP32, batch, device), windows(cfg, batch)
    step_times(tr, x, WARMUP)
    steps = []  # (step seconds, the parts' seconds in that step)
    with timers(tr) as spent:
        for _ in range(PROFILE_STEPS):
            before = dict(spent)
            steps.append((step_times(tr, x, 1)[0], {k: v - before.get(k, 0.0) for k, v in spent.items()}))
    step_s, parts = sorted(steps, key=lambda st: st[0])[len(steps) // 2]  # the median step, whole
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step_times(tr, x, PROFILE_STEPS)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    ops = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / PROFILE_STEPS,
            "share": e.self_cpu_time_total / total} for e in events[:top]]
    return {"model": model, "d_model": d, "step_s": step_s, "parts": phases(parts, step_s), "top_ops": ops}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    return platform.processor() or platform.machine()


# -- the table --------------------------------------------------------------------------------
def metrics(res: dict) -> dict[str, Metric]:
    """MFU of each model at the smallest and largest width, fp32 and bf16."""
    widths = sorted({r["d_model"] for r in res["rows"]})
    return {f"{r['model']} d = {r['d_model']} {r['precision']}: MFU": r["mfu"] for r in res["rows"]
            if r["d_model"] in (widths[0], widths[-1])}


def render(r: dict) -> str:
    peaks = [(p, n, f"{r['peak_before'][p][n]:,.0f}", f"{r['peak_after'][p][n]:,.0f}")
             for p in r["peak_before"] for n in r["peak_before"][p]]
    rows = [(x["model"], x["d_model"], x["heads"], x["precision"], f"{x['step_s']:.3f}", f"{x['bytes_per_s']:,.0f}",
             f"{x['flops_per_step'] / 1e9:,.2f}", f"{x['gflops_per_s']:,.1f}", f"{x['mfu']:.3f}") for x in r["rows"]]
    ratio = [(p, d, f"{v:.2f}") for p, by in r["block_over_ar_mfu"].items() for d, v in by.items()]
    lines = [
        "## Throughput against the hardware (`bench/throughput.py`)",
        "",
        f"Command: `{r['command']}` ({r['date']}; {r['device']}, {r['threads']} torch threads, torch {r['torch']}; "
        f"{r['machine_note'] or 'no note on the machine'}). One step = the trainer's own `train_step` at batch {r['batch']}, N = {r['context']}, "
        f"L = {r['layers']} (block 0 of B = 3, K ∈ {{1, 16}}; the AR model has the same L and per-layer shape); "
        f"median of {r['timed_steps']} steps after {r['warmup_steps']} warm-up. bytes/s counts target bytes "
        "(N per window). FLOPs counted by `torch.utils.flop_counter` over one whole step (forward + backward, "
        "attention at full T_q × T_k); MFU = FLOPs / step s / the peak of the step's dtype.",
        "",
        "Dense matmul peak (GFLOP/s, n × n × n, median of 5), measured before and after the rows; the peak is "
        f"the max: **{', '.join(f'{p} {v:,.0f}' for p, v in r['peak_gflops'].items())} GFLOP/s**.",
        "",
        *table(["dtype", "n", "before", "after"], peaks, "lrrr"),
        "",
        *table(["model", "d", "heads", "precision", "step s", "bytes/s", "GFLOP/step", "GFLOP/s", "MFU"], rows,
               "lrrlrrrrr"),
        "",
        "Block-step MFU over AR-step MFU (aim at the largest width: ≥ 0.8):",
        "",
        *table(["precision", "d", "block / AR"], ratio, "lrr"),
    ]
    for p in r["profile"]:
        lines += ["", f"Where the {p['model']} step's time goes at d = {p['d_model']}, fp32 "
                      f"({p['step_s']:.3f} s: the median of {PROFILE_STEPS} steps; timers around the trainer's own calls):", "",
                  *table(["part", "s/step", "share"],
                         [(q["part"], f"{q['s']:.4f}", f"{q['share']:.1%}") for q in p["parts"]], "lrr"),
                  "", "torch.profiler, top ops by self CPU time:", "",
                  *table(["op", "ms/step", "share"],
                         [(f"`{o['op']}`", f"{o['ms_per_step']:.1f}", f"{o['share']:.1%}") for o in p["top_ops"]], "lrr")]
    return "\n".join(lines)


def main() -> None:
    ap = BenchParser(__doc__.split("\n\n")[0])
    ap.result("throughput")
    ap.quick(help="Two tiny widths: a smoke test of the benchmark itself.")
    ap.batch(BATCH)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--note", default="", help="what else ran on the machine, for the table's heading")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precisions = [Precision.parse(p) for p in args.precisions.split(",")]
    widths, sizes = (QUICK_WIDTHS, QUICK_PEAK_SIZES) if args.quick else (WIDTHS, PEAK_SIZES)
    t0 = time.perf_counter()
    before = measure_peak(sizes, precisions, device)
    rows = [r for p in precisions for d, h in widths for r in pair(d, h, p, args.batch, device)]
    after = measure_peak(sizes, precisions, device)
    peak = peak_of([before, after])
    for r in rows:
        r["mfu"] = mfu(r["flops_per_step"], r["step_s"], peak[r["precision"]])
    mfus = {(r["model"], r["precision"], r["d_model"]): r["mfu"] for r in rows}
    d, heads = widths[-1]
    res = {
        "command": invoked(), "date": time.strftime("%Y-%m-%d %H:%M"), "device": device_name(device),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine_note": args.note,
        "batch": args.batch, "context": CONTEXT, "layers": LAYERS, "warmup_steps": WARMUP, "timed_steps": TIMED,
        "peak_gflops": peak, "peak_before": before, "peak_after": after, "rows": rows,
        "block_over_ar_mfu": {p.value: {str(w): mfus["block", p.value, w] / mfus["ar", p.value, w] for w, _ in widths}
                              for p in precisions},
        "profile": [profile(m, d, heads, args.batch, device) for m in ("block", "ar")],
    }
    res["wall_s"] = time.perf_counter() - t0
    print(f"[throughput] peak {peak}; block/AR MFU {res['block_over_ar_mfu']}; {res['wall_s']:.0f} s", flush=True)
    publish("throughput", res, metrics(res), render, out=args.results)


if __name__ == "__main__":
    main()
