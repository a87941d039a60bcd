"""A relay's domain object (docs/swarm.md, "Relays"): the aggregator's own admission, judging,
screening and combining of its children's updates, except that a round closes into ONE combined
update for the parent (its weight the children's sum, its manifest naming each child update)
rather than into a published version, and versions come from the parent, adopted after their
hash check. node/relay.py wires it to the parent through rpc/."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from btnode.aggregate.block import AggregatorConfig, BlockAggregator, RoundSummary
from btnode.aggregate.evidence import noting_digest
from btnode.aggregate.identities import Identity
from btnode.aggregate.roundlog import SPILL_NAME, Receipt, Recovered, RoundLog
from btnode.aggregate.rounds import Update
from btnode.aggregate.spill import Spill
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import ChunkData, Frame, ReplayableFrames, frame_from_raw
from btnode.errors import BtnodeError, ConfigError, InputError, MalformedInput, Refused
from btnode.model.config import ModelConfig
from btnode.protocol import (Drawn, EvidenceChild, JoinInfo, Judgement, ManifestEntry, Outcome, PushHeader, VersionInfo,
                             claim_digest)
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
DENSE_CODECS = tuple(c for c in Codec if not c.sparse)  # what a relay combines (module doc of claims.py)
KEPT_ROUNDS = 2  # earlier rounds whose spill a relay keeps for its parent's relay audit (aggregate/evidence.py)
UPSTREAM_JOINS = 8  # children's joins a relay passes on to its parent at once (RelaySwarm.join)


@dataclass(frozen=True)
class Combined:
    """One closed relay round: the weighted mean of its kept child updates, ready to push upstream."""

    block: int
    base_version: int
    delta: Tensors  # fp32, dense
    weight: float  # the children's summed weight (math.fsum, manifest order)
    loss: float  # the children's mean training CE
    manifest: tuple[ManifestEntry, ...]
    ups: tuple[Update, ...] = field(default=(), repr=False, compare=False)  # what it combined (its evidence)


def manifest_of(u: Update, digest: str, receipt: Receipt = Receipt()) -> tuple[ManifestEntry, ...]:
    """A kept child update's manifest entries: itself (with what it came with: its weight claim, its
    claim's digest, its signed receipt under mutual TLS, its commit token under replay audits), or, for
    a child that is a relay, its own children (a tree of relays gives the root a flat list), their
    weights scaled as it was."""
    if not u.manifest:
        return (ManifestEntry(worker_id=u.worker_id, update_id=u.update_id, base_version=u.base_version,
                              weight=u.weight, sha256=digest, samples=receipt.samples, cert=receipt.cert,
                              signature=receipt.signature, claim_sha256=receipt.claim_sha256, token=receipt.token),)
    scale = u.weight / u.samples
    return tuple(replace(e, weight=e.weight * scale) for e in u.manifest)


class RelayBlock(BlockAggregator):
    """A block at a relay: a round closes into a `Combined` handed to `on_combined`. The round stays
    open after that, until the parent's next version is adopted: a child update that arrives later
    (a child of a failed relay that moved here, mid-round) goes into it, and the round closes again
    into an amended combined update, which takes the place of the first at the parent; children the
    parent names as counted already (through the failed relay) are taken out exactly (`uncount`)."""

    def __init__(self, block: int, initial: Tensors, store: VersionStore, *args, **kwargs):
        self.roundlog = RoundLog(store.folder)  # the open round, durable: a restart takes it up (roundlog.py)
        self._recovered: Recovered | None = None
        self._starting = True
        super().__init__(block, initial, store, *args, **kwargs)
        self._starting = False
        self.on_combined = lambda c: None  # set by RelaySwarm
        self.digests: dict[str, str] = {}  # update id → frames_digest, for the manifest
        self.receipts: dict[str, Receipt] = {}  # update id → what it came with, for its manifest entry
        self.kept: OrderedDict[int, Spill] = OrderedDict()  # earlier rounds' spills, for evidence (`_keep_spill`)
        self.forwarded: frozenset[str] = frozenset()  # child update ids in the last combined update of this round
        self.amend_until: float | None = None  # when an amendment can no longer reach the parent's round (`parent_closes`)
        self.lost = 0  # accepted child updates never forwarded (the parent moved on first)
        self.on_membership = lambda worker_id, here: None  # set by RelaySwarm: a child went away / came back
        self._away: set[str] = set()  # children whose version stream ended, told to the parent as gone
        if self._recovered is not None:
            self._take_up(self._recovered)
            self._recovered = None

    def register(self, worker_id: str) -> None:
        super().register(worker_id)
        with self.lock:
            back = worker_id in self._away
            self._away.discard(worker_id)
        if back:
            self.on_membership(worker_id, True)

    def unregister(self, worker_id: str) -> None:
        """A child's version stream ended (or it left): the parent stops waiting for it too, as an
        aggregator stops waiting for a direct worker whose stream ended; it joins there again when its
        stream comes back here."""
        super().unregister(worker_id)
        with self.lock:
            gone = worker_id not in self.registered and worker_id not in self._away
            if gone:
                self._away.add(worker_id)
        if gone:
            self.on_membership(worker_id, False)

    def _round_spill(self, now: float) -> Spill:
        """A named spill with the round's log beside it; at start, the round a killed relay left, if
        the version it was on is still this relay's current one."""
        if self._starting:
            self._recovered = self.roundlog.recover(self.info.version)
            if self._recovered is not None:
                return self._recovered.spill
        return self.roundlog.start(self.info.version, now)

    def _take_up(self, found: Recovered) -> None:
        """Into the round again, as they were accepted: its sum, sketch, answers and digests."""
        self.round.opened_at = found.opened_at
        self.receipts.update(found.receipts)  # under mutual TLS: the children's signed receipts, for the manifest
        for u, digest in found.updates:
            values = self._values(u)
            if not self._holds_updates:
                self._sum.add(values, u.weight)
            if self._sketcher is not None:
                u.sketch = self._sketcher.of(values)
            self.round.add(u)
            self.counters[(Outcome.ACCEPTED.value, "recovered")] += 1
            self._remember(u.update_id, self.round.judgement(Outcome.ACCEPTED))
            self.digests[u.update_id] = digest
        log.info("%s round %d: took up %d child updates accepted before a restart", self.name, self.round.version,
                 len(found.updates))

    def _take(self, update: Update) -> None:
        """Into the round, and durable (its bytes and its record) before its child hears ACCEPTED. An
        update handed in without its codec bytes (in process) is kept as its fp32 values."""
        if update.raw is None and update.delta is not None and not self._holds_updates:
            update.raw = {n: t.contiguous().view(-1).numpy().tobytes() for n, t in update.delta.items()}
            update.codec = Codec.FP32
        super()._take(update)
        self.roundlog.accepted(update, self.digests.get(update.update_id, ""), self._spill,
                               self.receipts.get(update.update_id))

    def _too_late(self, header: PushHeader) -> Judgement | None:
        """LATE for a new child update once this round went up and an amendment could no longer reach
        the parent's round before its deadline: the parent said when that is in its answer to the push
        (`parent_closes`); before it did, once this relay's own deadline passed. Taken, the child would
        hear ACCEPTED for an update that is lost (145 of them in a kill run at N = 1,024, when the rule
        was "never past the parent's deadline" unknown); told LATE, it knows, as a direct worker would."""
        until = self.amend_until if self.amend_until is not None else self.round.deadline()
        if (self.forwarded and header.update_id not in self._answers and self.clock() >= until
                and header.worker_id not in self.round.accepted):
            return self._answer(header, self.round.judgement(
                Outcome.LATE, f"this relay forwarded round {self.round.version} and an amendment could no longer "
                              f"reach the parent's round in time"))
        return None

    def parent_closes(self, version: int, at: float) -> None:
        """The parent took this relay's combined push of round `version` into its round, whose amendments
        must go up by `at` (this relay's clock; the parent's deadline less the time an upload takes)."""
        with self.lock:
            if version == self.round.version:
                self.amend_until = at

    def precheck(self, header: PushHeader) -> Judgement | None:
        with self.lock:
            late = self._too_late(header)
        return late or super().precheck(header)

    def submit(self, header: PushHeader, delta: Tensors, **kwargs: Any) -> Judgement:
        with self.lock:  # the lock is re-entrant: the check and the judgement see one round
            return self._too_late(header) or super().submit(header, delta, **kwargs)

    def passed_on(self, header: PushHeader) -> None:
        """A child's update went up on its own (drawn for a replay audit at the parent): the child has
        reported for this round, which closes once the rest have, without waiting for its deadline."""
        with self.lock:
            if header.base_version == self.round.version:
                self.round.reported.add(header.worker_id)
            self._maybe_close()

    def _fresh(self) -> bool:
        """Whether the round holds child updates that its last combined update did not carry."""
        return bool(self.round.accepted) and {u.update_id for u in self.round.accepted.values()} != self.forwarded

    def _maybe_close(self):  # type: ignore[override]
        return super()._maybe_close() if self._fresh() else None

    def drain(self):  # type: ignore[override]
        with self.lock:
            return self._close("drain") if self._fresh() else None

    def uncount(self, update_ids: frozenset[str]) -> int:
        """The parent counted these child updates already (they reached it through a relay that then
        failed, and their workers re-pushed here): out of the round, exactly, and the rest forwarded
        again. Returns how many child updates were taken out."""
        with self.lock:
            out = [u for u in self.round.accepted.values() if update_ids & set(u.included)]
            for u in out:
                self._withdraw(u)
                self.counters[(Outcome.REJECTED.value, "counted_upstream")] += 1
                log.info("%s round %d: the parent counted the update of %s already; taken out", self.name,
                         self.round.version, u.worker_id)
            if out and self._fresh():
                self._close("amended")
            return len(out)

    def _publish(self, reason: str) -> None:  # type: ignore[override]  # a relay publishes nothing
        ups, dropped = self._screen(sorted(self.round.accepted.values(), key=lambda u: u.worker_id))
        for worker_id, _ in dropped:  # already out of the sum (the screen took them out): out of the round
            del self.round.accepted[worker_id]
            self.round.counts[Outcome.ACCEPTED] -= 1
        mean_of, _ = self._combiner(ups, release=False)  # the sum stays: an amendment adds to it
        delta = {n: mean_of(n) for n in self.spec}
        manifest = tuple(e for u in ups for e in manifest_of(u, self.digests.get(u.update_id, ""),
                                                              self.receipts.get(u.update_id, Receipt())))
        combined = Combined(block=self.block, base_version=self.round.version, delta=delta,
                            weight=math.fsum(e.weight for e in manifest), loss=sum(u.loss for u in ups) / len(ups),
                            manifest=manifest, ups=tuple(ups))
        log.info("%s round %d: combined %d child updates (weight %g, %s, %d dropped by the screen) for the parent",
                 self.name, self.round.version, len(ups), combined.weight, reason, len(dropped))
        self.rounds_closed[reason] += 1
        self.forwarded = frozenset(u.update_id for u in ups)
        self.on_combined(combined)

    def adopt(self, info: VersionInfo, params: Tensors, *, raw: dict[str, bytes] | None, codec: Codec | None) -> None:
        """The parent's version `info`, its θ `params` already hash-checked (and its delta's raw bytes,
        when it was fetched as a delta: children fetch that same delta from here). Stored, then announced."""
        if state_sha256(params) != info.sha256:
            raise MalformedInput("checksum", f"{self.name} v{info.version} from the parent fails its hash")
        self.store.write(info.version, params, meta=self._meta(info, "relayed"), delta_raw=raw, delta_codec=codec)
        with self.lock:
            missed = [u for u in self.round.accepted.values() if u.update_id not in self.forwarded]
            if missed:
                self.lost += len(missed)
                log.warning("%s: version %d arrived before round %d was forwarded; %d child updates missed it",
                            self.name, info.version, self.round.version, len(missed))
            self.params, self.info = self.store.theta(info.version) if self._theta_in_file else params, info
            now = self.clock()
            self.recent.append(RoundSummary(info=info, closed_at=now))
            self._keep_spill()
            self._open(now)
            self.digests.clear()
            self.receipts.clear()
            self.forwarded = frozenset()
            self.amend_until = None
            self.lock.notify_all()


    def _keep_spill(self) -> None:
        """The ending round's spill (its children's codec bytes as they came) stays, for KEPT_ROUNDS
        rounds: the parent may still ask for the evidence of a combined push of it (`evidence`)."""
        spill, self._spill = self._spill, None  # taken from the round, so that _open does not close it
        # its name goes (the open file stays readable): the next round's spill is a new file of that name
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.store.folder / SPILL_NAME)
        self.kept[self.round.version] = spill
        while len(self.kept) > KEPT_ROUNDS:
            self.kept.popitem(last=False)[1].close()

    def evidence(self, c: Combined) -> ReplayableFrames:
        """The evidence of combined update `c` (aggregate/evidence.py): for each child update it
        combined, in manifest order, its EvidenceChild, then its frames rebuilt from the spilled codec
        bytes (the same bytes, so the same sha256 as the child sent). Read lazily, again on each pass."""
        with self.lock:
            spill = self._spill if c.base_version == self.round.version else self.kept.get(c.base_version)
        if spill is None or not c.ups:
            raise InputError(f"{self.name}: the children's bytes of round {c.base_version} are not kept any more")

        def parts() -> Iterator[EvidenceChild | Frame]:
            for u in c.ups:
                if u.spilled is None:
                    raise InputError(f"{self.name}: the update of {u.worker_id} was not spilled")
                yield EvidenceChild(update_id=u.update_id, weight=u.weight, scale=u.scale,
                                    entries=max(1, len(u.manifest)))
                raw = spill.get(u.spilled)
                for n in self.spec:
                    yield frame_from_raw(n, self.spec[n], u.codec, raw[n])

        return ReplayableFrames(parts)  # type: ignore[arg-type]


def _remember(ids: OrderedDict[str, None], update_id: str, keep: int = 4096) -> None:
    ids[update_id] = None
    while len(ids) > keep:
        ids.popitem(last=False)


class Upstream(Protocol):
    """What a relay asks of its parent while admitting children (rpc.client.SwarmClient or the
    failover link over several parents)."""

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "", relay: bool = False, proof: tuple[bytes, bytes] | None = None) -> JoinInfo: ...

    def leave(self, worker_id: str, block: int) -> None: ...

    def draw(self, header: PushHeader, digest: str) -> Drawn: ...

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement: ...

    def submit_state(self, header: PushHeader, frames: Iterable[Frame | ChunkData]) -> None: ...


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


class RelaySwarm(SwarmAggregator):
    """A relay: serves children as an aggregator does (rpc/server.py takes it as it is); joins go to
    the parent first, whose answer (its data key) is the one given; closed rounds go to `outbox`."""

    block_class = RelayBlock

    def __init__(self, cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *, upstream: Upstream, name: str,
                 blocks: Iterable[int] | None = None, seed: int = 0):
        if acfg.outer.robust in ("trimmed", "median"):
            raise ConfigError(f"a relay combines its children by their weighted mean (--robust mean or screened), "
                              f"which its parent can recompute to audit it; not {acfg.outer.robust}")
        super().__init__(cfg, replace(acfg, update_codecs=tuple(c for c in acfg.update_codecs if not c.sparse)),
                         state_dir, blocks=blocks, seed=seed)
        self.parent_audits = False  # the parent audits this relay's pushes (JoinInfo.relay_audits; node/relay.py)
        self.parent_replays = False  # the parent replays audits: each child update is committed there first (Draw)
        self._drawn: OrderedDict[str, None] = OrderedDict()  # child updates the parent drew, not passed on yet
        self._passed_on: OrderedDict[str, None] = OrderedDict()  # ... passed on: their start state goes up too
        # under mutual TLS (node/relay.py sets it): check a child's signed push receipt (rpc/certs.check_receipt)
        self.check_receipt: Callable[[PushHeader, str], None] | None = None
        self.upstream, self.name = upstream, name
        self.keys = ParentKeys()  # type: ignore[assignment]
        self.outbox: queue.Queue[Combined] = queue.Queue()
        self._joins: dict[tuple[int, str], tuple] = {}  # a child's join (and its proof), to send again
        # children's joins passed on at once: a parent's calls (Join, Leave, Status) share one small budget
        # over all its peers (rpc/limits.py), which a relay passing on a swarm's joins at once would fill
        self._joining = threading.BoundedSemaphore(UPSTREAM_JOINS)
        self._membership: queue.Queue[tuple[int, str, bool]] = queue.Queue()  # told to the parent in order
        threading.Thread(target=self._tell_parent, daemon=True, name="relay-membership").start()
        self.forwarded: dict[str, int] = {}  # the parent's outcome → combined pushes (node/relay.py)
        self.last_forward: dict[int, tuple[PushHeader, Combined]] = {}  # block → the last one pushed (node/relay.py)
        for b in self.blocks.values():
            assert isinstance(b, RelayBlock)
            b.on_combined = self.outbox.put
            b.on_membership = functools.partial(self._member, b.block)

    def _member(self, block: int, worker_id: str, here: bool) -> None:
        if not self.relays.known(block, worker_id):  # a child relay is no member at the parent
            self._membership.put((block, worker_id, here))

    def _tell_parent(self) -> None:
        """Children that went away leave the parent (its rounds stop waiting for them); those that came
        back join it again with their first join's arguments. A failure is logged, not retried: a
        child that came back re-joins the parent itself when it re-joins here after a failover."""
        while True:
            block, worker_id, here = self._membership.get()
            try:
                if not here:
                    self.upstream.leave(worker_id, block)
                elif (block, worker_id) in self._joins:
                    fingerprint, config_json, data_id, training_json, proof = self._joins[(block, worker_id)]
                    self.upstream.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json,
                                       proof=proof)
            except BtnodeError as exc:
                log.warning("could not tell the parent that %s %s block %d: %s", worker_id,
                            "is back on" if here else "left", block, exc)

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "",
             who: Identity | None = None, *, training_json: str = "", relay: bool = False,
             proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        """The parent judges a worker's join first (fingerprint, data, training terms, revocation) and
        keeps the record; then the relay admits the child with the same checks and the parent's data
        key. A child relay joins here only: the parent knows the workers under it from their own joins
        and sees their updates in this relay's manifests, so it does not wait on the child relay."""
        self.block(block)
        if relay and (self.parent_audits or self.parent_replays):
            self.count("join_refused", "relay")
            raise Refused("relay", f"{self.name}'s parent audits relays or replays updates, which a relay under a "
                                   f"relay cannot pass (its children's updates never reach this relay one by one): "
                                   f"join the parent directly")
        if relay:
            return super().join(worker_id, block, fingerprint, config_json, data_id, who, relay=True)
        with self._joining:
            parent = self.upstream.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json,
                                        proof=proof)  # under mutual TLS the worker's signed join, passed on
        self._joins[(block, worker_id)] = (fingerprint, config_json, data_id, training_json, proof)
        self.keys.record(block, worker_id, parent.data_key)
        mine = super().join(worker_id, block, fingerprint, config_json, data_id, who, training_json=training_json)
        return replace(mine, data_key=parent.data_key, audits=parent.audits)  # a worker keeps its start states

    def leave(self, worker_id: str, block: int) -> None:
        super().leave(worker_id, block)  # the block tells the parent (RelayBlock.unregister)
        self._joins.pop((block, worker_id), None)

    def push(self, header: PushHeader, chunks: Iterable[ChunkData], who: Identity | None = None) -> Judgement:
        """Judged as the aggregator judges, noting its frames' digest on the way for the manifest. Under
        a parent that replays audits, a child's update is committed there once its frames are in, before
        it is judged here: one the parent drew goes up as it came (`_routed`), not into the round."""
        block = self.block(header.block)
        assert isinstance(block, RelayBlock)

        def noted(digest: str) -> None:
            if self.check_receipt is not None:  # under mutual TLS: the child's signed receipt, before it is judged
                self.check_receipt(header, digest)
            token = b""
            if self.parent_replays and not header.manifest:
                drawn = self.upstream.draw(header, digest)  # a refusal (chain, claim, revoked) is the child's answer
                if drawn.drawn:
                    _remember(self._drawn, header.update_id)
                token = drawn.token
            with block.lock:
                block.digests[header.update_id] = digest
                block.receipts[header.update_id] = Receipt(header.samples, header.cert, header.signature,
                                                           claim_digest(header.claim), token)

        return super().push(header, noting_digest(chunks, noted), who)

    def _routed(self, block: BlockAggregator, header: PushHeader, raw: dict[str, bytes]) -> Judgement | None:
        """A child's update the parent drew for a replay audit: pushed up as it came (its frames rebuilt
        from the same codec bytes, its header and signed receipt untouched), the parent's answer the child's."""
        if header.update_id not in self._drawn:
            return None
        del self._drawn[header.update_id]
        assert isinstance(block, RelayBlock)
        judged = self.upstream.push(header, [frame_from_raw(n, s, header.codec, raw[n]) for n, s in block.spec.items()])
        _remember(self._passed_on, header.update_id)
        if judged.outcome in (Outcome.ACCEPTED, Outcome.PROBATION):
            block.passed_on(header)
        self.count("passed_on", judged.outcome.value)
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
        b = self.block(c.block)
        assert isinstance(b, RelayBlock)
        return b.evidence(c)

    def lost(self) -> int:
        return sum(b.lost for b in self.blocks.values() if isinstance(b, RelayBlock))
