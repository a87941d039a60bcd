"""`UpstreamAdmission`: what makes a `SwarmAggregator` a relay (docs/swarm.md, "Relays"), given to its
constructor. Children's joins go to the parent first, whose answer (its data key) is the one given;
each block's rounds close into a `Forwarder` (relay/forward.py) whose combined updates wait in
`outbox` for node/relay.py to push; under a parent that replays audits each child update is committed
there first (Draw), and one it draws goes up as it came."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from btnode.aggregate.relay.duties import ChildDuties
from btnode.aggregate.relay.forward import Combined, RelayBlock
from btnode.aggregate.relay.roundlog import Receipt
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.evidence import noting_digest
from btnode.codec.frames import ChunkData, ReplayableFrames, frame_from_raw
from btnode.errors import BtnodeError, ConfigError, MalformedInput, Refused
from btnode.protocol import Duties, JoinInfo, Judgement, PushHeader, Upstream, claim_digest
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
UPSTREAM_JOINS = 8  # children's joins a relay passes on to its parent at once (`join`)


class ParentKeys:
    """The data keys the parent handed out, by block and worker: a relay checks pushes against the
    root's keys, never its own (DataKeys' interface, as SwarmAggregator uses it)."""

    def __init__(self) -> None:
        self._keys: dict[int, dict[str, str]] = {}
        self.data_id: str | None = None

    def record(self, block: int, worker_id: str, key: str) -> None:
        self._keys.setdefault(block, {})[worker_id] = key

    def assign(self, block: int, worker_id: str, data_id: str) -> str:
        if data_id and self.data_id is None:
            self.data_id = data_id
        return self._keys.get(block, {}).get(worker_id, "")

    def of(self, block: int) -> dict[str, str]:
        return dict(self._keys.get(block, {}))


class UpstreamAdmission:
    """A relay's link to its parent, as its aggregator uses it. `parent_audits`: the parent audits this
    relay's combined pushes (JoinInfo.relay_audits): it takes no child relay. `parent_replays`: the parent
    replays audits (JoinInfo.audits): each child update is committed there first (Draw). `check_receipt`:
    under mutual TLS, a child's signed push receipt checked once its frames' digest is known
    (rpc/certs.check_receipt), so that one bad child cannot get the relay's combined push refused."""

    def __init__(self, upstream: Upstream, name: str, *, parent_audits: bool = False, parent_replays: bool = False,
                 check_receipt: Callable[[PushHeader, str], Any] | None = None):
        self.upstream, self.name = upstream, name
        self.parent_audits, self.parent_replays, self.check_receipt = parent_audits, parent_replays, check_receipt
        self.keys = ParentKeys()
        self.blocks: dict[int, RelayBlock] = {}  # made by `unit`, as the aggregator builds its blocks
        self.outbox: queue.Queue[Combined] = queue.Queue()  # closed rounds, for node/relay.py to push
        self.forwarded: dict[str, int] = {}  # the parent's outcome → combined pushes (node/relay.py)
        self.last_forward: dict[int, tuple[PushHeader, Combined]] = {}  # block → the last one pushed (node/relay.py)
        self._drawn: OrderedDict[str, None] = OrderedDict()  # child updates the parent drew, not passed on yet
        self._passed_on: OrderedDict[str, None] = OrderedDict()  # ... passed on: their start state goes up too
        self._refusing: set[str] = set()  # child updates answered LATE or STALE, their frames read for the digest
        self._joins: dict[tuple[int, str], tuple] = {}  # a child's join (and its proof), to send again
        # children's joins passed on at once: a parent's calls (Join, Leave, Status) share one small budget
        # over all its peers (rpc/limits.py), which a relay passing on a swarm's joins at once would fill
        self._joining = threading.BoundedSemaphore(UPSTREAM_JOINS)
        self._membership: queue.Queue[tuple[int, str, bool | None]] = queue.Queue()  # told to the parent in order
        # (block, worker id) → held while its join is at the parent, and while its refusal is told there (`refused_child`)
        self._child_locks: dict[tuple[int, str], threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.duties = ChildDuties(self._children_duties, told=self._wake)  # the children's verification duties
        threading.Thread(target=self._tell_parent, daemon=True, name="relay-membership").start()

    def config(self, acfg: AggregatorConfig) -> AggregatorConfig:
        """The relay's own settings: its children's updates are dense (it combines them), by a mean its
        parent can recompute to audit it."""
        if acfg.outer.robust in ("trimmed", "median"):
            raise ConfigError(f"a relay combines its children by their weighted mean (--robust mean or screened), "
                              f"which its parent can recompute to audit it; not {acfg.outer.robust}")
        return replace(acfg, update_codecs=tuple(c for c in acfg.update_codecs if not c.sparse))

    def forward(self, c: Combined) -> None:
        """A block's closed round, combined: into the outbox that node/relay.py pushes upstream from."""
        self.outbox.put(c)

    def unit(self, block: int, initial: dict[str, torch.Tensor], store: VersionStore, acfg: AggregatorConfig, *,
             child_relay: Callable[[str], bool], **kwargs: Any) -> RelayBlock:
        """Block `block` of the relay's aggregator: its rounds close into the outbox, and its children's
        comings and goings are told to the parent (not those of a child relay, no member there)."""
        made = RelayBlock(block, initial, store, acfg, on_combined=self.forward,
                          on_membership=functools.partial(self._member, block, child_relay), **kwargs)
        self.blocks[block] = made
        return made

    # -- joins -----------------------------------------------------------------------------------
    def refuse_child_relay(self) -> None:
        """A relay under this one cannot pass a parent's relay audits or commits (Refused, `relay`)."""
        if self.parent_audits or self.parent_replays:
            raise Refused("relay", f"{self.name}'s parent audits relays or replays updates, which a relay under a "
                                   f"relay cannot pass (its children's updates never reach this relay one by one): "
                                   f"join the parent directly")

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str, *,
             training_json: str, proof: tuple[bytes, bytes] | None) -> JoinInfo:
        """The parent judges a worker's join first (fingerprint, data, training terms, revocation) and
        keeps the record; its answer's data key is the one the relay admits the child with."""
        with self._child_lock(block, worker_id), self._joining:
            parent = self.upstream.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json,
                                        proof=proof)  # under mutual TLS the worker's signed join, passed on
            self._joins[(block, worker_id)] = (fingerprint, config_json, data_id, training_json, proof)
            self.keys.record(block, worker_id, parent.data_key)
        return parent

    def _child_lock(self, block: int, worker_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._child_locks.setdefault((block, worker_id), threading.Lock())

    def refused_child(self, block: int, worker_id: str) -> None:
        """A push of `worker_id` refused for good here (it never joined here: the child of a dead relay that
        pushed before joining). The parent, which it joined through that relay, would wait for it until its
        deadline: it is told that the child left (`_tell_parent`), unless the child joins here meanwhile."""
        self._membership.put((block, worker_id, None))

    def left(self, worker_id: str, block: int) -> None:
        self._joins.pop((block, worker_id), None)  # the block told the parent (Forwarder.member)
        self.duties.forget(worker_id)

    # -- verification duties (relay/duties.py) ------------------------------------------------------
    def _children_duties(self) -> dict[str, Duties]:
        """The children's duties, asked of the parent under this relay's own name."""
        if not self.blocks:
            return {}
        return self.upstream.duties(min(self.blocks), self.name).children

    def _wake(self) -> None:
        for b in self.blocks.values():
            b.wake()  # the children's version streams say that duties wait

    def _member(self, block: int, child_relay: Callable[[str], bool], worker_id: str, here: bool) -> None:
        if not child_relay(worker_id):  # a child relay is no member at the parent
            self._membership.put((block, worker_id, here))

    def _tell_parent(self) -> None:
        """Children that went away leave the parent (its rounds stop waiting for them); those that came
        back join it again with their first join's arguments. A failure is logged, not retried: a
        child that came back re-joins the parent itself when it re-joins here after a failover."""
        while True:
            block, worker_id, here = self._membership.get()
            try:
                if here is None:
                    with self._child_lock(block, worker_id):  # not between a join's call to the parent and its answer
                        if worker_id not in self.keys.of(block):
                            self.upstream.leave(worker_id, block)
                            log.info("told the parent that %s, refused here without a join, left block %d",
                                     worker_id, block)
                elif not here:
                    self.upstream.leave(worker_id, block)
                elif (block, worker_id) in self._joins:
                    fingerprint, config_json, data_id, training_json, proof = self._joins[(block, worker_id)]
                    self.upstream.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json,
                                       proof=proof)
            except BtnodeError as exc:
                log.warning("could not tell the parent that %s %s block %d: %s", worker_id,
                            "is back on" if here else "left", block, exc)

    # -- pushes ----------------------------------------------------------------------------------
    def noting(self, header: PushHeader, chunks: Iterable[ChunkData]) -> Iterator[ChunkData]:
        """A child's push, its frames' digest noted on the way for the manifest. Under a parent that
        replays audits, a child's update is committed there once its frames are in, before it is judged
        here: one the parent drew goes up as it came (`routed`), not into the round."""
        forwarder = self.blocks[header.block].forwarder

        def noted(digest: str) -> None:
            if self.check_receipt is not None:  # under mutual TLS: the child's signed receipt, before it is judged
                self.check_receipt(header, digest)
            if header.update_id in self._refusing:  # answered LATE or STALE here (`refused`): not counted
                if self.parent_replays and not header.manifest:
                    self.upstream.draw(header, digest, self.name, refused=True)
                return
            token = b""
            if self.parent_replays and not header.manifest:
                drawn = self.upstream.draw(header, digest, self.name)  # a refusal (chain, claim, revoked) is the child's answer
                if drawn.drawn:
                    _remember(self._drawn, header.update_id)
                token = drawn.token
            with self.blocks[header.block].lock:
                forwarder.note(header.update_id, digest, Receipt(header.samples, header.cert, header.signature,
                                                                 claim_digest(header.claim), token))

        return noting_digest(chunks, noted)

    def refused(self, header: PushHeader, chunks: Iterable[ChunkData]) -> None:
        """A child's update answered LATE or STALE here before its frames were read (`chunks`, as `noting`
        gave them): under a parent that replays audits its claim still goes up (Draw, `refused`), once its
        frames are read for the digest its receipt signs, so that the parent's chain of the worker's claims
        moves on as the worker's optimizer did; else the worker's next update would read as a broken chain."""
        if not self.parent_replays:
            return
        self._refusing.add(header.update_id)
        try:
            for _ in chunks:
                pass
        finally:
            self._refusing.discard(header.update_id)

    def routed(self, header: PushHeader, raw: dict[str, bytes], count: Callable[[str, str], None]) -> Judgement | None:
        """A child's update the parent drew for a replay audit: pushed up as it came (its frames rebuilt
        from the same codec bytes, its header and signed receipt untouched), the parent's answer the
        child's. None for any other: it is judged here."""
        if header.update_id not in self._drawn:
            return None
        del self._drawn[header.update_id]
        block = self.blocks[header.block]
        judged = self.upstream.push(header, [frame_from_raw(n, s, header.codec, raw[n]) for n, s in block.spec.items()])
        _remember(self._passed_on, header.update_id)
        if judged.outcome.in_round:
            block.passed_on(header)
        count("passed_on", judged.outcome.value)
        log.info("%s: %s's update %s drawn for a replay audit at the parent, passed on: %s%s", block.name,
                 header.worker_id, header.update_id[:8], judged.outcome.value, " (audit)" if judged.audit else "")
        return judged

    def submit_state(self, header: PushHeader, chunks: Iterable[ChunkData]) -> None:
        """The start state of a child update passed on for a replay audit: passed on to the parent, as it came."""
        if header.update_id not in self._passed_on:
            raise MalformedInput("no_audit", f"{self.name} passed no update {header.update_id[:16]!r} on for an audit")
        self.upstream.submit_state(header, chunks)

    def evidence(self, c: Combined) -> ReplayableFrames:
        """The evidence of combined update `c` (RelayBlock.evidence)."""
        return self.blocks[c.block].evidence(c)

    def lost(self) -> int:
        """Accepted child updates never forwarded (the parent moved on first), over all blocks."""
        return sum(b.lost for b in self.blocks.values())


def _remember(ids: OrderedDict[str, None], update_id: str, keep: int = 4096) -> None:
    ids[update_id] = None
    while len(ids) > keep:
        ids.popitem(last=False)
