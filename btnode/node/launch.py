"""Starting a `btnode` process and waiting until it listens: the one way `btnode swarm`, the tests
and the benchmarks launch nodes. A node started with `--port-file F` writes its bound port to F once
it serves; `start_node` adds that flag, starts the process and returns once the port is there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from btnode.errors import BtnodeError, PeerUnavailable
from btnode.node.memory import server_env

CLI = [sys.executable, "-m", "btnode_cli.main"]  # the CLI of this interpreter, whatever is on PATH
# How a command line becomes a process: subprocess.Popen here, or a network namespace's popen (netlab).
Popen = Callable[..., subprocess.Popen]


@dataclass
class NodeProcess:
    """A started node: its process, the port it bound and its log file."""

    proc: subprocess.Popen
    port: int
    log: Path

    def address(self, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful drain), then SIGKILL past timeout_s; returns the exit code."""
        return stop_processes([self.proc], timeout_s=timeout_s)[0]


def wait_port(port_file: Path, proc: subprocess.Popen, *, timeout_s: float = 120.0, name: str = "node") -> int:
    """The port `proc` wrote to `port_file`; BtnodeError if it exits first, PeerUnavailable past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            return int(text)
        if proc.poll() is not None:
            raise BtnodeError(f"the {name} exited with code {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise PeerUnavailable(f"the {name} did not start listening within {timeout_s:.0f} s")
        time.sleep(0.05)


def spawn_node(args: Sequence[str], *, log: Path, env: dict[str, str] | None = None,
               popen: Popen = subprocess.Popen) -> subprocess.Popen:
    """`btnode ARGS` as a child process, stdout and stderr appended to `log`; does not wait. An aggregator or
    a relay starts with glibc's thread cache off (node/memory.py `server_env`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child holds its own descriptor
        return popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, env=server_env(args, env))


def start_node(args: Sequence[str], *, port_file: Path, log: Path, env: dict[str, str] | None = None,
               popen: Popen = subprocess.Popen, timeout_s: float = 120.0, name: str = "node") -> NodeProcess:
    """`btnode ARGS --port-file PORT_FILE`, returned once it listens. A node that fails to start is
    reaped before the error is raised, so a caller never leaks one."""
    port_file.parent.mkdir(parents=True, exist_ok=True)
    port_file.unlink(missing_ok=True)
    proc = spawn_node([*args, "--port-file", str(port_file)], log=log, env=env, popen=popen)
    try:
        port = wait_port(port_file, proc, timeout_s=timeout_s, name=name)
    except BaseException:
        stop_processes([proc], timeout_s=5.0)
        raise
    return NodeProcess(proc=proc, port=port, log=log)


def one_thread_env(**extra: str) -> dict[str, str]:
    """This environment with one torch thread per child (several nodes share a few cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def stop_processes(procs: Sequence[subprocess.Popen], *, timeout_s: float = 30.0,
                   sig: int = signal.SIGTERM) -> list[int]:
    """Send `sig` (SIGTERM: a graceful drain) to every process still running, wait for each, SIGKILL
    any that outlasts timeout_s; returns the exit codes in order."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]
