"""Which build a node runs: `btnode --version` and the build-info gauge every role's /metrics carries
both say the installed package's version (pyproject.toml), so an operator can tell hosts apart."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from typer.testing import CliRunner

import btnode
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.model.config import ModelConfig
from btnode.node.metrics import AggregatorCollector, ApiCollector, StageCollector, WorkerCollector
from btnode.protocol import Meter

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))


def test_the_package_version_is_the_installed_metadata_and_at_least_0_2_0():
    assert btnode.__version__ == metadata.version("btnode")
    assert tuple(int(p) for p in btnode.__version__.split(".")[:2]) >= (0, 2)


def test_btnode_version_prints_the_version_and_exits_0():
    from btnode_cli import main

    result = CliRunner().invoke(main.app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"btnode {btnode.__version__}"


def scrape(collector: Collector) -> dict[str, dict[str, str]]:
    """The exposition text a Prometheus scrape of this collector gets, parsed back: each
    `btnode_build_info` sample's labels, by role, with its value as the label `value`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == "btnode_build_info":
                found[s.labels["role"]] = {**s.labels, "value": str(s.value)}
    return found


def test_every_role_s_metrics_carry_the_build_info_gauge_with_the_version(tmp_path: Path):
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    collectors = {"aggregator": AggregatorCollector(agg), "relay": AggregatorCollector(agg, role="relay"),
                  "worker": WorkerCollector(0, lambda: None),
                  "stage": StageCollector("block", Meter()), "api": ApiCollector(Meter(), lambda: 0)}
    for role, collector in collectors.items():
        info = scrape(collector)
        assert set(info) == {role}, f"{role}: build info for {set(info)}"
        assert info[role]["version"] == btnode.__version__
        assert info[role]["value"] == "1.0"
