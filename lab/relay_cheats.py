"""Cheating relays, for tests only (docs/swarm.md, "Relays"): a relay that combines its
children honestly, then pushes a forged combined update under the honest manifest and weight. The
relay audit (aggregate/trust/evidence.py) must catch each, however small the change.

Run one as a real process: `python -m lab.relay_cheats CHEAT join --role relay ...`
(the arguments after CHEAT are `btnode`'s own)."""

from __future__ import annotations

import math
import runpy
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from btnode.aggregate.relay.admission import UpstreamAdmission
from btnode.aggregate.relay.forward import Combined
from btnode.node import relay as relay_node

Tensors = dict[str, torch.Tensor]
SCALE = 1.01  # the scaled cheat's factor: well within the claims' element-wise bound


def scaled(delta: Tensors) -> Tensors:
    """Every value × SCALE: a relay inflating its children's step a little."""
    return {n: t * SCALE for n, t in delta.items()}


def nudged(delta: Tensors) -> Tensors:
    """One coordinate moved to the next fp32 value: the smallest change there is."""
    out = {n: t.clone() for n, t in delta.items()}
    first = next(iter(out))
    flat = out[first].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))
    return out


CHEATS: dict[str, Callable[[Tensors], Tensors]] = {"scale": scaled, "nudge": nudged}


def cheating_relay(forge: Callable[[Tensors], Tensors]) -> type[UpstreamAdmission]:
    """A relay's admission whose blocks hand `forge(Δ)` upstream in place of the combined Δ."""

    class ForgingAdmission(UpstreamAdmission):
        def forward(self, c: Combined) -> None:
            super().forward(replace(c, delta=forge(c.delta)))

    return ForgingAdmission


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in CHEATS:
        sys.exit(f"usage: python -m lab.relay_cheats {{{','.join(CHEATS)}}} join --role relay ...")
    relay_node.UpstreamAdmission = cheating_relay(CHEATS[sys.argv.pop(1)])  # type: ignore[misc]  # what run_relay builds
    runpy.run_module("btnode_cli.main", run_name="__main__")


if __name__ == "__main__":
    main()
