"""Each setting declared once (btnode/settings.py): the flags a role's --help shows are exactly its
configs' declarations, and the argv `btnode swarm` derives for its nodes parses back to the same
configs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.sums.averaging import DILOCO_OUTER, OuterConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig
from btnode.node.aggregator import AggregatorNodeConfig
from btnode.node.roles import ROLES
from btnode.node.settings import HostConfig, ServeConfig
from btnode.node.worker import WorkerNodeConfig
from btnode.rpc.limits import PeerLimits
from btnode.settings import build, declared, flag
from btnode.swarm.worker import WorkerConfig
from btnode.train.config import Precision, TrainConfig
from btnode_cli import main
from btnode_cli.options import options


@pytest.fixture(scope="module")
def cli():
    if not main.app.registered_commands:
        main._register()
    return main.app


def shown(cli, *args: str) -> set[str]:
    out = CliRunner().invoke(cli, [*args, "--help"], env={"COLUMNS": "400"}, catch_exceptions=False).output
    rows = re.findall(r"^│\s*\*?\s*(--[a-z0-9-]+)(?: +(--[a-z0-9-]+))?", out, re.MULTILINE)  # the option column
    return {name for row in rows for name in row if name}


def role_flags(name: str) -> set[str]:
    return {n for s in ROLES[name].sections for d in s.flags() for n in d.flag.names.split("/")}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_roles_help_shows_its_flags_and_no_other_roles(cli, role):
    everyone = set().union(*(role_flags(r) for r in ROLES))
    for args in (("join", "--role", role), ("join", f"--role={role}")):
        flags = shown(cli, *args) & everyone
        assert flags == role_flags(role)
    assert shown(cli, "join") >= everyone  # without a role: all of them, grouped by role


def test_a_flag_declared_twice_is_refused():
    @dataclass(frozen=True)
    class Other:
        batch: int = flag("--batch", "Another --batch.", default=1)

    with pytest.raises(TypeError, match="--batch is declared twice"):
        options(TrainConfig, Other)


def test_swarm_wide_flags_are_the_model_shape():
    from btnode_cli.config import SWARM_WIDE

    assert set(SWARM_WIDE) == {"d_model", "heads", "layers", "blocks", "context", "segments", "target_seed",
                               "tail_blocks", "sigma_gen", "model", "ar_layers", "ada_rank", "ctx_head"}
    assert not [d for cls in (TrainConfig, WorkerConfig, AggregatorConfig) for d in declared(cls) if d.flag.swarm_wide]


def parse_join(cli, argv: list[str]) -> dict:
    assert argv[:2] == ["join", "--role"]
    group = typer.main.get_command(cli)
    return group.get_command(typer.Context(group), "join").make_context("join", argv[1:]).params


@pytest.mark.parametrize("model", [ModelConfig(d_model=64, n_heads=2, n_layers=1, n_blocks=4, context=64, segments=(1, 8),
                                               tail_blocks=1, sigma_gen=0.2, ada_rank=8),
                                   ModelConfig(kind="ar", ar_layers=6)])
def test_the_argv_swarm_derives_builds_the_same_configs_back(cli, model, tmp_path):
    outer = DILOCO_OUTER if model.kind == "ar" else OuterConfig(lr=0.5, robust="median")
    configs = {
        "aggregator": (model, AggregatorConfig(round=RoundConfig(deadline_s=7.5, min_updates=2, max_staleness=1),
                                               outer=outer, publish_codec=Codec.BF16, keep=5,
                                               audit=AuditConfig(share=0.25, probation=3, state_timeout_s=30.0)),
                       PeerLimits(max_streams=3), ServeConfig(listen="127.0.0.1:0", port_file=tmp_path / "p"),
                       AggregatorNodeConfig(state_dir=tmp_path, blocks=(0, 2), seed=3),
                       HostConfig(data="corpus.txt", data_cache=tmp_path / "cache", data_cache_gb=2.0)),
        "worker": (model, TrainConfig(batch=4, lr=1e-3, warmup=7, seed=3, k1_share=0.5, precision=Precision.BF16),
                   WorkerConfig(worker_id="b1r0", block=0, steps_per_round=9, codec=Codec.FP32, error_feedback=False,
                                rounds=4, train_while_waiting=False, schedule_by_version=False),
                   WorkerNodeConfig(peer="127.0.0.1:1", stats_file=tmp_path / "s.json", memory_check=False),
                   HostConfig(device="cpu", data="corpus.txt", data_cache=tmp_path / "cache", data_cache_gb=3.5)),
    }
    for name, given in configs.items():
        role = ROLES[name]
        values = parse_join(cli, role.argv(name, *given))
        assert values["role"].value == name
        assert tuple(build(s.cls, values) for s in role.sections) == given


def test_a_worker_config_with_a_setting_no_flag_carries_is_refused():
    from btnode.errors import ConfigError

    with pytest.raises(ConfigError, match="steps"):
        ROLES["worker"].argv("worker", ModelConfig(), TrainConfig(steps=5), WorkerConfig(worker_id="w", block=0),
                             WorkerNodeConfig(), HostConfig())


def test_btnode_swarm_hands_run_swarm_its_configs_in_order(cli):
    import inspect
    import typing

    from btnode.node.swarm import run_swarm
    from btnode.settings import section
    from btnode_cli.join import SWARM_SECTIONS

    hints = typing.get_type_hints(run_swarm)
    takes = [hints[p] for p in list(inspect.signature(run_swarm).parameters)[:len(SWARM_SECTIONS)]]
    assert takes == [section(s).cls for s in SWARM_SECTIONS]


def test_btnode_api_is_found_behind_the_root_options():
    """`btnode api` registers only itself (it must not import torch): the command word is found past
    the root's options and their values."""
    from btnode_cli.main import command_word

    assert command_word(["api", "--entry", "x"]) == "api"
    assert command_word(["-v", "--config", "api", "--log-format", "json", "api"]) == "api"
    assert command_word(["--token-file", "f", "serve", "--checkpoint", "api"]) == "serve"
    assert command_word(["--verbose"]) is None
