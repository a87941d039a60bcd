"""The robust screen at a round's close (`screen`), and what it reads of the updates it no longer holds (aggregate/round/block.py): each update's
cosine with a robust reference, from the 4,096-value sketches the round kept; and the trimmed mean or
median of their fp32 values, read from the round's spill a column of coordinates at a time."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from btnode.aggregate.sums.averaging import OuterConfig, combine
from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill
from btnode.aggregate.trust.standing import UNWEIGHTED

if TYPE_CHECKING:
    from btnode.aggregate.round.config import AggregatorConfig

log = logging.getLogger(__name__)

ROBUST_COLUMN_BYTES = 64 << 20  # trimmed and median: what one column of the round's updates may hold


def weighted_median(values: torch.Tensor, weights: torch.Tensor, *, columns: int = 256) -> torch.Tensor:
    """Per column of `values` (N, …): the value at which the weights, in ascending order of the values,
    first reach half their total; the mean of it and the next one when they reach exactly half (so with
    equal weights, the median). Rows of weight 0 take no part; some weight must be positive. Sorted a
    few `columns` at a time: N sketches sorted at once would hold N × 4,096 values and indices again."""
    keep = weights > 0
    assert bool(keep.any()), "a weighted median needs some weight"
    rows, w = values[keep], weights[keep].double()
    flat = rows.reshape(rows.shape[0], -1)
    half = float(w.sum()) / 2
    out = torch.empty(flat.shape[1], dtype=flat.dtype)
    for lo in range(0, flat.shape[1], columns):
        hi = min(flat.shape[1], lo + columns)
        vals, order = flat[:, lo:hi].sort(dim=0, stable=True)
        cum = w[order].cumsum(0)
        k = (cum < half * (1 - 1e-12)).sum(0, keepdim=True)  # the first row whose cumulative weight reaches half
        lower = vals.gather(0, k)
        exact = (cum.gather(0, k) <= half * (1 + 1e-12)) & (k + 1 < len(vals))
        upper = vals.gather(0, (k + 1).clamp(max=len(vals) - 1))
        out[lo:hi] = torch.where(exact, (lower + upper) / 2, lower)[0]
    return out.reshape(values.shape[1:])


def near_copies(ups: list[Update], cosine: float, *, rows: int = 256) -> list[torch.Tensor]:
    """For each update, the indices of the updates whose sketch's cosine with its own is at least `cosine`,
    its own included. Honest replicas' updates do not come near (≤ 0.965 in bench/cheats.py's swarms:
    docs/security.md); copies of one update, or of one update with a little noise, do."""
    sketches = torch.stack([u.sketch for u in ups])
    unit = sketches / sketches.norm(dim=1, keepdim=True).clamp(min=1e-30)
    out = []
    for lo in range(0, len(ups), rows):  # `rows` × N cosines at a time, not N × N
        gram = unit[lo:lo + rows] @ unit.T
        out.extend((g >= cosine).nonzero().flatten() for g in gram)
    for i, near in enumerate(out):  # its own is always near, however its sketch's norm rounds
        if not bool((near == i).any()):
            out[i] = torch.cat([near, torch.tensor([i])])
    return out


def votes(weights: list[float], near: list[torch.Tensor]) -> list[float]:
    """Each update's weight once near-copies share one: w_i² / Σ_{j near i} w_j. k copies of one update
    at weight w weigh w together (w/k each), whoever sent them; an update with no near-copy keeps its
    weight; one copied by an identity of weight 0 keeps it too. Not transitive (no chain of near-copies
    can take weight from an update it does not come near)."""
    w = torch.tensor(weights, dtype=torch.float64)
    return [float(w[i] ** 2 / w[near[i]].sum()) if w[i] > 0 else 0.0 for i in range(len(weights))]


def sketch_cosines(ups: list[Update], weights: list[float] | None = None,
                   near: list[torch.Tensor] | None = None) -> list[float]:
    """Each update's cosine with the round's reference, in sketch space (accumulate.Sketcher), under
    `weights` (default: the updates' own; near-copies already sharing one vote: `votes`). In dense rounds
    the reference is the coordinate-wise weighted median of the sketches (`weighted_median`, an update's
    own among them as one vote of many): it resists any set of updates that holds less than half the
    weight, however large or aligned they are. In rounds with sparse updates, whose median is zero almost
    everywhere, it is the weighted sum of the others: the round's sum less the update's own share and
    its near-copies' (`near`), so that copies do not vouch for each other; and a sparse update is judged
    on the coordinates it sent (the sketch's buckets it holds): the others' mass elsewhere says nothing
    of its direction, and counted, it lowered the cosine of an honest update by the share of the others'
    energy its top-k missed (at 0.3 % in bench/cheats.py's swarm: 0.13–0.44 on all, 0.30–0.69 on its own)."""
    w = [u.weight for u in ups] if weights is None else weights
    sketches = torch.stack([u.sketch for u in ups])
    if not any(u.codec.sparse for u in ups):
        ref = weighted_median(sketches, torch.tensor(w, dtype=torch.float64))
        ref_norm = float(ref.norm())
        return [float(s.dot(ref)) / max(float(s.norm()) * ref_norm, 1e-30) for s in sketches]
    wt = torch.tensor(w, dtype=torch.float64)
    total = (wt[:, None] * sketches).sum(0)
    out = []
    for i, s in enumerate(sketches):
        group = near[i] if near is not None else torch.tensor([i])
        others = total - (wt[group, None] * sketches[group]).sum(0)
        if ups[i].codec.sparse:
            others = torch.where(s != 0, others, 0.0)
        out.append(float(s.dot(others)) / max(float(s.norm()) * float(others.norm()), 1e-30))
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


@dataclass
class Screened:
    """What the screen made of a round: the updates kept, each update's weight in the mean (by update id:
    its standing-weighted work, near-copies sharing one vote), and (update, reason) of those dropped."""

    kept: list[Update]
    weights: dict[str, float]
    dropped: list[tuple[Update, str]] = field(default_factory=list)


def screen(ups: list[Update], cfg: AggregatorConfig, label: str) -> Screened:
    """Robust mode, with at least 3 updates: before combining, drop an update whose norm is
    outside the band around the round's median norm (screened: `screen_band`, [0.5, 2]×, which
    also drops zero, tiny and replayed updates; trimmed and median: over max_norm_ratio×), or
    whose cosine with the round's reference (`sketch_cosines`) is negative (sign-flipped updates) or,
    screened, under `screen_cosine` × the round's median cosine (an update trained on other data
    drifts away from the others). Every median here is weighted by the updates' votes (`votes`: their
    weight, the identity's standing times its work, with near-copies sharing one), so that neither
    identities without verified work nor copies under several identities set the reference.
    Cosines are read from the updates' sketches (accumulate.Sketcher: 4,096 values each, whatever the
    block's size), so the screen needs no update in memory.
    A kept update that weighs nothing (its identity has no standing yet) is reported dropped
    (`UNWEIGHTED`): it is not in the version. When no update has standing, each weighs its work alone.
    Deterministic: the same updates in worker-id order drop the same ones, in any arrival order.
    None is dropped when the screen would drop every update that has a vote."""
    weights = [u.work * u.standing for u in ups]  # as it entered the round (a retried close: not its last vote)
    if ups and not any(w > 0 for w in weights):
        log.warning("%s: no update in this round has standing: each weighs its work alone", label)
        weights = [u.work for u in ups]
    if cfg.outer.robust == "mean" or len(ups) < 3:
        return _unweighted_out(ups, weights, [])
    screened = cfg.outer.robust == "screened"
    low, high = cfg.screen_band if screened else (0.0, cfg.max_norm_ratio)
    near = near_copies(ups, cfg.standing.copy_cosine)
    vote = votes(weights, near)
    w = torch.tensor(vote, dtype=torch.float64)
    norms = [u.norm for u in ups]
    ref = float(weighted_median(torch.tensor(norms, dtype=torch.float64), w))
    cosines = sketch_cosines(ups, vote, near)
    least = max(0.0, cfg.screen_cosine * float(weighted_median(torch.tensor(cosines), w))) if screened else 0.0
    kept: list[int] = []
    dropped = []
    for i, (u, size, cos, copies) in enumerate(zip(ups, norms, cosines, near)):
        why = ("norm" if ref > 0 and not low * ref <= size <= high * ref else
               "direction" if cos < least else "")
        if why:
            dropped.append((u, f"{why}_at_close"))
            log.warning("%s: dropping the update of %s at close (%s: norm %.4g vs median %.4g, cosine %.3f with "
                        "the reference, least %.3f)", label, u.worker_id, why, size, ref, cos, least)
        else:
            kept.append(i)
        if len(copies) > 1:
            log.warning("%s: the update of %s and %d near-copies share one vote (weight %.4g of %.4g)", label,
                        u.worker_id, len(copies) - 1, vote[i], weights[i])
    if not any(vote[i] > 0 for i in kept):
        return _unweighted_out(ups, vote, [])
    return _unweighted_out([ups[i] for i in kept], [vote[i] for i in kept], dropped)


def _unweighted_out(ups: list[Update], weights: list[float], dropped: list[tuple[Update, str]]) -> Screened:
    """Those of `ups` that weigh nothing out of the version, as dropped (`UNWEIGHTED`); the rest kept."""
    kept = [u for u, w in zip(ups, weights) if w > 0]
    dropped = dropped + [(u, UNWEIGHTED) for u, w in zip(ups, weights) if not w > 0]
    return Screened(kept, {u.update_id: w for u, w in zip(ups, weights) if w > 0}, dropped)
