"""The WAN emulation itself, then the serving chain across it. These need root, network
namespaces and /dev/net/tun; elsewhere they skip with the reason (CI runs as root and runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from lab.netlab.topology import Chain

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


def test_the_serving_chain_works_across_namespaces_and_matches_the_local_sampler(tmp_path):
    from btnode.serve.driver import generate
    from btnode.serve.request import GenerationRequest
    from btnode.serve.stages import local_chain
    from btnode.store.models import load_blocks

    cli = [sys.executable, "-m", "btnode_cli.main"]
    shape = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32", "--segments", "1,8"]
    ck = tmp_path / "blocks"
    subprocess.run(cli + ["train-local", "--out", str(ck), "--steps", "2", "--batch", "4", "--warmup", "1", *shape],
                   check=True, capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels as the local reference below
    with Chain(4, delay_ms=5, rate_mbit=100) as lab:
        procs = []
        try:
            for pos in (2, 1, 0):
                port_file = tmp_path / f"s{pos}.port"
                nxt = [] if pos == 2 else ["--next", f"{lab.address(pos + 2)}:7000"]
                procs.append(lab.popen(pos + 1, cli + ["join", "--role", "stage", "--block", str(pos), "--checkpoint",
                                                       str(ck), "--listen", "0.0.0.0:7000", "--port-file",
                                                       str(port_file), *nxt], env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))
                for _ in range(600):
                    if port_file.exists():
                        break
                    assert procs[-1].poll() is None
                    time.sleep(0.1)
            probe = ("import sys; from btnode.rpc.stages import generate_remote; "
                     "from btnode.serve.request import GenerationRequest; "
                     "sys.stdout.buffer.write(b''.join(r.new_bytes for r in generate_remote(sys.argv[1], "
                     "GenerationRequest(b'WAN', n_bytes=24, k=8, seed=9))))")
            out = subprocess.run(["ip", "netns", "exec", lab.host(0), sys.executable, "-c", probe,
                                  f"{lab.address(1)}:7000"], capture_output=True, timeout=120, env=env)
            assert out.returncode == 0, out.stderr
        finally:
            for p in procs:
                p.kill()
                p.wait()
    torch.set_num_threads(1)
    cfg, blocks = load_blocks(ck)
    ref = b"".join(r.new_bytes for r in generate(local_chain(blocks, torch.device("cpu")), cfg, 3,
                                                 GenerationRequest(b"WAN", n_bytes=24, k=8, n_steps=7, seed=9,
                                                                   temperature=0.0)))
    assert out.stdout == ref
