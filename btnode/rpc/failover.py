"""`FailoverLink`: an Upstream over several upstreams (`--peer A,B`: relays, or the root),
used in order. When the one in use is unreachable it moves to the next, joins there again with
the joins it remembers, and only then retries the call: no call reaches a spare before the joins
have landed there. A broken watch stream moves it too, so the worker's reconnect re-pushes its
last update to the new upstream (swarm/announcements.py). A push refused `not_joined` (the upstream
forgot the join, or the push overtook it) joins again and is pushed once more."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from btnode.codec.frames import ChunkData, Frame
from btnode.errors import BtnodeError, ConfigError, JoinPending, PeerUnavailable, Refused
from btnode.protocol import (Attestation, Drawn, Duties, EvidenceChild, JoinInfo, Judgement, Outcome, Pulled,
                             PushHeader, RoundReceipt, VersionInfo)
from btnode.rpc.client import SwarmClient

log = logging.getLogger(__name__)
T = TypeVar("T")


def parse_peers(text: str) -> list[str]:
    """`--peer HOST:PORT[,HOST:PORT...]`, in order of preference."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    if not peers or len(set(peers)) != len(peers):
        raise ConfigError(f"--peer {text!r}: give one HOST:PORT or several, comma-separated and distinct")
    return peers


def upstream_link(text: str, **client: Any) -> SwarmClient | FailoverLink:
    """One peer: a plain SwarmClient; several: a FailoverLink over them. `client`: SwarmClient's options."""
    peers = parse_peers(text)
    return SwarmClient(peers[0], **client) if len(peers) == 1 else FailoverLink(peers, **client)


class FailoverLink:
    def __init__(self, addresses: list[str], **client: Any):
        """`client`: SwarmClient's options (security, timeout, retries of refused calls), for each upstream."""
        self.clients = [SwarmClient(a, **client) for a in addresses]
        self.index = 0
        self.failovers = 0
        self._joins: dict[tuple[str, int], tuple[tuple, dict]] = {}  # (worker id, block) → join's arguments
        self._lock = threading.Lock()
        self._joined = threading.Event()  # clear while a failover joins the next upstream: calls wait for it
        self._joined.set()
        self._join_wait_s = 2 * self.clients[0].timeout_s + 10  # a failover's joins, each within a call's timeout
        self._closing = False  # the owner cancelled its watches: a stream ending now is no failure

    @property
    def address(self) -> str:
        return self.clients[self.index].address

    def _failover(self, failed: int, exc: BtnodeError) -> None:
        """Move on from upstream `failed` (if nobody moved on already) and join the next; every call
        meanwhile, from any thread, waits until these joins have landed (`_ready`)."""
        with self._lock:
            if self.index != failed or self._closing or len(self.clients) == 1:
                return
            self.index = (failed + 1) % len(self.clients)
            self.failovers += 1
            client = self.clients[self.index]
            log.warning("upstream %s failed (%s); moving to %s", self.clients[failed].address, exc, client.address)
            joins = list(self._joins.values())
            self._joined.clear()  # in the lock: a caller that sees the new index waits for its joins
        try:
            for args, kwargs in joins:
                try:
                    client.join(*args, **kwargs)
                except BtnodeError as err:  # the next call there tells the caller what is wrong, if anything still is
                    log.warning("could not join again at %s: %s", client.address, err)
                    return
        finally:
            self._joined.set()

    def _ready(self) -> int:
        """The upstream in use, once a failover's joins there have landed."""
        self._joined.wait(self._join_wait_s)
        return self.index

    def rejoin(self) -> None:
        """Send the remembered joins again to the upstream in use (it may have restarted and forgotten
        them: a relay's join is not kept on disk)."""
        client = self.clients[self._ready()]
        for args, kwargs in list(self._joins.values()):
            client.join(*args, **kwargs)

    def _run(self, fn: Callable[[SwarmClient], T]) -> T:
        i = self._ready()
        try:
            return fn(self.clients[i])
        except JoinPending:
            raise  # its join is on its way there (retried by the client until its budget): no reason to move on
        except PeerUnavailable as exc:
            self._failover(i, exc)
            return fn(self.clients[self._ready()])

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "", relay: bool = False, proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        args = (worker_id, block, fingerprint, config_json, data_id)
        kwargs = {"training_json": training_json, "relay": relay, "proof": proof}
        self._joins[(worker_id, block)] = (args, kwargs)
        return self._run(lambda c: c.join(*args, **kwargs))

    def leave(self, worker_id: str, block: int) -> None:
        self._joins.pop((worker_id, block), None)
        self._run(lambda c: c.leave(worker_id, block))

    def pull(self, block: int, worker_id: str, spec: Mapping[str, tuple[int, ...]]) -> Pulled:
        return self._run(lambda c: c.pull(block, worker_id, spec))

    def fetch_delta(self, block: int, version: int, spec: Mapping[str, tuple[int, ...]]) -> Pulled:
        return self._run(lambda c: c.fetch_delta(block, version, spec))

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement:
        """Pushed where the link is; refused `not_joined` there (a restarted upstream, or a push that overtook
        its join), joined again and pushed once more; a second refusal is the judgement REJECTED."""
        frames = list(frames)  # a retry on the next upstream sends them again
        try:
            return self._run(lambda c: c.push(header, frames, raising=("not_joined",)))
        except Refused as exc:
            refused = Judgement(outcome=Outcome.REJECTED, reason=str(exc), round_version=header.base_version)
            if (header.worker_id, header.block) not in self._joins:
                return refused
            log.warning("push of %s refused at %s (%s); joining again", header.update_id[:8], self.address, exc)
            try:
                self.rejoin()
            except PeerUnavailable:
                raise
            except BtnodeError as err:  # the join is refused (revoked, other settings): the push stays refused
                log.warning("could not join again at %s: %s", self.address, err)
                return refused
            return self._run(lambda c: c.push(header, frames))

    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        return self._run(lambda c: c.draw(header, digest, relay, refused=refused))

    def submit_state(self, header: PushHeader, frames: Iterable[Frame | ChunkData]) -> None:
        frames = list(frames)
        self._run(lambda c: c.submit_state(header, frames))

    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | Frame]) -> None:
        self._run(lambda c: c.submit_evidence(header, unit, parts))  # re-iterable: re-read on the next upstream

    def watch(self, block: int, worker_id: str) -> Iterator[VersionInfo]:
        """The current upstream's announcements; a broken stream moves to the next upstream and ends
        (PeerUnavailable), so that the caller reconnects there."""
        i = self._ready()
        try:
            yield from self.clients[i].watch(block, worker_id)
        except JoinPending:
            raise  # the caller opens it again after a backoff, here
        except PeerUnavailable as exc:
            self._failover(i, exc)
            raise

    def receipt(self, block: int, worker_id: str, update_id: str) -> RoundReceipt | None:
        """Of the current upstream: the one the watch stream that delivered the version came from
        (another, after a failover, never saw the update: None)."""
        return self._run(lambda c: c.receipt(block, worker_id, update_id))

    def duties_waiting(self, block: int, worker_id: str) -> bool:
        return self.clients[self.index].duties_waiting(block, worker_id)  # local: no call

    def states_wanted(self, block: int, worker_id: str) -> tuple[str, ...]:
        return self._run(lambda c: c.states_wanted(block, worker_id))

    # delegated verification: of the current upstream, which handed out the duties (another knows none of them)
    def duties(self, block: int, worker_id: str) -> Duties:
        return self._run(lambda c: c.duties(block, worker_id))

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[dict[str, torch.Tensor],
                                                                                dict[str, torch.Tensor]]:
        return self._run(lambda c: c.verify_inputs(block, task_id, worker_id))

    def attest(self, block: int, attestation: Attestation) -> None:
        self._run(lambda c: c.attest(block, attestation))

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        self._run(lambda c: c.submit_trace(block, task_id, worker_id, trace, proof=proof))

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        self._run(lambda c: c.submit_dispute_state(block, task_id, worker_id, k, state))

    def status(self):  # noqa: ANN201 - pb.StatusReply, as SwarmClient.status
        return self._run(lambda c: c.status())

    def cancel_watches(self, worker_id: str | None = None) -> None:
        self._closing = True
        for c in self.clients:
            c.cancel_watches(worker_id)

    def close(self) -> None:
        for c in self.clients:
            c.close()
