"""grpc.health.v1 on real `btnode join` processes: an aggregator and a stage say SERVING once
ready and, on SIGTERM, NOT_SERVING for the --drain-notice while still taking calls, then stop
accepting and exit 0; `btnode doctor --peer` reports the aggregator's health."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from btnode.rpc.client import SwarmClient
from btnode.rpc.stages import stage_info

from procs import TINY_SHAPE, start_stage

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
BTNODE = str(Path(sys.executable).with_name("btnode"))


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def drain(proc: subprocess.Popen, address: str, service: str, still_answers) -> None:
    """SIGTERM `proc` while watching its health: NOT_SERVING arrives while calls are still taken,
    then it exits 0 and nothing listens."""
    with grpc.insecure_channel(address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)
        while next(watch).status != SERVING:  # NOT_SERVING from bind until the role is ready
            pass
        assert check(address) == SERVING
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        watch.cancel()
    assert check(address, service) == NOT_SERVING and check(address) == NOT_SERVING
    still_answers()  # inside the notice the server still accepts calls
    assert proc.wait(timeout=60) == 0
    with pytest.raises(grpc.RpcError) as err:
        check(address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_aggregator_and_stage_report_health_and_drain_on_sigterm(aggregator, tmp_path, processes):
    agg = aggregator("--deadline", "600", "--drain-notice", "4")
    doctor = subprocess.run([BTNODE, "doctor", "--peer", agg.address, *TINY_SHAPE], capture_output=True, text=True,
                            timeout=120)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f'[  OK] health: grpc.health.v1 at {agg.address}: "" SERVING, btnode.v2.Worker SERVING' in doctor.stdout

    proc, address = start_stage(tmp_path, "b2", "--block", "2", "--peer", agg.address, "--drain-notice", "4",
                                *TINY_SHAPE)
    processes.append(proc)
    drain(proc, address, "btnode.v2.Serving", lambda: stage_info(address))

    def status() -> None:
        client = SwarmClient(agg.address, timeout_s=10)
        assert client.status().blocks
        client.close()

    drain(agg.proc, agg.address, "btnode.v2.Worker", status)  # exit 0 after SIGTERM: its handler ran
