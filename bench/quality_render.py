"""bench/quality.py's report: the BENCHMARKS.md sections of the default and serving profiles, the
headline metrics, and the learning-curve plot. Everything here reads the result record alone (its
"config" holds the shape), so a record can be re-rendered without rerunning the bench."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench import baselines
from bench.report import pyplot, table
from bench.runs import Metric


def metrics(res: dict) -> dict[str, Metric]:
    """The chain's held-out CE (SCE-8, K = 1) against the AR model's, as deployed and at equal total compute;
    for the serving profile, its chain at K = 1 against AR."""
    if "sce" in res:
        return {"chain CE, K = 1 (SCE-8)": res["sce"]["1"]["sce8"], "AR CE": res["ar_total_ce"]}
    return {"chain CE, as deployed": res["sce8_k1_deployed"], "AR CE, as deployed": res["ar_total_ce_deployed"],
            "chain CE, equal total compute": res.get("sce8_k1"), "AR CE, equal total compute": res["ar_total_ce"],
            "swarm chain CE": res.get("sce8_k1_swarm")}


def render_default(r: dict, runs: dict, plot: Path | None, baselines_png: Path | None = None) -> str:
    c, S = r["config"], r["config"]["seeds"]
    B, L = c["n_blocks"], c["n_layers"]
    ar_total, ar_block = f"ar{B * L}", f"ar{L}"
    T, Ts = r["budget_s"], r.get("swarm_budget_s")

    def cmd(name: str) -> str:
        return f"`{runs[name]['command']}`"

    def alone(ev: dict) -> str:
        parts = [f"block {a['block']} {a['best']:.4f}" for a in ev["alone"]]
        best = ev["best_block"]
        return f"{', '.join(parts)}; best block {best['block']}"

    def verdict(chain: float, best: float) -> str:
        return f"chain − best block = **{chain - best:+.4f}** ({'composes' if chain <= best - 0.05 else 'beats it' if chain < best else 'does not beat it'})"

    dep = runs["deployed"]["eval"]
    ev = f"`btnode eval --checkpoint runs/bench-quality/<model> --windows {c['windows']} --seeds {S}`"
    lines = [
        "## Quality: blockwise vs autoregressive (`bench/quality.py`)",
        "",
        f"Command: `.venv/bin/python -m bench.quality` ({r['date']}, {r['machine']}). Model: d={c['d_model']}, "
        f"{c['n_heads']} heads, B={B} blocks × L={L} layers, N={c['context']}, K ∈ {c['segments']}, batch {c['batch']}, "
        f"AdamW lr {c['lr']}; block training defaults {c['train_defaults']} (K = 1 share, context-readout share); "
        f"readout `{c['readout']}`. Held-out: {c['windows']} windows of {c['corpus']}'s test split, rows with ≥ N/2 "
        "context; "
        f"SCE uses N_s = {c['n_steps']} and seeds 0..{S - 1}; every model is scored by {ev} on the same rows. "
        "**Budget rule**: per-worker wall-clock on this 2-core machine, turned into optimizer steps with step "
        f"times measured alone first (block {runs['deployed']['per_step_s']:.3f} s, {ar_total.upper()} "
        f"{runs[ar_total]['per_step_s']:.3f} s, {ar_block.upper()} {runs[ar_block]['per_step_s']:.3f} s per step). "
        "'Alone' is each block read on its own at K = 1 (the better of one evaluation from pure noise at σ_hi with "
        f"{S} seeds and its context readout), on the same windows and rows. nats/byte.",
        "",
        f"### One worker per block at T = {T:.0f} s (as deployed)",
        "",
        *table(["model", "budget rule", "metric", "nats/byte", "steps", "command"], [
            ("blockwise chain, K=1", "each block alone for T", "SCE-1", f"{dep['per_k']['1']['sce1']:.4f}",
             f"{runs['deployed']['steps']} per block", cmd("deployed")),
            ("blockwise chain, K=1", "same", f"SCE-{S}", f"**{r['sce8_k1_deployed']:.4f}**", "", "same"),
            (f"blockwise chain, K={r['kmax']}", "same", f"SCE-{S}", f"{r['sce8_kmax_deployed']:.4f}", "", "same"),
            ("each block alone, K=1", "same", "CE", alone(dep), "", "same"),
            (f"AR, {B * L} layers (B·L)", "T", "teacher-forced CE", f"{r['ar_total_ce_deployed']:.4f}",
             runs[ar_total]["steps"], cmd(ar_total)),
            (f"AR, {L} layers (L)", "T", "teacher-forced CE", f"{r['ar_block_ce_deployed']:.4f}", runs[ar_block]["steps"],
             cmd(ar_block)),
            ("unigram entropy of the test split", "", "", f"{r['unigram']:.4f}", "", "")], "lllrrl"),
        "",
        f"Gap to the {B * L}-layer AR: **{r['sce8_k1_deployed'] - r['ar_total_ce_deployed']:+.4f}** nats/byte (aim ≤ +0.10); "
        f"to the {L}-layer AR: {r['sce8_k1_deployed'] - r['ar_block_ce_deployed']:+.4f}. Composition: "
        f"{verdict(r['sce8_k1_deployed'], r['best_block_alone_deployed'])}; aim ≤ −0.05.",
        "", *(swarm_lines(r, runs, cmd, alone, verdict) if Ts is not None else []),
        "### Learning curves",
        "",
        "Checkpoints along one run (the cosine schedule is the full run's, so the early points have not "
        "decayed their learning rate); the swarm's points are its published versions. Per-worker wall-clock is "
        "steps × the step time above.",
        "",
    ]
    models = ["deployed", "swarm", ar_total, ar_block]
    names = {"deployed": "one worker per block", "swarm": "swarm, 2 replicas", ar_total: f"AR {B * L} layers",
             ar_block: f"AR {L} layers"}
    lines += table(["model", "per-worker budget: nats/byte"],
                   [(names[m], ", ".join(f"{x['budget_s']:.0f} s: {x['sce8_k1']:.4f}" for x in r["curves"] if x["model"] == m))
                    for m in models if m in runs])
    if plot is not None:
        lines += ["", f"![learning curves](bench/results/{plot.name})"]
    lines += ["", *baselines.render(r["baselines"], baselines_png)]
    lines += [
        "",
        *table(["peak RSS (wait4)", "MB", "command"], [
            ("process training one block", f"{r['rss_block_mb']:.0f}", "`btnode train-local --block 0 --steps 30 --batch 32 ...`"),
            (f"process training the {B * L}-layer AR", f"{r['rss_ar_total_mb']:.0f}",
             f"`btnode train-ar --ar-layers {B * L} --steps 30 --batch 32 ...`"),
            ("python + torch + btnode imported, nothing trained", f"{r['rss_torch_baseline_mb']:.0f}",
             "`python -c 'import torch, btnode.train.loops'`")], "lrl"),
    ]
    return "\n".join(lines)


def swarm_lines(r: dict, runs: dict, cmd: Callable[[str], str], alone: Callable[[dict], str],
                verdict: Callable[[float, float], str]) -> list[str]:
    """render_default's swarm and equal-total-compute sections (a run with --no-swarm has neither)."""
    B, L = r["config"]["n_blocks"], r["config"]["n_layers"]
    S, T, Ts = r["config"]["seeds"], r["budget_s"], r["swarm_budget_s"]
    eq, sw = runs["deployed-swarm-budget"]["eval"], runs["swarm"]["eval"]
    return [
        f"### The swarm at T_s = {Ts:.0f} s per worker, beside one worker per block at T_s",
        "",
        *table(["model", "budget rule", "SCE-1, K=1", f"SCE-{S}, K=1", "blocks alone", "command"], [
            (f"swarm: {B} blocks × 2 replicas, {runs['swarm']['rounds']} rounds of H={runs['swarm']['steps_per_round']}",
             "each replica T_s", f"{sw['per_k']['1']['sce1']:.4f}", f"**{r['sce8_k1_swarm']:.4f}**", alone(sw),
             f"{cmd('swarm')}, then `btnode eval --checkpoint runs/bench-quality/swarm/state --version "
             f"{runs['swarm']['rounds']}`"),
            ("one worker per block", "each block alone for T_s", f"{eq['per_k']['1']['sce1']:.4f}",
             f"**{r['sce8_k1_deployed_at_swarm_budget']:.4f}**", alone(eq), cmd("deployed-swarm-budget"))], "llrrll"),
        "",
        f"Swarm minus one worker per block: **{r['sce8_k1_swarm'] - r['sce8_k1_deployed_at_swarm_budget']:+.4f}** "
        "nats/byte (aim ≤ 0). Composition in the swarm: "
        f"{verdict(r['sce8_k1_swarm'], r['best_block_alone_swarm'])}.",
        "",
        f"### Equal total compute ({B} × T_s = {B * Ts:.0f} s of training in all)",
        "",
        f"One worker per block at T_s = {Ts:.0f} s is {B * Ts:.0f} s of compute in all; the AR rows above got T = {T:.0f} s. "
        f"Blockwise SCE-{S} at K=1 {r['sce8_k1']:.4f} (SCE-1 {r['sce1_k1']:.4f}; K={r['kmax']}: SCE-{S} {r['sce8_kmax']:.4f}) "
        f"against {r['ar_total_ce']:.4f} for the {B * L}-layer AR: gap **{r['sce8_k1'] - r['ar_total_ce']:+.4f}** "
        f"(was +0.6075 on 2026-11-30, when the three blocks shared 900 s with half of the batches at K = 16 and the "
        "readout was the last evaluation alone; against the 2-layer AR: "
        f"{r['sce8_k1'] - r['ar_block_ce']:+.4f}).",
        "",
    ]


def render_serving(res: dict) -> str:
    c, runs = res["config"], res["runs"]
    ar_total = f"ar{c['n_blocks'] * c['n_layers']}"
    return "\n".join([
        "## Quality of the serving model (`bench/quality.py --profile serving`)", "",
        f"Command: `.venv/bin/python -m bench.quality --profile serving` ({res['date']}). The model "
        f"`bench/serving.py` runs: d={c['d_model']}, B={c['n_blocks']} × L={c['n_layers']}, N={c['context']} "
        f"(so that K = 256 fits), K ∈ {c['segments']}, {c['budget_s']:.0f} s of training per model on 2 cores; "
        f"{c['windows']} held-out windows, N_s = {c['n_steps']}, seeds 0..{c['seeds'] - 1}.", "",
        *table(["model", "K", "SCE-1", "SCE-8", "steps", "command"],
               [("blockwise", k, f"{v['sce1']:.4f}", f"{v['sce8']:.4f}", runs["blocks"]["steps"],
                 f"`{runs['blocks']['command']}`") for k, v in res["sce"].items()], "lrrrrl"),
        "", f"The {ar_total[2:]}-layer autoregressive baseline served beside it: teacher-forced CE "
        f"{res['ar_total_ce']:.4f} nats/byte after {runs[ar_total]['steps']} steps "
        f"(`{runs[ar_total]['command']}`). Unigram entropy of the held-out file: {res['unigram']:.4f}."])


def plot_curves(res: dict, path: Path) -> Path | None:
    """SCE-8 at K = 1 against per-worker wall-clock (matplotlib: the `bench` extra)."""
    plt = pyplot("quality")
    if plt is None:
        return None

    B, L = res["config"]["n_blocks"], res["config"]["n_layers"]
    labels = {"deployed": "one worker per block", "swarm": "swarm, 2 replicas per block",
              f"ar{B * L}": f"AR, {B * L} layers (B·L)",
              f"ar{L}": f"AR, {L} layers (L)"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, label in labels.items():
        pts = sorted((c["budget_s"], c["sce8_k1"]) for c in res["curves"] if c["model"] == model)
        if not pts:  # no swarm rows (--no-swarm)
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(res["unigram"], color="grey", linestyle=":", label="unigram entropy")
    ax.set_xscale("log")
    ax.set_xlabel("per-worker training wall-clock (s, 2 cores; checkpoints along one run)")
    ax.set_ylabel("held-out nats/byte (blocks: SCE-8 at K=1; AR: CE)")
    ax.set_title(f"Learning curves, {res['config']['corpus']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
