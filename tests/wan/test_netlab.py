"""The WAN emulation itself, then the serving chain across it. These need root, network
namespaces and /dev/net/tun; elsewhere they skip with the reason (CI runs as root and runs them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from btnode.netlab.topology import Chain

REASON = Chain.why_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"WAN emulation unavailable here: {REASON}")

PROBE = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 9000))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(8):
    t = time.perf_counter(); c.sendall(b"!"); c.recv(1); rtts.append(time.perf_counter() - t)
data = b"x" * (16 << 20)
t = time.perf_counter(); c.sendall(data + b"!"); c.recv(1); dt = time.perf_counter() - t
print(statistics.median(rtts), len(data) * 8 / dt / 1e6)
"""
SINK = """
import socket
s = socket.create_server(("0.0.0.0", 9000)); print("up", flush=True)
c, _ = s.accept()
while True:
    d = c.recv(1 << 20)
    if not d: break
    if d.endswith(b"!"): c.sendall(b"k")
"""


def test_a_hop_adds_its_delay_each_way_and_is_rate_limited():
    with Chain(2, delay_ms=20, rate_mbit=100) as lab:
        sink = lab.popen(1, [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "up"
        out = subprocess.run(["ip", "netns", "exec", lab.host(0), sys.executable, "-c", PROBE, lab.address(1)],
                             capture_output=True, text=True, timeout=120)
        sink.kill()
        rtt, mbit = map(float, out.stdout.split())
    assert 0.040 <= rtt < 0.050  # 20 ms each way through the delay line
    assert 60 < mbit <= 101  # tbf at 100 Mbit/s (TCP slow start over a 40 ms RTT costs a little)


def test_namespaces_are_removed_on_exit():
    with Chain(3, delay_ms=1, rate_mbit=100) as lab:
        names = [lab.host(0), lab.router(1)]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
