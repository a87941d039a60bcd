"""Prometheus metrics from real nodes: `promtool check metrics` on each role's live output, a real
Prometheus server scraping a running local swarm, and the Grafana dashboard's queries checked
against the metric names the nodes export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from procs import TINY_SHAPE, claim_flags, free_port, identity_env, scrape, start, stop_all
from btnode.aggregate.trust.identities import Role

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "btnode.json"
NO_PROMTOOL = "promtool is not installed (Debian package `prometheus`; `make tools` installs it)"


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in exposition text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """An aggregator (auditing), two workers of block 0 and a stage, each with /metrics; yields their ports."""
    d = tmp_path_factory.mktemp("metrics")
    procs = []
    ports = {name: free_port() for name in ("aggregator", "w0", "w1", "stage")}
    training = ["--steps-per-round", "2", "--batch", "4"]  # the workers'
    try:
        port_file = d / "agg.port"
        agg = start(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(d / "state"),
                     "--port-file", str(port_file), "--deadline", "5", "--metrics-listen",
                     f"127.0.0.1:{ports['aggregator']}", *claim_flags(training), "--audit", "1", "--probation", "0", *TINY_SHAPE], d / "aggregator.log")
        procs.append(agg)
        from procs import wait_port

        address = f"127.0.0.1:{wait_port(port_file, agg)}"
        for w in ("w0", "w1"):
            procs.append(start(["join", "--role", "worker", "--block", "0", "--peer", address, "--worker-id", w,
                                *training, "--metrics-listen",
                                f"127.0.0.1:{ports[w]}", *TINY_SHAPE], d / f"{w}.log", env=identity_env(d / "state", w)))
        procs.append(start(["join", "--role", "stage", "--block", "2", "--peer", address, "--listen", "127.0.0.1:0",
                            "--metrics-listen", f"127.0.0.1:{ports['stage']}", *TINY_SHAPE], d / "stage.log",
                           env=identity_env(d / "state", "stage-2", Role.STAGE)))
        deadline = time.monotonic() + 240

        def settled() -> bool:  # both workers have pushed (one can start late on a loaded machine)
            # --audit 1: every update is drawn, answered PROBATION, replayed, then applied
            return (sample(scrape(ports["aggregator"]), "btnode_updates_total", outcome="applied") >= 4
                    and all(sample(scrape(ports[w]), "btnode_worker_pushes_total", block="0", outcome="probation") >= 1
                            for w in ("w0", "w1")))

        while not settled():
            assert time.monotonic() < deadline, (d / "aggregator.log").read_text()
            assert all(p.poll() is None for p in procs), "a node exited early"
            time.sleep(0.5)
        yield ports, d
    finally:
        stop_all(procs)


def test_each_role_exports_its_metrics(swarm):
    ports, _ = swarm
    agg, worker, stage = scrape(ports["aggregator"]), scrape(ports["w0"]), scrape(ports["stage"])
    assert sample(agg, "btnode_block_version", block="0") >= 2
    assert sample(agg, "btnode_rounds_total", block="0", closed_by="all_reported") >= 2
    assert sample(agg, "btnode_transfer_bytes_total", direction="received", form="wire") > 0
    assert sample(agg, "btnode_transfer_bytes_total", direction="received", form="raw") > \
        sample(agg, "btnode_transfer_bytes_total", direction="received", form="wire")  # int8 then zstd
    assert sample(agg, "btnode_rpc_duration_seconds_count", call="push") >= 4
    assert sample(agg, "btnode_build_info", role="aggregator") == 1
    assert {"btnode_audits_total", "btnode_audit_seconds_total", "btnode_audit_detection_delay_seconds_count",
            "btnode_audits_waiting"} <= names(agg)  # audits on (p = 1, no probation: updates count at once)
    assert sample(worker, "btnode_worker_pushes_total", block="0", outcome="probation") >= 1  # --audit 1: all drawn
    assert sample(worker, "btnode_worker_train_seconds_total", block="0") > 0
    assert 0 < sample(worker, "btnode_worker_utilisation_ratio", block="0") <= 1
    assert sample(stage, "btnode_build_info", role="stage") == 1
    assert "btnode_serve_requests_total" in stage


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize("node", ["aggregator", "w0", "stage"])
def test_promtool_accepts_live_output(swarm, node):
    ports, _ = swarm
    done = subprocess.run(["promtool", "check", "metrics"], input=scrape(ports[node]), capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def test_dashboard_queries_name_only_exported_metrics(swarm):
    ports, _ = swarm
    exported = set().union(*(names(scrape(p)) for p in ports.values()))
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len(panels) >= 6
    used = set()
    for panel in panels:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bbtnode_[a-z_]+", target["expr"]))
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("versions", "outcomes", "compression", "loss", "utilisation", "serving latency"):
        assert topic in titles


@pytest.mark.skipif(shutil.which("prometheus") is None, reason=NO_PROMTOOL)
def test_a_real_prometheus_sees_accepted_updates_increase(swarm, tmp_path):
    ports, _ = swarm
    port = free_port()
    targets = [f"127.0.0.1:{p}" for p in ports.values()]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: btnode\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
    check = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)

    def query(q: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                up = query("up")
                if len(up) == len(targets) and all(r["value"][1] == "1" for r in up):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and prom.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(1)
        q = 'sum(increase(btnode_updates_total{job="btnode",outcome="applied"}[20s]))'
        while True:
            result = query(q)
            if result and float(result[0]["value"][1]) > 0:
                break
            assert time.monotonic() < deadline, f"{q} never rose above 0: {result}"
            time.sleep(1)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
