"""The baselines a user tries first (issue #42), as bench/quality.py records them: one row per
(corpus, model, per-worker budget, training seed) with its held-out CE, the corpus they ran on,
their table and their plot of CE against per-worker budget. No training here: quality.py trains."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.report import pyplot, table
from bench.runs import slug
from btnode.data.identity import manifest_id
from btnode.data.manifest import read_manifest

__all__ = ["BUNDLED", "MODELS", "describe", "plot", "render", "rows", "slug"]

BUNDLED = "bundled"
# model → what it is, for a reader; B = blocks, L = layers per block
MODELS = {
    "chain": "the chain of B blocks, one worker each (SCE-S at K = 1)",
    "block_alone_best": "its best block read alone at K = 1",
    "ar_block": "AR-L on one worker (the block-sized model)",
    "ar_total": "AR-(B·L) on one worker",
    "diloco_block": "DiLoCo of AR-L over B workers",
    "ensemble_ar_block": "B AR-L models trained apart, probabilities averaged",
}


def describe(corpus: str) -> dict:
    """The corpus a run used: its name, and for a prepared dataset its size, its id (the sha256 of its
    manifest, which lists every shard's sha256) and the source its manifest names."""
    if corpus == BUNDLED:
        return {"name": "wikitext-2"}
    manifest = read_manifest(Path(corpus))
    source = manifest.extra.get("source", {})
    return {"name": source.get("name") or Path(corpus).name, "bytes": sum(s.bytes for s in manifest.splits.values()),
            "sha256": manifest_id(manifest).removeprefix("sha256:"), "documents": manifest.documents,
            "splits": {n: s.bytes for n, s in manifest.splits.items()},
            **{k: source[k] for k in ("package", "version", "deb_sha256", "jsonl_sha256", "license") if k in source}}


def rows(*, corpus: str, seed: int, budget: float, fractions: Sequence[int], seeds: int, chain: dict, ar_block: dict,
         ar_total: dict, diloco: dict, ensemble: Sequence[float]) -> list[dict]:
    """Rows at each checkpoint T/div of one seed's runs (bench/quality.py's run records, whose points
    follow `fractions`). `budget_s` is the budget given; `trained_s` what its whole steps or rounds cost."""
    def row(model: str, div: int, point: dict, ce: float, per_step: float) -> dict:
        return {"corpus": corpus, "model": model, "budget_s": budget / div, "seed": seed, "ce": ce,
                "steps": point["steps"], "trained_s": point["steps"] * per_step}

    out = []
    for i, div in enumerate(fractions):
        c = chain["points"][i]
        out += [row("chain", div, c, c["eval"]["per_k"]["1"][f"sce{seeds}"], chain["per_step_s"]),
                row("block_alone_best", div, c, c["eval"]["best_block"]["ce"], chain["per_step_s"])]
        out += [row(name, div, run["points"][i], run["points"][i]["eval"]["ce"], run["per_step_s"])
                for name, run in (("ar_block", ar_block), ("ar_total", ar_total), ("diloco_block", diloco))]
        out.append(row("ensemble_ar_block", div, ar_block["points"][i], ensemble[i], ar_block["per_step_s"]))
    return out


def _means(found: Sequence[dict]) -> dict[tuple[str, float], list[float]]:
    by: dict[tuple[str, float], list[float]] = {}
    for r in found:
        by.setdefault((r["model"], r["budget_s"]), []).append(r["ce"])
    return by


def render(found: Sequence[dict], png: Path | None) -> list[str]:
    if not found:
        return []
    by = _means(found)
    budgets = sorted({b for _, b in by})
    seeds = sorted({r["seed"] for r in found})
    lines = [f"### The baselines users try first ({found[0]['corpus']}, issue #42)", "",
             f"Held-out CE (nats/byte), mean over training seeds {', '.join(map(str, seeds))} (range in brackets), at "
             "the same per-worker budgets: checkpoints along each run, as in the learning curves.", "",
             *table(["model", *(f"{b:.0f} s" for b in budgets)],
                    [(MODELS[m], *(_cell(by.get((m, b), [])) for b in budgets)) for m in MODELS], "l" + "r" * len(budgets))]
    if png is not None:
        lines += ["", f"![CE against per-worker budget](bench/results/{png.name})"]
    return lines


def _cell(values: list[float]) -> str:
    if not values:
        return ""
    mean = f"{statistics.fmean(values):.4f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.3f}–{max(values):.3f})"


def plot(found: Sequence[dict], path: Path) -> Path | None:
    """CE against per-worker budget, one line per model, the mean over seeds (matplotlib: the `bench` extra)."""
    plt = pyplot("quality")
    if plt is None or not found:
        return None
    by = _means(found)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, label in MODELS.items():
        pts = sorted((b, statistics.fmean(v)) for (m, b), v in by.items() if m == model)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("per-worker training wall-clock (s)")
    ax.set_ylabel("held-out nats/byte")
    ax.set_title(f"The baselines users try first, {found[0]['corpus']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
