"""Memory-capped workers (issue #12, item 4) with real processes: each worker in its own cgroup v1
memory group, capped between plan's estimate for a block worker and for a full-replica (--model ar)
worker of the same 4 × 2-layer model at d=512. The full replica is refused with one line before it
builds or connects; block workers under the same cap train through a real aggregator."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig
from btnode.rpc.client import SwarmClient
from btnode.train.plan import ar_memory, block_memory, swarm_worker_peak_bytes

from procs import CLI, claim_flags, cli_fails, stop_all

SHAPE = ["--d-model", "512", "--heads", "8", "--layers", "2", "--blocks", "4", "--context", "128", "--segments", "1,16"]
CFG = ModelConfig(d_model=512, n_heads=8, n_layers=2, n_blocks=4, context=128, segments=(1, 16))
WORKER = ["--rounds", "2", "--steps-per-round", "2", "--batch", "2", "--codec", "int8"]
V1 = Path("/sys/fs/cgroup/memory")


def own_memory_group() -> Path:
    """This process's cgroup v1 memory group: the test's groups go under it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1 / path.lstrip("/")
    return V1


@pytest.fixture
def cgroups():
    """make(name, limit) creates a child memory group with memory.limit_in_bytes; all are removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    if not (V1 / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    made: list[Path] = []

    def make(name: str, limit: int) -> Path:
        group = own_memory_group() / f"btnode-test-{os.getpid()}-{name}"
        group.mkdir()
        made.append(group)
        (group / "memory.limit_in_bytes").write_text(str(limit))
        return group

    yield make
    for group in made:
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # a reaped child may take a moment to leave the group
        group.rmdir()


def start_in(group: Path, args: list[str], log: Path) -> subprocess.Popen:
    """`btnode ARGS` with the process moved into `group` before it execs (so all of it is capped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *CLI, *args],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def usage(group: Path, what: str) -> int:
    return int((group / f"memory.{what}").read_text())


@pytest.mark.slow
def test_a_full_replica_is_refused_under_the_cap_and_block_workers_train_under_it(aggregator, cgroups, tmp_path):
    block = swarm_worker_peak_bytes(block_memory(CFG, 2), Codec.INT8)
    full = swarm_worker_peak_bytes(ar_memory(CFG, 2), Codec.INT8)
    assert full - block > 500e6, (block, full)  # a shape where the full replica clearly needs more
    cap = (block + full) // 2
    agg = aggregator(*SHAPE, "--deadline", "60", *claim_flags(WORKER))

    group = cgroups("ar", cap)
    log = tmp_path / "ar.log"
    t0 = time.monotonic()
    p = start_in(group, ["join", "--role", "worker", "--model", "ar", "--peer", agg.address, "--worker-id", "ar",
                         *WORKER, *SHAPE], log)
    assert p.wait(timeout=120) == 9, log.read_text()
    refused_s = time.monotonic() - t0
    out = log.read_text()
    last = out.strip().splitlines()[-1]
    assert "Traceback" not in out and last.startswith("error: a --model ar worker (the 8-layer AR model) needs ~")
    assert f"this host allows {cap / 1e9:.2f} GB (cgroup memory.limit_in_bytes of /" in last, last
    assert "train one block instead (--model block)" in last
    assert refused_s < 60 and usage(group, "max_usage_in_bytes") < 0.5 * full  # it never built the replica
    # ... nor reached the aggregator (which would have refused its fingerprint: kind 'ar' against 'block')
    c = SwarmClient(agg.address, timeout_s=30)
    assert not [x for x in c.status_dict()["counters"] if x["name"] in ("joins", "join_refused")]
    c.close()

    workers, groups = {}, {}
    for b in (0, 3):
        groups[b] = cgroups(f"block{b}", cap)
        workers[b] = start_in(groups[b], ["join", "--role", "worker", "--block", str(b), "--peer", agg.address,
                                          "--worker-id", f"w{b}", "--stats-file", str(tmp_path / f"w{b}.json"),
                                          *WORKER, *SHAPE], tmp_path / f"w{b}.log")
    try:
        for b, w in workers.items():
            assert w.wait(timeout=300) == 0, (tmp_path / f"w{b}.log").read_text()
    finally:
        stop_all(list(workers.values()))
    for b in workers:  # the same check (on by default, reading the cgroup's limit as above) let them train
        stats = json.loads((tmp_path / f"w{b}.json").read_text())
        # audits are on by default: a new identity's first 2 updates are held on probation until replayed
        assert stats["pushes"] == 2 and stats["outcomes"] == {"probation": 2} and stats["version"] == 2
        assert usage(groups[b], "max_usage_in_bytes") <= cap


def test_memory_limit_refuses_a_full_replica_without_a_cgroup():
    line = cli_fails("join", "--role", "worker", "--model", "ar", "--peer", "127.0.0.1:9", "--memory-limit", "600M",
                     *WORKER, *SHAPE, match="this host allows 0.63 GB (--memory-limit 600M)")
    assert line.startswith("error: a --model ar worker (the 8-layer AR model) needs ~")
    cli_fails("join", "--role", "worker", "--block", "0", "--peer", "127.0.0.1:9", "--memory-limit", "6GB",
              *SHAPE, match="--memory-limit takes a size like 4G")
