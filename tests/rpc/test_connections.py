"""Hundreds of connections to a real aggregator process (issue #25): 160 version streams held from
one client host (one connection), with room for 150 of them (--max-workers 150), while 8 workers
join, pull and push. The 10 streams over the budget are refused as ours (Overloaded, counted in
status and metrics), every push is accepted, the round closes, every held stream hears
the new version, and systemd's keep-alives (a real NOTIFY_SOCKET) never gap. Before #25 the
server capped all calls at 60 and at 64 streams not one push was taken."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import Overloaded
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.client import Retry, SwarmClient
from btnode.store.models import init_block
from btnode.train.config import TrainConfig

from procs import CLI, TINY_SHAPE, honest_terms, scrape, free_port, wait_port

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))  # TINY_SHAPE
STREAMS, BUDGET, PUSHERS = 160, 150, 8


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class KeepAlives:
    """systemd's side of the watchdog: the times WATCHDOG=1 arrived on a datagram socket."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.stamps: list[float] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                fields = self.sock.recv(4096).decode().split("\n")
            except TimeoutError:
                continue
            if "READY=1" in fields:
                self.ready.set()
            if "WATCHDOG=1" in fields:
                self.stamps.append(time.monotonic())

    def max_gap(self) -> float:
        return max(b - a for a, b in zip(self.stamps, self.stamps[1:]))


@pytest.fixture
def crowded(tmp_path):
    port_file, metrics = tmp_path / "port", free_port()
    alive = KeepAlives(tmp_path / "notify.sock")
    env = dict(os.environ, OMP_NUM_THREADS="1", NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="1000000")
    proc = subprocess.Popen([*CLI, "join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--port-file",
                             str(port_file), "--state-dir", str(tmp_path / "s"), "--deadline", "4", "--max-workers",
                             str(BUDGET), "--metrics-listen", f"127.0.0.1:{metrics}", *TINY_SHAPE,
                             "--no-identities", "--max-joins-per-minute", "1000", "--audit", "0"],  # 160 worker ids from one test process: ids as claims
                            env=env, stdout=open(tmp_path / "agg.log", "wb"), stderr=subprocess.STDOUT)
    try:
        yield proc, f"127.0.0.1:{wait_port(port_file, proc)}", metrics, alive, tmp_path / "agg.log"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        alive.done.set()


def push_once(address: str, worker: str, spec: dict, results: dict) -> None:
    c = SwarmClient(address, timeout_s=20)
    try:
        c.join(worker, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms())
        base = c.pull(0, worker, spec)
        header = PushHeader(worker_id=worker, block=0, base_version=base.info.version, samples=float(TrainConfig.batch),
                            loss=1.0, codec=Codec.INT8, update_id=f"{worker}-u", steps=(0,))
        frames = encode_frames({n: 1e-3 * torch.ones(s) for n, s in spec.items()}, Codec.INT8)
        results[worker] = c.push(header, frames).outcome
    except Exception as exc:  # noqa: BLE001 - reported by the test
        results[worker] = exc
    finally:
        c.close()


def test_160_held_version_streams_starve_no_push(crowded):
    proc, address, metrics, alive, _ = crowded
    assert alive.ready.wait(30)
    spec = {n: tuple(t.shape) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    watcher = SwarmClient(address, timeout_s=20, retry=Retry(budget_s=0))  # one host, one connection
    try:
        idle = rss_mb(proc.pid)
        streams, refused = [], []
        for i in range(STREAMS):  # a stream is a replica's: its id joins the block first
            watcher.join(f"idle-{i}", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms())
            s = watcher.watch(0, f"idle-{i}")
            try:
                assert next(s).version == 0
                streams.append(s)
            except Overloaded as exc:
                refused.append(exc.reason)
        held = rss_mb(proc.pid)
        print(f"aggregator RSS: {idle:.0f} MB idle, {held:.0f} MB with {len(streams)} version streams "
              f"({1024 * (held - idle) / len(streams):.0f} KB a stream)")
        assert len(streams) == BUDGET and refused == ["watch_budget"] * (STREAMS - BUDGET)

        results: dict = {}
        pushers = [threading.Thread(target=push_once, args=(address, f"w{i}", spec, results)) for i in range(PUSHERS)]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join(timeout=60)
        assert results == {f"w{i}": Outcome.PENDING for i in range(PUSHERS)}
        # the round closes at its deadline (4 s; the idle streams never push) and every held stream hears it
        assert [next(s).version for s in streams] == [1] * BUDGET

        counters = {(c["name"], c["labels"].get("reason", "")): c["value"] for c in watcher.status_dict()["counters"]}
        limited = {k: v for k, v in counters.items() if k[0] == "limited"}
        assert limited == {("limited", "watch_budget"): STREAMS - BUDGET}
        text = scrape(metrics)
        assert f'btnode_swarm_events_total{{event="limited",reason="watch_budget"}} {STREAMS - BUDGET}' in text \
            or f'reason="watch_budget"}} {float(STREAMS - BUDGET)}' in text, \
            [ln for ln in text.splitlines() if "watch_budget" in ln]
        assert len(alive.stamps) >= 5 and alive.max_gap() < 2.0, alive.stamps  # WatchdogSec 1 s: one every 0.5 s
    finally:
        watcher.close()
