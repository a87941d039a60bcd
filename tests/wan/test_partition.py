"""A worker cut off from the network (its namespace's link taken down) for longer than the deadline:
the rounds close without it, and when the link returns it catches up and its updates count again.
Needs root and network namespaces; elsewhere it skips with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lab.netlab.topology import Star

from procs import TINY_SHAPE, claim_flags, stop_all

REASON = Star.why_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"WAN emulation unavailable here: {REASON}")
CLI = [sys.executable, "-m", "btnode_cli.main"]
STATUS = """
import json, sys
from btnode.rpc.client import SwarmClient
c = SwarmClient(sys.argv[1], timeout_s=10)
print(json.dumps(c.status_dict()))
"""


# --no-identities: the status is read by a script in a namespace. Audits stay on (the default): a worker cut off
# mid-round re-pushes an update refused as stale, which once read as a broken chain and revoked it (fixed in
# Audits.check_chain; tests/unit/test_audit.py)
@pytest.mark.parametrize("cut", ["link-down", "blackhole"])
def test_a_partitioned_worker_is_left_behind_then_catches_up(tmp_path, cut):
    """link-down: the cable is pulled (its end notices, connections fail at once); blackhole: the
    path silently drops everything, so only the round deadline and keepalives can tell."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    training = ["--steps-per-round", "3", "--batch", "4"]  # the workers'
    with Star(3, delay_ms=5, rate_mbit=100) as lab:
        agg = lab.popen(0, [*CLI, "join", "--role", "aggregator", "--listen", "0.0.0.0:7070", "--state-dir",
                            str(tmp_path / "state"), "--deadline", "4", "--port-file", str(tmp_path / "port"),
                            *claim_flags(training), *TINY_SHAPE, "--no-identities"],  # see above
                           env=env, stdout=open(tmp_path / "agg.log", "wb"),
                           stderr=subprocess.STDOUT)
        procs = [agg]
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "port").exists():
                assert time.monotonic() < deadline and agg.poll() is None
                time.sleep(0.1)
            for h in (1, 2):
                procs.append(lab.popen(h, [*CLI, "join", "--role", "worker", "--block", "0", "--peer",
                                           f"{lab.hub_address(h)}:7070", "--worker-id", f"w{h}", *training,
                                           *TINY_SHAPE], env=env,
                                       stdout=open(tmp_path / f"w{h}.log", "wb"), stderr=subprocess.STDOUT))

            def status() -> dict:
                out = subprocess.run(["ip", "netns", "exec", lab.host(1), sys.executable, "-c", STATUS,
                                      f"{lab.hub_address(1)}:7070"], capture_output=True, text=True, timeout=30)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)["blocks"][0]

            def wait_for(pred, what: str, timeout: float = 90) -> dict:
                end = time.monotonic() + timeout
                while time.monotonic() < end:
                    st = status()
                    if pred(st):
                        return st
                    assert all(p.poll() is None for p in procs), "a node exited"
                    time.sleep(0.5)
                raise AssertionError(f"timed out waiting for {what}: {st}")

            wait_for(lambda st: any(r["accepted"] == 2 for r in st["recent"]), "a round with both replicas")
            if cut == "link-down":  # w2 is cut off
                lab.set_link(lab.link_of(2), up=False)
            else:
                lab.set_blackhole(lab.link_of(2), on=True)
            at_cut = status()["version"]
            st = wait_for(lambda st: st["version"] >= at_cut + 3, "three rounds without w2")
            alone = [r for r in st["recent"] if r["version"] > at_cut + 1]
            # closed with w1 alone: by the deadline while w2 is still registered (a silent path), or by
            # w1 reporting once w2's broken Watch stream has deregistered it (a pulled cable)
            assert alone and all(r["accepted"] == 1 for r in alone), alone
            # Not asserted: *how* those rounds closed. With the path blackholed they close by the
            # deadline while w2 is still registered, but in one CI run out of four w2's Watch
            # stream ended (and deregistered it) before the first of them, so every round closed by
            # w1 reporting; closing at the deadline with a silent replica is tested in
            # tests/integration/test_swarm.py and tests/unit/test_block_aggregator.py.
            time.sleep(6)  # cut off for longer than the deadline, several times over
            if cut == "link-down":
                lab.set_link(lab.link_of(2), up=True)
            else:
                lab.set_blackhole(lab.link_of(2), on=False)
            back = status()["version"]
            wait_for(lambda st: any(r["version"] > back and r["accepted"] == 2 for r in st["recent"]),
                     "a round with w2 again after the link returned", timeout=180)
            stop_all(procs[1:])  # the workers first: with the aggregator gone a worker's last pull fails
            assert procs[2].returncode == 0  # w2 came through the cut alive, and drained on SIGTERM
        finally:
            stop_all(procs)
