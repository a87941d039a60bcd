"""`Recipe`: the arithmetic a worker trains with. Two runs of the same steps from the same state
give bit-identical results on CPU when their recipes are equal (same torch, thread count, device
type and precision): that is what lets an auditor replay an update and compare it byte for byte
(aggregate/trust/audit.py). With different recipes the results differ by rounding, and a replay can only
be compared within a tolerance."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from btnode.errors import MalformedInput


@dataclass(frozen=True)
class Recipe:
    torch: str  # torch.__version__
    threads: int  # torch.get_num_threads(): reductions split differently with another count
    device: str  # the device type: cpu, cuda, mps
    precision: str  # TrainConfig.precision's value
    error_feedback: bool  # whether the update carries the codec's rounding error forward

    @classmethod
    def here(cls, device: torch.device, precision: str, *, error_feedback: bool) -> Recipe:
        return cls(torch=torch.__version__, threads=torch.get_num_threads(), device=device.type, precision=precision,
                   error_feedback=error_feedback)

    def exact_with(self, other: Recipe) -> bool:
        """Whether a replay under `other` must reproduce this recipe's bytes exactly."""
        return (self.torch, self.threads, self.device, self.precision) == (other.torch, other.threads, other.device,
                                                                           other.precision) and self.device == "cpu"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        try:
            d = json.loads(text)
            recipe = cls(**d)
        except (ValueError, TypeError) as exc:
            raise MalformedInput("claim", f"unreadable recipe {text[:80]!r}: {exc}") from None
        if not (isinstance(recipe.torch, str) and isinstance(recipe.threads, int) and recipe.threads > 0
                and isinstance(recipe.device, str) and isinstance(recipe.precision, str)
                and isinstance(recipe.error_feedback, bool)):
            raise MalformedInput("claim", f"malformed recipe {text[:80]!r}")
        return recipe
