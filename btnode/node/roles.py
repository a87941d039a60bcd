"""The roles `btnode join --role` runs. A role is one function and the configs it takes, in order;
the CLI derives the role's flags from those configs' declarations (btnode/settings.py), builds each
config from the parsed flags and calls the function, and `btnode swarm` derives a node's argv the
same way. A new role (relay, auditor, HTTP API) is one config class, one function and one line here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from btnode.aggregate.round.config import AggregatorConfig
from btnode.model.config import ModelConfig
from btnode.node.aggregator import AggregatorNodeConfig, join_aggregator
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.relay import RelayNodeConfig, join_relay
from btnode.node.stage import StageConfig, join_stage
from btnode.node.worker import WorkerNodeConfig, join_worker
from btnode.rpc.limits import PeerLimits
from btnode.settings import Section, section, to_flags
from btnode.swarm.worker import WorkerConfig
from btnode.train.config import TrainConfig


@dataclass(frozen=True)
class Role:
    run: Callable[..., None]  # takes one config per section, in order
    sections: tuple[Section, ...]

    def argv(self, name: str, *configs: Any) -> list[str]:
        """`join --role NAME` and the flags that give this role exactly `configs` (one per section)."""
        if [type(c) for c in configs] != [s.cls for s in self.sections]:
            raise TypeError(f"role {name} takes {[s.cls.__name__ for s in self.sections]}")
        return ["join", "--role", name, *(tok for s, c in zip(self.sections, configs) for tok in to_flags(c, omit=s.omit))]


def role(run: Callable[..., None], *sections: Section | type) -> Role:
    return Role(run, tuple(section(s) for s in sections))


ROLES: dict[str, Role] = {
    "aggregator": role(join_aggregator, ModelConfig, AggregatorConfig, PeerLimits, ServeConfig, AggregatorNodeConfig,
                       Section(HostConfig, omit=("device",))),  # its data: audits replay on it, on the CPU
    # a worker's schedule length comes from --rounds × H or --schedule-steps, not --steps
    "worker": role(join_worker, ModelConfig, Section(TrainConfig, omit=("steps",)), WorkerConfig, WorkerNodeConfig,
                   HostConfig),
    # a relay judges its children with the aggregator's settings; versions and deadlines come from its parent
    "relay": role(join_relay, ModelConfig, AggregatorConfig, PeerLimits, ServeConfig, RelayNodeConfig),
    "stage": role(join_stage, StageConfig, ServeConfig,
                  Section(HostConfig, omit=("data", "data_cache", "data_cache_gb"))),  # a stage reads no corpus
}
