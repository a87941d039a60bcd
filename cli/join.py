"""`btnode join --role ROLE` (the daemon) and `btnode swarm` (a local swarm). Both take the flags
the roles' configs declare (btnode/node/roles.py); `join --role ROLE --help` shows only ROLE's."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from btnode.aggregate.round.config import AggregatorConfig
from btnode.model.config import ModelConfig
from btnode.node.aggregator import AggregatorNodeConfig
from btnode.node.roles import ROLES
from btnode.node.settings import HostConfig
from btnode.node.swarm import SwarmConfig
from btnode.settings import Declared, Section, build, section
from btnode.swarm.worker import WorkerConfig
from btnode.train.config import TrainConfig
from btnode_cli.options import takes

Role = Enum("Role", {name: name for name in ROLES}, type=str)  # type: ignore[misc]


def roles_of(param: str) -> list[str]:
    """The roles whose configs take the flag `param`."""
    return [name for name, r in ROLES.items() if any(d.flag.param == param for s in r.sections for d in s.flags())]


def _panel(d: Declared) -> str | None:
    """`join --help` without a role groups the options by the roles that use them."""
    users = roles_of(d.flag.param)
    return None if len(users) == len(ROLES) else f"--role {' | '.join(users)}"


class RoleCommand(TyperCommand):
    """`join`, whose help lists only the options of the --role given (on the command line, in
    BTNODE_JOIN_ROLE or in the file's [join] table). Every role's flags are still parsed, and
    ignored by the roles that do not use them, as before."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta["btnode.role"] = _role_in(args) or os.environ.get(f"{ctx.auto_envvar_prefix}_ROLE") or \
            (ctx.default_map or {}).get("role")
        return super().parse_args(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        ctx.meta["btnode.help"] = True
        try:
            super().format_help(ctx, formatter)
        finally:
            ctx.meta.pop("btnode.help")

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        if not ctx.meta.get("btnode.help"):
            return params
        shown = self.role_params(ctx)
        return [p for p in params if p in shown or p not in self.params]  # --help itself is not in self.params

    def role_params(self, ctx: Any) -> list[Any]:
        """The parameters the role in `ctx` uses (all of them when no role is known); `config show` too."""
        role = ctx.meta.get("btnode.role")
        if role not in ROLES:
            return self.params
        return [p for p in self.params if p.name == "role" or role in roles_of(p.name or "")]


def _role_in(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--role" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--role="):
            return arg.split("=", 1)[1]
    return None


@takes(*(s for r in ROLES.values() for s in r.sections), panel=_panel)
def join(role: Annotated[Role, typer.Option("--role", help="What this node does.")], **flags: Any) -> None:
    """Run a swarm node until stopped (SIGTERM/SIGINT) or, for a worker, until --rounds are done.

    With --model ar the swarm is DiLoCo on the same daemon: each worker trains a full replica of
    the AR model and pushes its delta through the same rounds, codecs and versions; the outer step
    defaults to DiLoCo's Nesterov η = 0.7, μ = 0.9. A stage serves one block of the one-sweep
    chain (or, with --model ar, a slice of an AR model); requests enter at block 0
    (`btnode generate --entry`). `btnode join --role ROLE --help` lists ROLE's options."""
    spec = ROLES[role.value]
    spec.run(*(build(s.cls, flags) for s in spec.sections))


SWARM_SECTIONS = (ModelConfig,  # in the order run_swarm takes the configs
                  Section(AggregatorConfig, only=("deadline", "keep", "outer_lr", "outer_momentum", "check_claims",
                                                  "audit", "probation", "publish_codec", "publish_density", "link",
                                                  "density_warmup_rounds", "density_warmup_factor"),
                          defaults={"deadline": 60.0}, helps={"deadline": "τ in seconds."}),
                  Section(AggregatorNodeConfig, only=("state_dir", "seed", "identities"), defaults={"state_dir": Path("runs/swarm")},
                          helps={"state_dir": "Aggregator state and logs."}),
                  Section(TrainConfig, only=("batch", "lr", "precision")),
                  Section(WorkerConfig, only=("rounds", "steps_per_round", "codec", "density", "density_warmup_rounds",
                                              "density_warmup_factor"), defaults={"rounds": 5},
                          helps={"rounds": "Pushes per worker."}),
                  SwarmConfig,
                  Section(HostConfig, only=("data", "data_cache", "data_cache_gb")))  # the workers' (and audits') data


@takes(*SWARM_SECTIONS)
def swarm(**flags: Any) -> None:
    """Start an aggregator and B × R workers as separate processes on loopback and train for --rounds
    (with --model ar: R workers, each training a full replica of the AR model, DiLoCo)."""
    from btnode.node.swarm import run_swarm

    configs = [build(section(s).cls, flags) for s in SWARM_SECTIONS]
    result = run_swarm(*configs, echo=typer.echo)
    typer.echo(f"done: versions {dict(sorted(result.versions.items()))}; state in {flags['state_dir']}")


def register(app: typer.Typer) -> None:
    app.command("join", cls=RoleCommand)(join)
    app.command("swarm")(swarm)
