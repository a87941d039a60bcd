"""The robust screen at a round's close (`screen`), and what it reads of the updates it no longer holds (aggregate/round/block.py): each update's
cosine with a robust reference, from the 4,096-value sketches the round kept; and the trimmed mean or
median of their fp32 values, read from the round's spill a column of coordinates at a time."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from btnode.aggregate.sums.averaging import OuterConfig, combine
from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill

if TYPE_CHECKING:
    from btnode.aggregate.round.config import AggregatorConfig

log = logging.getLogger(__name__)

ROBUST_COLUMN_BYTES = 64 << 20  # trimmed and median: what one column of the round's updates may hold


def sketch_cosines(ups: list[Update]) -> list[float]:
    """Each update's cosine with a robust reference, in sketch space (accumulate.Sketcher): in
    dense rounds the coordinate-wise median of the round's sketches (robust to a minority, however
    large its updates: what the median update was before, at 32 KB an update instead of 4 bytes a
    parameter); in rounds with sparse updates, whose median is zero almost everywhere, the weighted
    sum of the other updates (the round's sum less its own share)."""
    sketches = torch.stack([u.sketch for u in ups])
    if not any(u.codec.sparse for u in ups):
        n = len(ups)  # the middle value(s) of each coordinate; kthvalue, not a sort: a sort of N sketches
        #   holds N × 4,096 values and int64 indices again (bench/round_memory.py)
        ref = (sketches.kthvalue(n // 2 + 1, dim=0).values if n % 2 else
               (sketches.kthvalue(n // 2, dim=0).values + sketches.kthvalue(n // 2 + 1, dim=0).values) / 2)
        ref_norm = float(ref.norm())
        return [float(s.dot(ref)) / max(float(s.norm()) * ref_norm, 1e-30) for s in sketches]
    total = torch.zeros_like(ups[0].sketch)
    for u in ups:
        total.add_(u.sketch, alpha=u.weight)
    t2 = float(total.dot(total))
    out = []
    for u in ups:
        own2, d = float(u.sketch.dot(u.sketch)), float(u.sketch.dot(total))
        others2 = max(t2 - 2 * u.weight * d + u.weight**2 * own2, 0.0)
        out.append((d - u.weight * own2) / max(math.sqrt(own2 * others2), 1e-30))
    return out


def spilled_rule(spill: Spill, ups: list[Update], spec: Mapping[str, tuple[int, ...]], outer: OuterConfig,
                 n: str) -> torch.Tensor:
    """Tensor `n` of the trimmed mean or median of the updates, whose fp32 values the round spilled:
    read a column of coordinates of all of them at a time, ROBUST_COLUMN_BYTES in all, so memory is
    bounded whatever N (the cost is disk: 4 bytes a parameter per update)."""
    numel = math.prod(spec[n])
    width = max(1024, ROBUST_COLUMN_BYTES // (4 * len(ups)))
    weights = [u.weight for u in ups]
    out = torch.empty(numel)
    for lo in range(0, numel, width):
        hi = min(numel, lo + width)
        rows = [{"c": torch.frombuffer(bytearray(spill.read(u.spilled[n][0] + 4 * lo, 4 * (hi - lo))),
                                       dtype=torch.float32)} for u in ups]
        out[lo:hi] = combine(rows, weights, outer)[0]["c"]
    return out.reshape(spec[n])


def screen(ups: list[Update], cfg: AggregatorConfig, label: str) -> tuple[list[Update], list[tuple[Update, str]]]:
    """Robust mode, with at least 3 updates: before combining, drop an update whose norm is
    outside the band around the round's median norm (screened: `screen_band`, [0.5, 2]×, which
    also drops zero, tiny and replayed updates; trimmed and median: over max_norm_ratio×), or
    whose cosine with the weighted sum of the others is negative (sign-flipped updates) or,
    screened, under `screen_cosine` × the round's median cosine (an update trained on other data
    drifts away from the others). Cosines are read from the updates' sketches (accumulate.Sketcher:
    4,096 values each, whatever the block's size), so the screen needs no update in memory.
    Deterministic: the same updates in worker-id order drop the same ones, in any arrival order.
    Returns the updates kept and (update, reason) of those dropped; none when it would drop them all."""
    if cfg.outer.robust == "mean" or len(ups) < 3:
        return ups, []
    screened = cfg.outer.robust == "screened"
    low, high = cfg.screen_band if screened else (0.0, cfg.max_norm_ratio)
    norms = [u.norm for u in ups]
    ref = statistics.median(norms)
    cosines = sketch_cosines(ups)
    least = max(0.0, cfg.screen_cosine * statistics.median(cosines)) if screened else 0.0
    kept, dropped = [], []
    for u, size, cos in zip(ups, norms, cosines):
        why = ("norm" if ref > 0 and not low * ref <= size <= high * ref else
               "direction" if cos < least else "")
        if why:
            dropped.append((u, f"{why}_at_close"))
            log.warning("%s: dropping the update of %s at close (%s: norm %.4g vs median %.4g, "
                        "cosine %.3f with the others, least %.3f)", label, u.worker_id, why, size, ref, cos, least)
        else:
            kept.append(u)
    if not kept:
        return ups, []
    return kept, dropped
