"""Emulated hosts joined by emulated WAN links. Each link i between hosts a and b is a router
namespace r_i that joins them with veth pairs, shapes both directions with `tc tbf` at
`rate_mbit`, and sends every packet through a delay line of `delay_ms` (so crossing a link costs
delay_ms one way). Two shapes are built from it:

- `Chain(n)`: h0 — r0 — h1 — r1 — … — h(n−1) (a serving chain: each host talks to the next);
- `Star(n)`: h1 … h(n−1) each linked to the hub h0 (an aggregator and its workers).

    with Chain(4, delay_ms=20, rate_mbit=100) as lab:
        lab.popen(1, ["python", "-m", "http.server"])    # runs inside h1
        lab.address(1)                                    # where h0 reaches h1

    with Star(4, delay_ms=20, rate_mbit=100) as lab:
        lab.hub_address(2)                                # where h2 reaches h0
        lab.set_link(2, up=False)                         # cut h2 off (and `up=True` to restore)

Needs root, iproute2 and /dev/net/tun; `Chain.why_unavailable()` says why not when it cannot run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from lab import lab_env

TABLE = 100  # routing table that sends forwarded traffic into the delay line


def _run(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed: {done.stderr.strip()}")


def _ip(*args: str, ns: str | None = None) -> None:
    _run("ip", *args, ns=ns)


class Lab:
    """Hosts 0..n−1 and links between pairs of them; a host talks only to the hosts it links to."""

    def __init__(self, n_hosts: int, links: Sequence[tuple[int, int]], *, delay_ms: float, rate_mbit: float,
                 prefix: str | None = None):
        if n_hosts < 2 or not links or any(not (0 <= a < n_hosts and 0 <= b < n_hosts and a != b) for a, b in links):
            raise ValueError(f"a lab needs at least two hosts and valid links, got {n_hosts} hosts, links {links}")
        self.n = n_hosts
        self.links = list(links)
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit
        self.prefix = prefix or f"bt{uuid.uuid4().hex[:5]}"
        self.delay_procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    @staticmethod
    def why_unavailable() -> str | None:
        """None if namespaces can be built here, else the reason (for a test skip)."""
        if sys.platform != "linux":
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "network namespaces, veth pairs and TUN devices need root"
        if not shutil.which("ip") or not shutil.which("tc"):
            return "iproute2 (ip, tc) is not installed"
        if not Path("/dev/net/tun").exists():
            return "/dev/net/tun is missing"
        probe = f"btprobe{uuid.uuid4().hex[:4]}"
        try:
            _ip("netns", "add", probe)
            _ip("netns", "del", probe)
        except RuntimeError as exc:
            return f"cannot create a network namespace: {exc}"
        return None

    def host(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def router(self, i: int) -> str:
        return f"{self.prefix}r{i}"

    def _link_addresses(self, i: int) -> tuple[str, str, str, str]:
        """Link i (h_i ↔ h_{i+1}): h_i side, router left, router right, h_{i+1} side (all /30)."""
        a, b = 200 + i // 250, i % 250
        return f"10.{a}.{b}.1", f"10.{a}.{b}.2", f"10.{a}.{b}.5", f"10.{a}.{b}.6"

    def link_address(self, i: int, side: int) -> str:
        """The address of link i's host on `side` (0: the link's first host, 1: its second)."""
        return self._link_addresses(i)[0 if side == 0 else 3]

    def set_link(self, i: int, *, up: bool) -> None:
        """Take link i down (both veth pairs in its router) or bring it back: a cable pulled."""
        for dev in ("lft", "rgt"):
            _ip("link", "set", dev, "up" if up else "down", ns=self.router(i))

    def set_blackhole(self, i: int, *, on: bool) -> None:
        """Silently drop everything crossing link i (both ends stay up, nothing is told): a path
        that just stops delivering, which only timeouts and deadlines can notice."""
        h_left, _, _, h_right = self._link_addresses(i)
        for addr in (h_left, h_right):
            _ip("route", "add" if on else "del", "blackhole", f"{addr}/32", ns=self.router(i))

    def up(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        for i in range(self.n):
            _ip("netns", "add", self.host(i))
            self.created.append(self.host(i))
            _ip("link", "set", "lo", "up", ns=self.host(i))
        for i, (a, b) in enumerate(self.links):
            r, left, right = self.router(i), self.host(a), self.host(b)
            _ip("netns", "add", r)
            self.created.append(r)
            _ip("link", "set", "lo", "up", ns=r)
            h_left, r_left, r_right, h_right = self._link_addresses(i)
            for host, host_if, r_if, host_ip, r_ip in ((left, f"n{i}", "lft", h_left, r_left),
                                                      (right, f"p{i}", "rgt", h_right, r_right)):
                _ip("link", "add", host_if, "netns", host, "type", "veth", "peer", "name", r_if, "netns", r)
                _ip("addr", "add", f"{host_ip}/30", "dev", host_if, ns=host)
                _ip("link", "set", host_if, "up", ns=host)
                _ip("addr", "add", f"{r_ip}/30", "dev", r_if, ns=r)
                _ip("link", "set", r_if, "up", ns=r)
                _run("tc", "qdisc", "add", "dev", r_if, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                    "burst", "64kb", "latency", "400ms", ns=r)
            _ip("route", "add", f"{h_right}/32", "via", r_left, ns=left)
            _ip("route", "add", f"{h_left}/32", "via", r_right, ns=right)
            for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
                _run("sysctl", "-qw", key, ns=r)
            proc = subprocess.Popen(["ip", "netns", "exec", r, sys.executable, "-m", "lab.netlab.delayline",
                                     "--tun", "dl0", "--delay-ms", str(self.delay_ms)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=lab_env())
            self.delay_procs.append(proc)
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"delay line in {r} failed: {proc.stderr.read() if proc.stderr else ''}")
            _ip("link", "set", "dl0", "up", ns=r)
            _run("sysctl", "-qw", "net.ipv4.conf.dl0.rp_filter=0", ns=r)
            _ip("route", "add", "default", "dev", "dl0", "table", str(TABLE), ns=r)
            for dev in ("lft", "rgt"):
                _ip("rule", "add", "iif", dev, "lookup", str(TABLE), ns=r)

    def popen(self, i: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside host i's namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(i), *cmd], **kwargs)

    def down(self) -> None:
        for p in self.delay_procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.delay_procs.clear()
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


class Chain(Lab):
    def __init__(self, n_hosts: int, *, delay_ms: float, rate_mbit: float, prefix: str | None = None):
        super().__init__(n_hosts, [(i, i + 1) for i in range(n_hosts - 1)], delay_ms=delay_ms, rate_mbit=rate_mbit,
                         prefix=prefix)

    def address(self, i: int) -> str:
        """The address of host i (i ≥ 1) that host i − 1 connects to."""
        return self.link_address(i - 1, 1)


class Star(Lab):
    def __init__(self, n_hosts: int, *, delay_ms: float, rate_mbit: float, prefix: str | None = None):
        super().__init__(n_hosts, [(0, i) for i in range(1, n_hosts)], delay_ms=delay_ms, rate_mbit=rate_mbit,
                         prefix=prefix)

    def hub_address(self, i: int) -> str:
        """The address of the hub h0 that host i (i ≥ 1) connects to."""
        return self.link_address(i - 1, 0)

    def link_of(self, i: int) -> int:
        """The link that joins host i (i ≥ 1) to the hub."""
        return i - 1
