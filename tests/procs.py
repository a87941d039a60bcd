"""Helpers for tests that run real `btnode` processes or join aggregators by hand (imported by
tests/conftest.py and tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.identities import Role
from btnode.node import launch
from btnode.rpc.enroll import SwarmAuthority, identity_security
from btnode.rpc.security import Security
from btnode.settings import declared
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms

CLI = launch.CLI
TINY_SHAPE = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32",
              "--segments", "1,8"]
BTNODE = str(Path(sys.executable).with_name("btnode"))
TINY_TRAIN = [*TINY_SHAPE, "--batch", "4", "--warmup", "1"]  # the tiny shape with a tiny training step


# the flags of the training settings an aggregator judges claims by (--batch, --lr, --steps-per-round)
CLAIM_FLAGS = tuple(d.flag.name for d in declared(ClaimConfig) if d.path != ("enforce",))


def claim_flags(worker_args: Sequence[str]) -> list[str]:
    """The swarm-wide training flags among a worker's `worker_args`, for its aggregator: it refuses at
    Join a worker that trains with other values (--check-claims, the default)."""
    return [tok for flag, value in zip(worker_args, worker_args[1:]) if flag in CLAIM_FLAGS for tok in (flag, value)]


def honest_terms(claims: ClaimConfig = ClaimConfig()) -> str:
    """The training_json of a worker whose training fits `claims` (a hand-made Join)."""
    tc = TrainConfig(batch=claims.batch, lr=claims.lr, beta1=claims.beta1, beta2=claims.beta2,
                     weight_decay=claims.weight_decay)
    return TrainingTerms(tc, claims.steps_per_round).to_json()


def run_cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`btnode ARGS` to completion; never a traceback, and exit 0 unless ok=False."""
    p = subprocess.run([BTNODE, *args], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def cli_fails(*args: str, match: str) -> str:
    """`btnode ARGS` must end in one `error:` line, a non-zero exit code and `match` in stderr;
    returns that last line."""
    p = run_cli(*args, ok=False)
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode != 0 and last.startswith("error:") and match in p.stderr, p.stderr
    return last


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`btnode ARGS` with one torch thread (and `env`), output appended to `log` (btnode.node.launch)."""
    return launch.spawn_node(args, log=log, env=launch.one_thread_env(**(env or {})))


def identity_env(state_dir: Path, name: str, role: Role = Role.WORKER) -> dict[str, str]:
    """The environment of a node that enrolls as `name` with a code minted now at the aggregator
    whose --state-dir is `state_dir` (identities by default: btnode/rpc/enroll.py), as an operator
    hands a node its code. Its identity is kept beside that folder, in id-NAME."""
    code, _ = SwarmAuthority(state_dir).mint(name=name, role=role, host="127.0.0.1")
    return {"BTNODE_JOIN_CODE": str(code), "BTNODE_IDENTITY": str(state_dir.parent / f"id-{name}")}


def operator(state_dir: Path) -> Security:
    """The settings of the operator identity the aggregator keeping `state_dir` made at its first start."""
    return identity_security(SwarmAuthority(state_dir).operator)


def wait_port(port_file: Path, proc: subprocess.Popen, timeout: float = 60.0) -> int:
    return launch.wait_port(port_file, proc, timeout_s=timeout)


class Aggregator:
    """An aggregator process. `identities` False runs it --no-identities: the tests that drive the
    protocol by hand push under several worker ids from one client, which a swarm with identities
    (the default: one certificate, one id) refuses; tests/integration/test_identities.py and the
    `btnode swarm` tests run the default."""

    def __init__(self, state_dir: Path, extra: list[str], identities: bool = False):
        self.state_dir = state_dir
        self.extra = extra if identities else ["--no-identities", *extra]
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> Aggregator:
        port_file = self.state_dir / "port"
        port_file.unlink(missing_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.proc = start(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir",
                           str(self.state_dir), "--port-file", str(port_file), *TINY_SHAPE, *self.extra],
                          self.state_dir / "aggregator.log")
        self.address = f"127.0.0.1:{wait_port(port_file, self.proc)}"
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


@pytest.fixture
def aggregator(tmp_path):
    """make(*flags, state_dir=None, identities=False) starts an aggregator process; all are killed at teardown."""
    made: list[Aggregator] = []

    def make(*extra: str, state_dir: Path | None = None, identities: bool = False) -> Aggregator:
        agg = Aggregator(state_dir or tmp_path / "agg", list(extra), identities).start()
        made.append(agg)
        return agg

    yield make
    for agg in made:
        if agg.proc is not None and agg.proc.poll() is None:
            agg.proc.kill()
            agg.proc.wait()


def start_stage(workdir: Path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A `btnode join --role stage` process on 127.0.0.1:0; returns it and its address."""
    port_file = workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    proc = start(["join", "--role", "stage", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                  "--worker-id", name, *args], workdir / f"{name}.log")
    return proc, f"127.0.0.1:{wait_port(port_file, proc)}"


@pytest.fixture
def processes():
    """Collects processes to kill at teardown."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for servers that must be told their port up front)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 30.0) -> str:
    """The text of http://127.0.0.1:port/metrics, retrying until the server answers."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stop_all(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    """Signal every process still running, then wait for each, killing any that outlasts `timeout`."""
    launch.stop_processes(procs, timeout_s=timeout, sig=sig)
