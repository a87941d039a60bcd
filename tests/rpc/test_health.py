"""grpc.health.v1 and server reflection on real aggregator and stage servers, seen through the
official clients (grpcio-health-checking's HealthStub, grpcio-reflection's descriptor database):
per-service status, NOT_SERVING on drain while calls are still taken, Check open without the swarm
token while everything else needs it, and `btnode doctor`'s health finding."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.errors import Unauthenticated
from btnode.node.aggregator import run_aggregator
from btnode.node.doctor import SWARM_SERVICE, check_health_of
from btnode.rpc import security
from btnode.rpc.client import SwarmClient
from btnode.rpc.health import NodeHealth, check_health
from btnode.rpc.security import Security
from btnode.rpc.server import serve
from btnode.rpc.stages import serve_stage
from btnode.serve.stages import LocalBlockStage
from btnode.store.models import init_block

from conftest import CFG

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
STAGE_SERVICE = "btnode.v2.Serving"
AGGREGATOR_SERVICES = {"btnode.v2.Worker", "btnode.v2.Relay", "btnode.v2.Verification", "btnode.v2.Operator"}
STANDARD = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


@pytest.fixture
def servers(tmp_path):
    """aggregator(health=, security=) and stage(health=) start real servers; all stop at teardown."""
    made: list[tuple[grpc.Server, threading.Event]] = []

    def aggregator(health: NodeHealth | None = None, security: Security | None = None) -> tuple[str, SwarmAggregator]:
        agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path / f"state{len(made)}")
        server, port, stop = serve(agg, "127.0.0.1:0", health=health, security=security)
        made.append((server, stop))
        return f"127.0.0.1:{port}", agg

    def stage(health: NodeHealth | None = None) -> str:
        block = LocalBlockStage(init_block(CFG, 1, 0), 1, CFG.n_blocks, next=None, device=torch.device("cpu"))
        server, port, stop = serve_stage(block, "127.0.0.1:0", health=health)
        made.append((server, stop))
        return f"127.0.0.1:{port}"

    yield aggregator, stage
    for server, stop in made:
        stop.set()
        server.stop(0).wait()


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def services(ch: grpc.Channel) -> tuple[set[str], descriptor_pool.DescriptorPool]:
    db = ProtoReflectionDescriptorDatabase(ch)
    return set(db.get_services()), descriptor_pool.DescriptorPool(db)


def test_health_is_not_serving_until_ready_then_serving_then_not_serving_from_the_drain(servers):
    aggregator, _ = servers
    health = NodeHealth()
    address, _ = aggregator(health=health)
    assert check(address) == NOT_SERVING and check(address, SWARM_SERVICE) == NOT_SERVING  # bound, not ready
    with grpc.insecure_channel(address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SWARM_SERVICE), timeout=60)
        assert next(watch).status == NOT_SERVING
        health.serving()
        assert next(watch).status == SERVING
        assert check(address) == SERVING and check(address, SWARM_SERVICE) == SERVING
        for other in (STAGE_SERVICE, "no.such.Service"):  # per service: the aggregator carries no Stage
            with pytest.raises(grpc.RpcError) as err:
                check(address, other)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        health.draining()
        assert next(watch).status == NOT_SERVING  # pushed to watchers: Envoy and gRPC clients learn at once
        watch.cancel()
    assert check(address) == NOT_SERVING and check(address, SWARM_SERVICE) == NOT_SERVING
    client = SwarmClient(address, timeout_s=10)
    assert client.status().fingerprint == CFG.fingerprint()  # draining: still taking calls until stop
    client.close()
    health.serving()  # a drain is for good
    assert check(address) == NOT_SERVING


def test_a_stage_reports_its_own_service(servers):
    _, stage = servers
    health = NodeHealth()
    address = stage(health=health)
    assert check(address, STAGE_SERVICE) == NOT_SERVING
    health.serving()
    assert check(address) == SERVING and check(address, STAGE_SERVICE) == SERVING
    assert check_health(address, SWARM_SERVICE) == "UNKNOWN_SERVICE"
    health.draining()
    assert check_health(address, STAGE_SERVICE) == "NOT_SERVING"


def test_library_servers_without_a_health_to_drive_are_serving_at_once(servers):
    aggregator, stage = servers
    address, _ = aggregator()
    assert check(address, SWARM_SERVICE) == SERVING and check(stage(), STAGE_SERVICE) == SERVING


def test_the_aggregator_role_drains_health_first_and_keeps_taking_calls_for_the_notice(tmp_path):
    stop = threading.Event()
    port_file = tmp_path / "port"
    run = threading.Thread(target=run_aggregator, args=(CFG, AggregatorConfig(round=RoundConfig(deadline_s=600))),
                           kwargs=dict(state_dir=tmp_path / "state", listen="127.0.0.1:0", port_file=port_file,
                                       stop=stop, drain_notice_s=3.0))
    run.start()
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert run.is_alive() and time.monotonic() < deadline, "the aggregator did not start listening"
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        with grpc.insecure_channel(address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            while next(watch).status != SERVING:  # NOT_SERVING until the role is ready
                pass
            stop.set()  # what SIGTERM does
            assert next(watch).status == NOT_SERVING
            watch.cancel()
        assert check(address, SWARM_SERVICE) == NOT_SERVING  # within the 3 s notice: still accepting
        client = SwarmClient(address, timeout_s=10)
        assert client.status().fingerprint == CFG.fingerprint()
        client.close()
        run.join(timeout=60)
        assert not run.is_alive()
        with pytest.raises(grpc.RpcError) as err:
            check(address)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # stopped: nothing listens any more
    finally:
        stop.set()
        run.join(timeout=60)


def test_check_needs_no_token_but_watch_reflection_and_btnode_services_do(servers):
    aggregator, _ = servers
    address, agg = aggregator(security=Security(token="correct horse"))
    assert check(address) == SERVING and check(address, SWARM_SERVICE) == SERVING  # what a kubelet sends
    assert check_health(address, SWARM_SERVICE, security=Security()) == "SERVING"
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            next(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            services(ch)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = SwarmClient(address, timeout_s=10, security=Security(token="wrong"))
    with pytest.raises(Unauthenticated):
        client.status()
    client.close()
    with grpc.insecure_channel(address) as ch:  # the open method is peer input like any other
        junk = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            junk(b"\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert check(address) == SERVING
    assert agg.counters[("unauthenticated", "token")] == 3  # Watch, reflection, Status; never the Check
    ch = security.channel(address, [], Security(token="correct horse"))
    try:
        assert next(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                         timeout=10)).status == SERVING
        assert SWARM_SERVICE in services(ch)[0]
    finally:
        ch.close()


def test_reflection_lists_each_servers_services_and_their_methods(servers):
    aggregator, stage = servers
    address, _ = aggregator()
    with grpc.insecure_channel(address) as ch:
        names, pool = services(ch)
        assert SWARM_SERVICE in AGGREGATOR_SERVICES and names == {*AGGREGATOR_SERVICES, *STANDARD}
        methods = {s: {m.name for m in pool.FindServiceByName(s).methods} for s in AGGREGATOR_SERVICES}
        assert methods == {"btnode.v2.Worker": {"Join", "Leave", "Pull", "FetchDelta", "Push", "SubmitState", "Watch",
                                               "RoundReceipt"},
                           "btnode.v2.Relay": {"Draw", "SubmitEvidence"}, "btnode.v2.Operator": {"Status", "Revoke"},
                           "btnode.v2.Verification": {"Duties", "VerifyInputs", "Attest", "SubmitTrace",
                                                      "SubmitDisputeState"}}
        assert pool.FindMessageTypeByName("btnode.v2.PushHeader").fields_by_name["base_version"].number > 0
    with grpc.insecure_channel(stage()) as ch:
        names, pool = services(ch)
        assert names == {STAGE_SERVICE, *STANDARD}
        assert {"Info", "Forward", "ForwardAR", "Generate"} <= {m.name for m in pool.FindServiceByName(STAGE_SERVICE).methods}


def test_doctor_reads_the_peers_health(servers):
    aggregator, stage = servers
    health = NodeHealth()
    address, _ = aggregator(health=health)
    starting = check_health_of(address)
    assert starting.level == "FAIL" and "NOT_SERVING" in starting.detail and "wait until it has started" in starting.fix
    health.serving()
    ok = check_health_of(address)
    assert ok.level == "OK" and f"{SWARM_SERVICE} SERVING" in ok.detail
    wrong = check_health_of(stage())
    assert wrong.level == "FAIL" and "UNKNOWN_SERVICE" in wrong.detail and "not a stage's" in wrong.fix
    assert check_health_of(None).level == "SKIP"
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # a gRPC server without Health
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        old = check_health_of(f"127.0.0.1:{port}")
        assert old.level == "WARN" and "no grpc.health.v1" in old.detail and "upgrade" in old.fix
    finally:
        bare.stop(0).wait()
    gone = check_health_of("127.0.0.1:1")
    assert gone.level == "FAIL" and "check the address" in gone.fix
