"""Simulated workers for bench/scale.py: hundreds of them in one process, each on its own gRPC
channel (its own connection) in one asyncio loop, speaking the real Swarm protocol with no training.

A simulated worker does what `swarm.worker.BlockWorker` does on the wire: Join with the run
fingerprint and training terms, Pull the block in full, hold a Watch stream, and per round Push an
update for the version it holds, wait for the next version on its stream and FetchDelta it (Pull and
FetchDelta ask for bundles, as rpc/client.py does: the root sends every fetcher the same file; an older
reader's frames are encoded per stream, a copy of each tensor per fetch, which is what flat rows before
issue #40 measured). The
update is real: int8 frames of the block's shape, encoded once per process (a few variants, the
same common direction plus a little noise each, so that the screen keeps them all), each
coordinate within the bound the aggregator's claims check derives from --lr and H
(aggregate/trust/claims.py), with steps and samples that satisfy its weight rule. A refused call
(RESOURCE_EXHAUSTED, UNAVAILABLE) is counted and retried with backoff, as issue #25 asks of the
client. Every event is one JSON line, flushed as it happens, so a process killed mid-run leaves
what it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch
import zstandard

from btnode.codec.codecs import Codec
from btnode.codec.frames import ZSTD_LEVEL, encode_raw, frame_from_raw, iter_chunks
from btnode.model.config import ModelConfig
from btnode.protocol import EMPTY_STATE, PushHeader, VersionInfo, WorkClaim
from btnode.rpc import convert
from btnode.rpc.server import CHANNEL_OPTIONS
from btnode.rpc.status import REASON_KEY
from btnode.store.models import init_unit
from btnode.train.config import TrainConfig
from btnode.train.recipe import Recipe
from btnode.train.terms import TrainingTerms
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

VARIANTS = 4  # distinct updates per process
SPARES = 2  # upstreams after its first that a worker moves to in turn (a kill run kills a quarter of the relays:
#   with one spare, a worker whose relay and spare both die has nowhere to go, and waits to the end)
# refusals for now, retried; CANCELLED too: under load a connection whose keep-alive ping goes unanswered
# is closed by gRPC and the calls on it end CANCELLED (seen at N = 1,024 on this shared host)
# ABORTED: a call whose join there is still under way (btnode's JoinPending), refused for now
RETRIED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.ABORTED)
BLOCK = 0


def reason(err: grpc.aio.AioRpcError) -> str:
    """The refusal's reason label (btnode's trailing metadata), if any."""
    return next((v for k, v in (err.trailing_metadata() or ()) if k == REASON_KEY), "")


def refused(err: grpc.aio.AioRpcError) -> bool:
    """A refusal for now, to retry: RESOURCE_EXHAUSTED or UNAVAILABLE, or the INTERNAL "Internal error
    from Core" that grpc.aio reports when the server answers a client stream's refusal while the client
    is still writing (grpc/grpc#36066; the sync client btnode's workers use sees the server's status)."""
    return err.code() in RETRIED or (err.code() == grpc.StatusCode.INTERNAL and "error from Core" in (err.details() or ""))


class Log:
    """Events as JSON lines, flushed at once (a SIGKILL loses nothing already written)."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, kind: str, **fields: object) -> None:
        self.f.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")


def updates(cfg: ModelConfig, *, lr: float, h: int, seed: int) -> tuple[dict[str, tuple[int, ...]], list[list[pb.PushRequest]]]:
    """The block's spec and VARIANTS pre-encoded int8 updates as chunk messages. Each coordinate moves at
    most 0.3 · H · lr, under the claims bound's Adam part alone (≥ 1.0 · H · lr for any θ)."""
    params = init_unit(cfg, BLOCK, 0).state_dict()
    spec = {n: tuple(t.shape) for n, t in params.items()}
    g = torch.Generator().manual_seed(0)  # one common direction for every process (the screen keeps them all)
    common = {n: torch.rand(t.shape, generator=g) * 2 - 1 for n, t in params.items()}
    g.manual_seed(1 + seed)  # the noise differs per process and variant
    out = []
    for _ in range(VARIANTS):
        delta = {n: (0.8 * c + 0.2 * (torch.rand(c.shape, generator=g) * 2 - 1)) * (0.3 * h * lr)
                 for n, c in common.items()}
        raw = encode_raw(delta, Codec.INT8)
        zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        frames = [frame_from_raw(n, spec[n], Codec.INT8, raw[n], zc) for n in spec]
        out.append([pb.PushRequest(chunk=convert.chunk_to_pb(c)) for c in iter_chunks(frames)])
    return spec, out


class SimWorker:
    """One simulated worker. `peers`: its upstream, then spares (relays): when the one it talks to stops
    answering (UNAVAILABLE twice, or its version stream breaks), it moves to the next, joins there and
    only then pushes its round's update again (the same update id), as a real worker's failover link
    does; with `race`, it pushes again while its join there is still under way (the order of clients
    before issue #40), so that the spare's JoinPending is what keeps the update. A push refused
    `not_joined` joins again and is pushed once more (as FailoverLink)."""

    def __init__(self, name: str, peers: list[str], cfg: ModelConfig, terms: TrainingTerms,
                 update: list[pb.PushRequest], log: Log, *, rounds: int, wait_s: float, recipe: str, data_id: str = "",
                 go: asyncio.Event, logged: set[int], options: list[tuple[str, object]] = CHANNEL_OPTIONS,
                 race: bool = False):
        """`options`: its channels' arguments. Channels with equal arguments to one address share one TCP
        connection (gRPC's global subchannel pool): the workers of one process here share one unless
        `options` differ (bench/conn_memory.py gives each its own with grpc.use_local_subchannel_pool)."""
        self.name, self.peers, self.cfg, self.terms = name, peers, cfg, terms
        self.update, self.log, self.rounds, self.wait_s, self.recipe = update, log, rounds, wait_s, recipe
        self.data_id = data_id  # stated at Join and in each claim (a root with --audit requires its own)
        self.at, self.generation = 0, 0  # which peer, and how many moves so far
        self.options, self.race = options, race
        self.channel = grpc.aio.insecure_channel(peers[0], options=options)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.info: VersionInfo | None = None
        self.newest: VersionInfo | None = None
        self.arrived = asyncio.Event()
        self.go = go  # set once every simulated worker has joined (the bench's barrier)
        self.logged = logged  # versions whose included update ids this process has logged (once each)
        self.key = ""
        self._moving = asyncio.Lock()
        self._old: list[grpc.aio.Channel] = []  # channels of peers left behind

    async def move(self, seen: int) -> None:
        """Move to the next peer (once per failure: a caller that saw generation `seen` and finds it
        changed does nothing) and join there."""
        async with self._moving:
            if self.generation != seen or len(self.peers) < 2:
                return
            for _ in range(len(self.peers) - 1):  # a spare that is gone too: on to the next, as FailoverLink does
                at = (self.at + 1) % len(self.peers)
                channel = grpc.aio.insecure_channel(self.peers[at], options=self.options)
                stub = pb_grpc.WorkerStub(channel)
                self.log("moved", worker=self.name, to=self.peers[at])
                if self.race:  # connected first, so that the join is sent before the re-push, not with it
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(channel.channel_ready(), 5.0)
                joining = asyncio.create_task(self.retried("join", lambda: self._join(stub), failover=False,
                                                           unavailable_limit=2))
                if self.race:  # the re-push goes now, racing the join (the round loop sees the new generation)
                    await asyncio.sleep(0.005)  # the join sent first, the re-push right behind it
                    self._switch(at, channel, stub)
                    self.arrived.set()
                try:
                    await joining
                    break
                except grpc.aio.AioRpcError as err:
                    if self.race:
                        self.log("error", worker=self.name, call="join", code=err.code().name, reason=err.details())
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                finally:
                    if not self.race:
                        self._switch(at, channel, stub)  # the calls go there once it has joined (or given up)
            self.arrived.set()  # wake the round loop: it re-pushes to the new peer

    def _switch(self, at: int, channel: grpc.aio.Channel, stub: pb_grpc.WorkerStub) -> None:
        self._old.append(self.channel)  # closed at the end: closing it now would cancel calls awaiting it
        self.at, self.channel, self.stub = at, channel, stub
        self.generation += 1

    async def retried(self, what: str, make, *, failover: bool = True,  # noqa: ANN001 - a coroutine factory
                      unavailable_limit: int = 0):
        """await make(), retrying refusals with backoff (0.2 s doubling to 5 s) for up to wait_s; with
        spares, a second UNAVAILABLE in a row moves to the next peer first. `unavailable_limit`: raise
        after that many UNAVAILABLE in a row (0: no limit)."""
        start, attempt, unavailable = time.monotonic(), 0, 0
        while True:
            gen = self.generation
            try:
                return await make()
            except grpc.aio.AioRpcError as err:
                if not refused(err) or time.monotonic() - start > self.wait_s:
                    raise
                self.log("refused", worker=self.name, call=what, code=err.code().name, reason=reason(err))
                unavailable = unavailable + 1 if err.code() == grpc.StatusCode.UNAVAILABLE else 0
                if unavailable_limit and unavailable >= unavailable_limit:
                    raise
                if failover and unavailable >= 2 and len(self.peers) > 1:
                    await self.move(gen)
                    unavailable = 0
                    continue
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt) * (0.5 + random.random()))
                attempt += 1

    async def _stream_bytes(self, call) -> tuple[VersionInfo, int]:  # noqa: ANN001
        """Read a tensor stream to its end: its version info and the payload bytes it carried."""
        info, wire = None, 0
        async for msg in call:
            if msg.WhichOneof("kind") == "info":
                info = convert.info_from_pb(msg.info)
            else:
                wire += len(msg.chunk.data)
        assert info is not None, "a tensor stream without its version info"
        return info, wire

    async def watch(self) -> None:
        """Hold the version stream (reconnecting after a refusal or a break, moving on when its peer is
        gone) and note each new version."""
        while True:
            gen = self.generation
            call = self.stub.Watch(pb.WatchRequest(block=BLOCK, worker_id=self.name))
            try:
                async for msg in call:
                    self._announced(convert.info_from_pb(msg.version))
                code = "ended"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                if gen != self.generation:  # our own move closed its channel: watch the new peer at once
                    continue
                self.log("refused" if err.code() in RETRIED else "error", worker=self.name, call="watch", code=code)
            try:
                if code in ("UNAVAILABLE", "ended") and len(self.peers) > 1:
                    await self.move(gen)
                    continue
            except grpc.aio.AioRpcError as err:  # the spare refused the join: try again (or the next one)
                self.log("error", worker=self.name, call="move", code=err.code().name, reason=err.details())
            await asyncio.sleep(0.5 + random.random())

    def _announced(self, info: VersionInfo) -> None:
        if self.newest is not None and info.version <= self.newest.version:
            return
        self.newest = info
        included = getattr(info, "included", None)  # the update ids in it, where the code says
        first = info.version not in self.logged
        self.logged.add(info.version)
        self.log("version", worker=self.name, version=info.version, accepted=info.accepted, rejected=info.rejected,
                 closed_by=info.closed_by, **({"included": list(included)} if first and included is not None else {}))
        self.arrived.set()

    def _messages(self, header: PushHeader) -> AsyncIterator[pb.PushRequest]:
        async def gen() -> AsyncIterator[pb.PushRequest]:
            yield pb.PushRequest(header=convert.push_header_to_pb(header))
            for m in self.update:
                yield m
        return gen()

    def _header(self, v: VersionInfo) -> PushHeader:
        h = self.terms.steps_per_round
        return PushHeader(worker_id=self.name, block=BLOCK, base_version=v.version,
                          samples=float(h * self.terms.train.batch), loss=1.0, codec=Codec.INT8,
                          update_id=uuid.uuid4().hex, data_key=self.key,
                          steps=tuple(range(v.version * h, (v.version + 1) * h)),
                          claim=WorkClaim(base_sha256=v.sha256, data_id=self.data_id, recipe=self.recipe,
                                          optimizer_start=EMPTY_STATE, optimizer_end=EMPTY_STATE,
                                          residual_start=EMPTY_STATE, residual_end=EMPTY_STATE))

    async def _push(self, header: PushHeader) -> None:
        t0 = time.time()
        self.log("push_start", worker=self.name, version=header.base_version)
        try:
            try:
                reply = await self.retried("push", lambda: self.stub.Push(self._messages(header)))
            except grpc.aio.AioRpcError as err:
                if reason(err) != "not_joined":
                    raise
                self.log("rejoined", worker=self.name, version=header.base_version, peer=self.peers[self.at])
                await self.retried("join", self._join)  # the peer has no join of ours: join, push once more
                reply = await self.retried("push", lambda: self.stub.Push(self._messages(header)))
        except grpc.aio.AioRpcError as err:
            self.log("push", worker=self.name, version=header.base_version, outcome="error", code=err.code().name,
                     reason=err.details(), start=t0, update_id=header.update_id)
            return
        j = convert.judgement_from_pb(reply)
        self.log("push", worker=self.name, version=header.base_version, outcome=j.outcome.value, reason=j.reason,
                 start=t0, update_id=header.update_id, peer=self.peers[self.at])

    async def _join(self, stub: pb_grpc.WorkerStub | None = None) -> None:
        reply = await (stub or self.stub).Join(pb.JoinRequest(
            worker_id=self.name, block=BLOCK, fingerprint=self.cfg.fingerprint(),
            config=convert.model_to_pb(self.cfg), training=convert.training_to_pb(self.terms), data_id=self.data_id))
        self.key = convert.join_from_pb(reply).data_key

    async def run(self) -> None:
        try:
            await self.retried("join", self._join)
            self.info, wire = await self.retried("pull", lambda: self._stream_bytes(
                self.stub.Pull(pb.PullRequest(block=BLOCK, worker_id=self.name, bundles=True))))
            self.log("joined", worker=self.name, version=self.info.version, pulled=wire)
        except grpc.aio.AioRpcError as err:
            self.log("error", worker=self.name, call="join", code=err.code().name, reason=err.details())
            return
        watcher = asyncio.create_task(self.watch())
        try:
            await self.go.wait()
            await self._rounds()
        finally:
            watcher.cancel()
            for ch in [*self._old, self.channel]:
                await ch.close()

    async def _rounds(self) -> None:
        for _ in range(self.rounds):
            v = self.info
            assert v is not None
            header = self._header(v)
            gen = self.generation
            await self._push(header)
            deadline = time.monotonic() + self.wait_s
            while self.newest is None or self.newest.version <= v.version:
                if self.generation != gen:  # moved to a spare while waiting: the update goes again, same id
                    gen = self.generation
                    await self._push(header)
                if time.monotonic() > deadline:
                    self.log("error", worker=self.name, call="wait", reason=f"no version after {v.version}")
                    return
                self.arrived.clear()
                try:  # woken by a version or a move; a second at most, so that no wake-up is missed
                    await asyncio.wait_for(self.arrived.wait(), 1.0)
                except TimeoutError:
                    pass
            target = self.newest
            try:
                if target.base_version == v.version:
                    got, wire = await self.retried("fetch_delta", lambda: self._stream_bytes(
                        self.stub.FetchDelta(pb.FetchDeltaRequest(block=BLOCK, version=target.version, bundles=True))))
                else:  # behind: a full pull, as a real worker does
                    got, wire = await self.retried("pull", lambda: self._stream_bytes(
                        self.stub.Pull(pb.PullRequest(block=BLOCK, worker_id=self.name, bundles=True))))
            except grpc.aio.AioRpcError as err:
                self.log("error", worker=self.name, call="fetch", code=err.code().name, reason=err.details())
                return
            self.log("fetched", worker=self.name, version=got.version, wire=wire)
            self.info = got


async def swarm(args: argparse.Namespace) -> None:
    cfg = ModelConfig.from_dict(json.loads(args.config))
    tc = TrainConfig(batch=args.batch, lr=args.lr)
    terms = TrainingTerms(tc, args.h)
    _, variants = updates(cfg, lr=args.lr, h=args.h, seed=args.first)
    recipe = Recipe.here(torch.device("cpu"), tc.precision.value, error_feedback=True).to_json()
    log = Log(args.events)
    names = [f"{args.prefix}{i:04d}" for i in range(args.first, args.first + args.count)]
    peers = args.peer.split(",")
    go, logged = asyncio.Event(), set()
    k = len(peers)  # worker j talks to peer j mod k, with the next SPARES as its spares
    workers = [SimWorker(n, [peers[(j + s) % k] for s in range(min(k, SPARES + 1))], cfg, terms, variants[j % VARIANTS],
                         log, rounds=args.rounds, wait_s=args.wait, recipe=recipe, data_id=args.data_id, go=go,
                         logged=logged, race=args.race)
               for j, n in enumerate(names, start=args.first)]
    log("started", count=len(workers), pid=os.getpid())
    runs = [asyncio.create_task(w.run()) for w in workers]
    while sum(w.info is not None for w in workers) + sum(t.done() for t in runs) < len(workers):
        await asyncio.sleep(0.1)
    log("ready", joined=sum(w.info is not None for w in workers), pid=os.getpid())
    args.ready.touch()
    while not args.go.exists():
        await asyncio.sleep(0.05)
    go.set()
    await asyncio.gather(*runs)
    log("done", pid=os.getpid())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", required=True, help="ADDRESS[,ADDRESS...]: worker j talks to the (j mod k)-th, with "
                                                  f"the next {SPARES} as its spares")
    ap.add_argument("--config", required=True, help="ModelConfig as JSON")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--prefix", default="sim")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--h", type=int, required=True)
    ap.add_argument("--wait", type=float, default=300.0, help="seconds to wait for a version or through refusals")
    ap.add_argument("--events", type=Path, required=True)
    ap.add_argument("--ready", type=Path, required=True, help="touched once every worker here has joined and pulled")
    ap.add_argument("--go", type=Path, required=True, help="the rounds start once this file exists")
    ap.add_argument("--data-id", default="", help="the data id the workers state (a root with --audit requires its own)")
    ap.add_argument("--race", action="store_true", help="after a move, push again while the join there is under way")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    asyncio.run(swarm(args))


if __name__ == "__main__":
    main(sys.argv[1:])
