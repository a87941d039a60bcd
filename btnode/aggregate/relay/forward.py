"""A relay's rounds (docs/swarm.md, "Relays"): the aggregator's own admission, judging, screening and
combining of its children's updates, except that a round closes into ONE combined update for the
parent (its weight the children's sum, its manifest naming each child update) rather than into a
published version: the `Forwarder` sink (round/sink.py). Versions come from the parent, adopted
after their hash check (`RelayBlock.adopt`). node/relay.py wires it to the parent through rpc/."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from btnode.aggregate.relay.roundlog import SPILL_NAME, Receipt, Recovered, RoundLog
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import RoundSummary, version_meta
from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill
from btnode.codec.codecs import Codec
from btnode.codec.frames import Frame, ReplayableFrames, frame_from_raw
from btnode.errors import InputError, MalformedInput
from btnode.protocol import EvidenceChild, ManifestEntry, Outcome, PushHeader, VersionInfo
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
KEPT_ROUNDS = 2  # earlier rounds whose spill a relay keeps for its parent's relay audit (aggregate/trust/evidence.py)


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


class Forwarder:
    """A relay block's `RoundSink`: a round closes into a `Combined` handed to `on_combined`. The round
    stays open after that, until the parent's next version is adopted: a child update that arrives
    later (a child of a failed relay that moved here, mid-round) goes into it, and the round closes
    again into an amended combined update, which takes the place of the first at the parent. The
    open round is durable (relay/roundlog.py): a restart takes it up."""

    durable = True  # every accepted child update's bytes in the round's spill, before its child hears ACCEPTED
    amends = True  # the root waits for a child that moved to another relay; this round amends its push if it comes

    def __init__(self, folder: Path, *, on_combined: Callable[[Combined], None] = lambda c: None,
                 on_membership: Callable[[str, bool], None] = lambda worker_id, here: None):
        self.roundlog = RoundLog(folder)
        self.on_combined = on_combined
        self.on_membership = on_membership  # a child went away (False) / came back (True): told to the parent
        self.recovered: Recovered | None = None  # the round a killed relay left, until taken up
        self._started = False
        self.digests: dict[str, str] = {}  # update id → frames_digest, for the manifest (`note`)
        self.receipts: dict[str, Receipt] = {}  # update id → what it came with, for its manifest entry
        self.kept: OrderedDict[int, Spill] = OrderedDict()  # earlier rounds' spills, for evidence (`keep`)
        self.forwarded: frozenset[str] = frozenset()  # child update ids in the last combined update of this round
        self.amend_until: float | None = None  # when an amendment can no longer reach the parent's round
        self.lost = 0  # accepted child updates never forwarded (the parent moved on first)
        self._away: set[str] = set()  # children whose version stream ended, told to the parent as gone

    def note(self, update_id: str, digest: str, receipt: Receipt) -> None:
        """What a child's push came with, once its frames are in and before it is judged (its frames'
        digest, its signed receipt and commit token): its manifest entry carries them."""
        self.digests[update_id] = digest
        self.receipts[update_id] = receipt

    # -- RoundSink -------------------------------------------------------------------------------
    def spill(self, block: BlockAggregator, now: float) -> Spill:
        """A named spill with the round's log beside it; at start, the round a killed relay left, if
        the version it was on is still this relay's current one."""
        if not self._started:
            self._started = True
            self.recovered = self.roundlog.recover(block.info.version)
            if self.recovered is not None:
                return self.recovered.spill
        return self.roundlog.start(block.info.version, now)

    def took(self, block: BlockAggregator, update: Update) -> None:
        """Durable (its bytes and its record) before its child hears ACCEPTED."""
        self.roundlog.accepted(update, self.digests.get(update.update_id, ""), block.tally.spill,
                               self.receipts.get(update.update_id))

    def refuses(self, block: BlockAggregator, header: PushHeader) -> str:
        """LATE for a new child update once this round went up and an amendment could no longer reach
        the parent's round before its deadline: the parent said when that is in its answer to the push
        (`parent_closes`); before it did, once this relay's own deadline passed. Taken, the child would
        hear ACCEPTED for an update that is lost (bench/soak.py's relay kill runs counted them, when the
        rule was "never past the parent's deadline" unknown); told LATE, it knows, as a direct worker would."""
        until = self.amend_until if self.amend_until is not None else block.round.deadline()
        if self.forwarded and block.clock() >= until and header.worker_id not in block.round.accepted:
            return (f"this relay forwarded round {block.round.version} and an amendment could no longer reach "
                    f"the parent's round in time")
        return ""

    def due(self, block: BlockAggregator) -> bool:
        """Whether the round holds child updates that its last combined update did not carry."""
        return bool(block.round.accepted) and {u.update_id for u in block.round.accepted.values()} != self.forwarded

    def close(self, block: BlockAggregator, reason: str, ups: list[Update],
              dropped: list[tuple[str, str]]) -> None:
        """One combined update of the kept child updates for the parent; a relay publishes nothing."""
        for worker_id, _ in dropped:  # already out of the sum (the screen took them out): out of the round
            del block.round.accepted[worker_id]
            block.round.counts[Outcome.PENDING] -= 1
        mean_of, _ = block.tally.combiner(ups, release=False)  # the sum stays: an amendment adds to it
        delta = {n: mean_of(n) for n in block.spec}
        manifest = tuple(e for u in ups for e in manifest_of(u, self.digests.get(u.update_id, ""),
                                                              self.receipts.get(u.update_id, Receipt())))
        combined = Combined(block=block.block, base_version=block.round.version, delta=delta,
                            weight=math.fsum(e.weight for e in manifest), loss=sum(u.loss for u in ups) / len(ups),
                            manifest=manifest, ups=tuple(ups))
        log.info("%s round %d: combined %d child updates (weight %g, %s, %d dropped by the screen) for the parent",
                 block.name, block.round.version, len(ups), combined.weight, reason, len(dropped))
        block.rounds_closed[reason] += 1
        self.forwarded = frozenset(u.update_id for u in ups)
        self.on_combined(combined)
        return None

    def member(self, block: BlockAggregator, worker_id: str, here: bool) -> None:
        """A child's version stream ended (or it left): the parent stops waiting for it too, as an
        aggregator stops waiting for a direct worker whose stream ended; it joins there again when its
        stream comes back here."""
        with block.lock:
            if here:
                told = worker_id in self._away
                self._away.discard(worker_id)
            else:
                told = worker_id not in block.registered and worker_id not in self._away
                if told:
                    self._away.add(worker_id)
        if told:
            self.on_membership(worker_id, here)

    # -- the parent's versions -------------------------------------------------------------------
    def next_round(self, block: BlockAggregator, spill: Spill) -> None:
        """The ending round's spill (its children's codec bytes as they came) stays, for KEPT_ROUNDS
        rounds: the parent may still ask for the evidence of a combined push of it (`evidence`); its
        name goes (the open file stays readable): the next round's spill is a new file of that name."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(block.store.folder / SPILL_NAME)
        self.kept[block.round.version] = spill
        while len(self.kept) > KEPT_ROUNDS:
            self.kept.popitem(last=False)[1].close()
        self.digests.clear()
        self.receipts.clear()
        self.forwarded = frozenset()
        self.amend_until = None


class RelayBlock(BlockAggregator):
    """A block at a relay: a `BlockAggregator` whose rounds close into its `Forwarder`, with what the
    relay's node does to it (node/relay.py): adopt the parent's versions, hear when the parent's round
    closes, take out what the parent counted already, serve the evidence of a combined push. It
    overrides nothing of the block: the sink is where a relay's rounds differ."""

    def __init__(self, block: int, initial: Tensors, store: VersionStore, *args: Any,
                 on_combined: Callable[[Combined], None] = lambda c: None,
                 on_membership: Callable[[str, bool], None] = lambda worker_id, here: None, **kwargs: Any):
        """`on_combined`: where each closed round's combined update goes; `on_membership(worker_id,
        here)`: a child went away (False) or came back (True), to be told to the parent."""
        self.forwarder = Forwarder(store.folder, on_combined=on_combined, on_membership=on_membership)
        super().__init__(block, initial, store, *args, sink=self.forwarder, **kwargs)
        if self.forwarder.recovered is not None:
            self._take_up(self.forwarder.recovered)
            self.forwarder.recovered = None

    @property
    def lost(self) -> int:
        return self.forwarder.lost

    def _take_up(self, found: Recovered) -> None:
        """Into the round again, as they were accepted: its sum, sketch, answers and digests."""
        self.round.opened_at = found.opened_at
        self.forwarder.receipts.update(found.receipts)  # under mutual TLS: the children's signed receipts
        for u, digest in found.updates:
            self.tally.restore(u)
            self.round.add(u)
            self.counters[(Outcome.PENDING.value, "recovered")] += 1
            self._remember(u.update_id, self.round.judgement(Outcome.PENDING))
            self.forwarder.digests[u.update_id] = digest
        log.info("%s round %d: took up %d child updates accepted before a restart", self.name, self.round.version,
                 len(found.updates))

    def parent_closes(self, version: int, at: float) -> None:
        """The parent took this relay's combined push of round `version` into its round, whose amendments
        must go up by `at` (this relay's clock; the parent's deadline less the time an upload takes)."""
        with self.lock:
            if version == self.round.version:
                self.forwarder.amend_until = at

    def passed_on(self, header: PushHeader) -> None:
        """A child's update went up on its own (drawn for a replay audit at the parent): the child has
        reported for this round, which closes once the rest have, without waiting for its deadline."""
        with self.lock:
            if header.base_version == self.round.version:
                self.round.reported.add(header.worker_id)
            self._maybe_close()

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
            if out and self.forwarder.due(self):
                self._close("amended")
            return len(out)

    def adopt(self, info: VersionInfo, params: Tensors, *, raw: dict[str, bytes] | None, codec: Codec | None) -> None:
        """The parent's version `info`, its θ `params` already hash-checked (and its delta's raw bytes,
        when it was fetched as a delta: children fetch that same delta from here). Stored, then announced."""
        if state_sha256(params) != info.sha256:
            raise MalformedInput("checksum", f"{self.name} v{info.version} from the parent fails its hash")
        self.store.write(info.version, params, meta=version_meta(info, "relayed"), delta_raw=raw, delta_codec=codec)
        with self.lock:
            missed = [u for u in self.round.accepted.values() if u.update_id not in self.forwarder.forwarded]
            if missed:
                self.forwarder.lost += len(missed)
                log.warning("%s: version %d arrived before round %d was forwarded; %d child updates missed it",
                            self.name, info.version, self.round.version, len(missed))
            self.params, self.info = self.store.theta(info.version) if self.theta_in_file else params, info
            now = self.clock()
            self.recent.append(RoundSummary(info=info, closed_at=now))
            spill = self.tally.take_spill()  # taken from the round, so that _open does not close it
            self.forwarder.next_round(self, spill)
            self._open(now)
            self.lock.notify_all()

    def evidence(self, c: Combined) -> ReplayableFrames:
        """The evidence of combined update `c` (aggregate/trust/evidence.py): for each child update it
        combined, in manifest order, its EvidenceChild, then its frames rebuilt from the spilled codec
        bytes (the same bytes, so the same sha256 as the child sent). Read lazily, again on each pass."""
        with self.lock:
            spill = self.tally.spill if c.base_version == self.round.version else self.forwarder.kept.get(c.base_version)
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
