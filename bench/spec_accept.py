"""How often the pooled blocks keep block 0's draft (issue #11): the per-byte acceptance of readout
"spec", measured teacher-forced on the tuning slice before any judged run.

Speculative sampling keeps a byte drawn from the draft q with probability min(1, p/q), so its
acceptance at one position is Σ_v min(p(v), q(v)) = 1 − TV(p, q). Here q is block 0's context
readout (what stage 0 drafts from) and p is the pool of every block's context readout (what the
last stage accepts against), both given the real bytes before the row. For W windows of the tuning
slice (never the held-out file: a setting chosen here must not see the test), rows t ∈ [N/2, N)
with ≥ N/2 bytes of context, this reports the mean acceptance for a few draft temperatures τ
(q = softmax(ℓ₀/τ); τ = 1 is the served draft), which block would draft best, each block's and the
pool's teacher-forced CE, and the bytes per traversal the mean acceptance α would give a draft of
K bytes if rows were independent, Σ_{j<K} α^j (a rough guide: acceptances along a draft are
correlated).

    .venv/bin/python -m bench.spec_accept --blocks runs/served2

Writes bench/results/spec_accept.json and the "spec-accept" section of BENCHMARKS.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import invoked, publish, table
from bench.runs import Metric

from btnode.data import corpus
from btnode.data.windows import eval_windows
from btnode.model.layout import eval_layout
from btnode.model.sampler import context_logits, log_probs
from btnode.store.models import load_blocks

TAUS = (1.0, 0.9, 0.8, 0.7)
KS = (4, 8, 16, 32, 64)


@torch.no_grad()
def readouts(blocks, windows: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """(B, W, N/2, V) log-probs of every block's context readout on the scored rows."""
    n = windows.shape[1] - 1
    layout = eval_layout(n, 1)
    out = []
    for block in blocks:
        parts = [log_probs(context_logits(block, block.encode_context(w[:, :n]), layout))
                 for w in windows.split(batch)]
        out.append(torch.cat(parts))
    return torch.stack(out)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.minimum(p, q).sum(-1).mean())


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--blocks", type=Path, required=True)
    ap.windows(256, help="windows of the tuning slice scored")
    ap.result("spec-accept")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    cfg, blocks = load_blocks(args.blocks)
    blocks = [b.eval() for b in blocks[:cfg.n_blocks]]
    windows = eval_windows(corpus.bundled().tune, cfg.context, args.windows)
    n = cfg.context
    lp = readouts(blocks, windows)  # (B, W, T, V)
    target = windows[:, n // 2 + 1:]  # row t predicts x_{t+1}
    pooled = torch.log_softmax(lp.mean(0), -1)
    p = pooled.exp()

    def ce(logp: torch.Tensor) -> float:
        return float(-logp.gather(-1, target[..., None]).mean())

    res = {"command": invoked(), "date": time.strftime("%Y-%m-%d"),
           "blocks": str(args.blocks), "windows": len(windows), "rows_per_window": n // 2,
           "ce_pool": ce(pooled), "ce_block": [ce(lp[b]) for b in range(len(blocks))],
           "acceptance_block0": {str(t): acceptance(p, torch.softmax(lp[0] / t, -1)) for t in TAUS},
           "acceptance_by_drafter": [acceptance(p, lp[b].exp()) for b in range(len(blocks))],
           "greedy_agreement_block0": float((lp[0].argmax(-1) == pooled.argmax(-1)).float().mean())}
    a = res["acceptance_block0"]["1.0"]
    res["bytes_per_traversal_if_independent"] = {str(k): (1 - a ** k) / (1 - a) for k in KS}
    res["seconds"] = time.perf_counter() - t0
    publish("spec-accept", res, metrics(res), render, out=args.results)
    print(json.dumps(res, indent=1))


def metrics(res: dict) -> dict[str, Metric]:
    """Share of block 0's draft kept at temperature 1, and the pool's CE against the best block's."""
    return {"draft bytes kept, T = 1": res["acceptance_block0"]["1.0"], "CE, pool": res["ce_pool"],
            "CE, best block": min(res["ce_block"]), "greedy agreement with block 0": res["greedy_agreement_block0"]}


def render(r: dict) -> str:
    lines = ["## How often the pooled blocks keep block 0's draft (`bench/spec_accept.py`)", "",
             f"Command: `{r['command']}` ({r['date']}). Blocks `{r['blocks']}`; {r['windows']} windows of the tuning "
             f"slice, {r['rows_per_window']} rows each, teacher-forced: the draft q and the pool p are read on the real "
             "bytes before each row. Acceptance = mean Σ_v min(p, q) = 1 − TV(p, q), the probability that "
             "speculative sampling keeps a draft byte.", "",
             *table(["what", "value"], [
                 (f"pool of {len(r['ce_block'])} context readouts, CE (nats/byte)", f"{r['ce_pool']:.4f}"),
                 *((f"block {b} context readout, CE", f"{c:.4f}") for b, c in enumerate(r["ce_block"])),
                 *((f"acceptance, draft = block 0 at τ = {t}", f"{v:.4f}") for t, v in r["acceptance_block0"].items()),
                 *((f"acceptance, draft = block {b} (τ = 1)", f"{v:.4f}")
                   for b, v in enumerate(r["acceptance_by_drafter"])),
                 ("greedy: block 0's argmax = the pool's", f"{r['greedy_agreement_block0']:.4f}"),
                 *((f"bytes per traversal of readout spec at K = {k} if acceptances were independent", f"{v:.2f}")
                   for k, v in r["bytes_per_traversal_if_independent"].items())], "lr")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
