"""The root's side of relays (docs/swarm.md, "Relays"): which relays joined each block, the checks
of a combined push's manifest (its children joined, are not revoked, weigh what they may, and sum
to the push's weight), and each relay's record for status."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from collections import OrderedDict
from dataclasses import dataclass, field

from btnode.errors import Forbidden, MalformedInput, Refused
from btnode.protocol import PushHeader

MAX_CHILDREN = 4096  # entries one manifest may list
REMEMBERED = 1 << 16  # child update ids kept to refuse one counted twice (through two relays)
WEIGHT_TOLERANCE = 1e-9  # relative: the manifest's sum is added in float64 in the same order by both sides
COUNTED = "already counted here: "  # a refusal's message lists those child update ids after this, comma-separated


@dataclass
class RelayRecord:
    name: str
    children: tuple[str, ...] = ()  # the workers listed in its accepted combined pushes, sorted
    last_version: int = 0  # the base version of that push
    last_weight: float = 0.0
    pushes: int = 0  # combined pushes accepted
    refused: int = 0  # combined pushes refused


def counted_in(message: str) -> frozenset[str]:
    """The child update ids a refusal of reason "counted" names (they reached this parent through
    another relay first, which then failed: the relay takes them out and pushes the rest again)."""
    _, found, ids = message.partition(COUNTED)
    return frozenset(i for i in ids.strip().split(",") if i) if found else frozenset()


def manifest_sum(header: PushHeader) -> float:
    """The summed weight of a manifest, in its order (how the relay computed the push's samples)."""
    return math.fsum(e.weight for e in header.manifest)


@dataclass
class Relays:
    """Relays by block: joined (Join with relay=True) and their pushes' outcomes."""

    _by_block: dict[int, dict[str, RelayRecord]] = field(default_factory=dict)
    _counted: OrderedDict[str, None] = field(default_factory=OrderedDict)  # child update ids accepted
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def joined(self, block: int, name: str) -> None:
        with self._lock:
            self._by_block.setdefault(block, {}).setdefault(name, RelayRecord(name))

    def known(self, block: int, name: str) -> bool:
        with self._lock:
            return name in self._by_block.get(block, {})

    def check(self, header: PushHeader, joined: Mapping[str, str], revoked: Callable[[str], bool],
              answered: Callable[[str], bool], own: frozenset[str] = frozenset()) -> None:
        """Refuse (MalformedInput "manifest", Refused "not_joined", Forbidden "revoked") a combined push
        whose sender is not a relay of the block, or whose manifest lists a child that never joined the
        block, is revoked, is listed twice, is based on a later version than the push, or whose weights
        do not sum to the push's; and (MalformedInput "counted", naming them all) one that lists child
        updates already counted here (answered, or in another relay's push), except `own`: those of
        the combined update this one amends."""
        who = header.worker_id
        if not self.known(header.block, who):
            raise Refused("not_joined", f"{who!r} pushed a combined update without joining block {header.block} as a "
                                        f"relay")
        entries = header.manifest
        if len(entries) > MAX_CHILDREN:
            raise MalformedInput("manifest", f"relay {who} lists {len(entries)} children, over {MAX_CHILDREN}")
        workers = [e.worker_id for e in entries]
        ids = [e.update_id for e in entries]
        if len(set(workers)) != len(workers) or len(set(ids)) != len(ids):
            raise MalformedInput("manifest", f"relay {who} lists a worker or an update twice")
        for e in entries:
            if e.worker_id not in joined:
                raise MalformedInput("manifest", f"relay {who} lists {e.worker_id!r}, which never joined block "
                                                 f"{header.block}")
            if revoked(e.worker_id):
                raise Forbidden("revoked", f"relay {who} lists {e.worker_id!r}, which was revoked")
            if e.base_version > header.base_version:
                raise MalformedInput("manifest", f"relay {who} lists {e.worker_id}'s update on version "
                                                 f"{e.base_version}, after the push's base {header.base_version}")
        counted = [e.update_id for e in entries
                   if e.update_id not in own and (answered(e.update_id) or self.counted(e.update_id))]
        if counted:
            raise MalformedInput("counted", f"relay {who} lists {len(counted)} child updates {COUNTED}"
                                            f"{','.join(counted)}")
        total = manifest_sum(header)
        if abs(total - header.samples) > WEIGHT_TOLERANCE * max(1.0, total):
            raise MalformedInput("manifest", f"relay {who} claims weight {header.samples:g}; its children's weights "
                                             f"sum to {total:g}")

    def counted(self, update_id: str) -> bool:
        with self._lock:
            return update_id in self._counted

    def pushed(self, header: PushHeader, accepted: bool, replaced: frozenset[str] = frozenset()) -> None:
        """Record a combined push's outcome; `replaced`: the child update ids of the combined update
        it amended, which are counted no more unless it lists them again."""
        with self._lock:
            rec = self._by_block.get(header.block, {}).get(header.worker_id)
            if rec is None:  # not a relay: nothing to record
                return
            if not accepted:
                rec.refused += 1
                return
            rec.pushes += 1
            for i in replaced:
                self._counted.pop(i, None)
            for e in header.manifest:
                self._counted[e.update_id] = None
            while len(self._counted) > REMEMBERED:
                self._counted.popitem(last=False)
            rec.children = tuple(sorted(set(rec.children) | {e.worker_id for e in header.manifest}))
            rec.last_version, rec.last_weight = header.base_version, header.samples

    def records(self, block: int) -> tuple[RelayRecord, ...]:
        with self._lock:
            return tuple(RelayRecord(**vars(r)) for _, r in sorted(self._by_block.get(block, {}).items()))
