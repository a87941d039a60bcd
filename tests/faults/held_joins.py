"""A gRPC proxy process that passes every call on to TARGET as raw bytes, except that it holds the Join
of each WORKER named (writing FOLDER/held-WORKER) until FOLDER/release-WORKER exists: put between a
relay and its parent, it keeps that child's join under way at the relay for as long as a test wants.
Usage: python held_joins.py TARGET PORT_FILE FOLDER WORKER..."""

from __future__ import annotations

import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from btnode.rpc.server import CHANNEL_OPTIONS
from btnode.v2 import swarm_pb2 as pb

target, port_file, folder, held_workers = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), set(sys.argv[4:])
channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
KINDS = {f"/{s.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
         for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
JOIN = f"/{pb.DESCRIPTOR.services_by_name['Worker'].full_name}/Join"


def same(b: bytes) -> bytes:
    return b


def passed_on(fn):  # noqa: ANN001, ANN201 - a handler that answers with the target's status when it fails
    def handler(request, context):  # noqa: ANN001, ANN202
        try:
            return fn(request, context)
        except grpc.RpcError as err:
            context.set_trailing_metadata(err.trailing_metadata() or ())
            context.abort(err.code(), err.details() or "")
    return handler


def passed_on_stream(fn):  # noqa: ANN001, ANN201
    def handler(request, context):  # noqa: ANN001, ANN202
        try:
            yield from fn(request, context)
        except grpc.RpcError as err:
            context.set_trailing_metadata(err.trailing_metadata() or ())
            context.abort(err.code(), err.details() or "")
    return handler


class Forward(grpc.GenericRpcHandler):
    def service(self, details):  # noqa: ANN001, ANN201
        method = details.method
        client_streaming, server_streaming = KINDS.get(method, (False, False))
        kw = {"request_serializer": same, "response_deserializer": same}
        if not client_streaming and not server_streaming:
            call = channel.unary_unary(method, **kw)

            def unary(request: bytes, context) -> bytes:  # noqa: ANN001
                if method == JOIN and (worker := pb.JoinRequest.FromString(request).worker_id) in held_workers:
                    (folder / f"held-{worker}").touch()
                    while not (folder / f"release-{worker}").exists():
                        time.sleep(0.02)
                return call(request, timeout=context.time_remaining())
            return grpc.unary_unary_rpc_method_handler(passed_on(unary), request_deserializer=same,
                                                       response_serializer=same)
        if server_streaming and not client_streaming:
            stream = channel.unary_stream(method, **kw)
            return grpc.unary_stream_rpc_method_handler(passed_on_stream(lambda r, c: stream(r)),
                                                        request_deserializer=same, response_serializer=same)
        if client_streaming and not server_streaming:
            upload = channel.stream_unary(method, **kw)
            return grpc.stream_unary_rpc_method_handler(passed_on(lambda r, c: upload(r)), request_deserializer=same,
                                                        response_serializer=same)
        both = channel.stream_stream(method, **kw)
        return grpc.stream_stream_rpc_method_handler(passed_on_stream(lambda r, c: both(r)), request_deserializer=same,
                                                     response_serializer=same)


server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=CHANNEL_OPTIONS)
server.add_generic_rpc_handlers((Forward(),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
tmp = port_file.with_suffix(".tmp")
tmp.write_text(str(port))
tmp.rename(port_file)
server.wait_for_termination()
