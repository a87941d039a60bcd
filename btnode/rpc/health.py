"""The standard gRPC services on every btnode server: `grpc.health.v1.Health` (what Kubernetes
probes, grpc_health_probe and Envoy ask) and server reflection (what grpcurl and grpc_cli list),
plus the client side of a health check for `btnode doctor`."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from btnode.rpc.security import Security, channel
from btnode.rpc.status import error_from_rpc

HEALTH_SERVICE = health.SERVICE_NAME  # "grpc.health.v1.Health"
REFLECTION_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
UNKNOWN_SERVICE = "UNKNOWN_SERVICE"  # Check's NOT_FOUND: this server does not carry the service asked for
NO_HEALTH = "UNIMPLEMENTED"  # the server has no Health service (a btnode from before it had one)


class NodeHealth:
    """What a node tells probes, the same for the overall service "" and each btnode service it
    carries: NOT_SERVING from bind until `serving()` (the role is ready), SERVING, then NOT_SERVING
    for good from `draining()`, which the node calls before its server stops taking calls."""

    def __init__(self, *, serving: bool = False):
        self._servicer = health.HealthServicer()
        self._lock = threading.Lock()
        self._serving = serving
        self._services: tuple[str, ...] = ("",)
        self._publish()

    def _publish(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._services:
            self._servicer.set(name, status)  # ignored once draining

    def add_to(self, server: grpc.Server, services: Sequence[str]) -> None:
        """Carry Health and reflection on `server`, which serves the btnode `services` (full names)."""
        with self._lock:
            self._services = ("", *services)
            self._publish()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        reflection.enable_server_reflection([*services, HEALTH_SERVICE, REFLECTION_SERVICE], server)

    def serving(self) -> None:
        with self._lock:
            self._serving = True
            self._publish()

    def draining(self, notice_s: float = 0.0) -> None:
        """NOT_SERVING from now on; then wait `notice_s` (still serving every call) so that load
        balancers and probes polling Health see it before the server stops accepting."""
        with self._lock:
            self._serving = False
            self._servicer.enter_graceful_shutdown()
        if notice_s > 0:
            time.sleep(notice_s)


def check_health(address: str, service: str = "", *, timeout_s: float = 10.0,
                 security: Security | None = None) -> str:
    """Ask `address` for the health of `service` ("" = the node as a whole): SERVING, NOT_SERVING,
    UNKNOWN_SERVICE or UNIMPLEMENTED; a peer that does not answer raises its domain error."""
    ch = channel(address, [], security)
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                      timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return UNKNOWN_SERVICE
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            return NO_HEALTH
        raise error_from_rpc(err, f"health check at {address}") from None
    finally:
        ch.close()
