"""btnode.node.launch, the one way `btnode swarm`, the tests and the benchmarks start a node: it
returns once a real node listens, reaps a node that fails to start, and stops what it started."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from btnode.errors import BtnodeError, PeerUnavailable
from btnode.node.launch import one_thread_env, start_node, stop_processes
from btnode.rpc.client import SwarmClient

from procs import TINY_SHAPE, operator


def recording(started: list[subprocess.Popen]):
    """A popen that keeps what it starts, to check afterwards that nothing was left running."""
    def popen(*args, **kwargs) -> subprocess.Popen:
        started.append(subprocess.Popen(*args, **kwargs))
        return started[-1]
    return popen


def test_start_node_returns_the_port_a_real_aggregator_listens_on(tmp_path: Path):
    node = start_node(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                       *TINY_SHAPE], port_file=tmp_path / "port", log=tmp_path / "agg.log", env=one_thread_env(),
                      timeout_s=120, name="aggregator")
    try:
        assert node.port == int((tmp_path / "port").read_text()) and node.address() == f"127.0.0.1:{node.port}"
        with socket.create_connection(("127.0.0.1", node.port), timeout=10):
            pass
        client = SwarmClient(node.address(), timeout_s=30, security=operator(tmp_path / "s"))  # identities: the default
        assert client.status().fingerprint  # a btnode aggregator answers on that port
        client.close()
        environ = Path(f"/proc/{node.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in environ  # glibc's thread cache off (node/memory.py)
    finally:
        code = node.stop()
    assert code == 0, (tmp_path / "agg.log").read_text()[-2000:]  # SIGTERM is a graceful drain


def test_a_node_that_exits_before_listening_raises_and_is_reaped(tmp_path: Path):
    started: list[subprocess.Popen] = []
    with pytest.raises(BtnodeError, match="exited with code"):  # d_model 33 is not a multiple of 2 heads
        start_node(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                    "--d-model", "33", "--heads", "2"], port_file=tmp_path / "port", log=tmp_path / "agg.log",
                   popen=recording(started), timeout_s=120, name="aggregator")
    assert len(started) == 1 and started[0].returncode not in (None, 0)


def test_a_node_that_never_listens_times_out_and_is_reaped(tmp_path: Path):
    started: list[subprocess.Popen] = []

    def silent(cmd, **kwargs) -> subprocess.Popen:  # stands in for a node that hangs before binding
        return recording(started)([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)

    with pytest.raises(PeerUnavailable, match="did not start listening"):
        start_node(["join"], port_file=tmp_path / "port", log=tmp_path / "log", popen=silent, timeout_s=1.0)
    assert started[0].returncode == -signal.SIGTERM


def test_stop_processes_returns_exit_codes_in_order():
    done = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    done.wait()
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"  # SIGTERM is ignored from here
    assert stop_processes([done, sleeping, stubborn], timeout_s=1.0) == [3, -signal.SIGTERM, -signal.SIGKILL]
