"""Replay audits through relays (docs/security.md, "Replay audits through relays"): the root's side.

A root that replays audits sees a relay's children only as entries of a combined push, so it cannot
draw their updates when they arrive, as it draws a direct push's. Instead the relay commits each child
update before it counts it (`SwarmAggregator.draw`, the Draw RPC): it sends the child's own push header
(its work claim in it, which the child's signed receipt covers under mutual TLS) and its frames' digest.
The root checks the claim as a direct push's (the chain of the worker's states, its data, its base's
hash, its data key) and draws it with the same secret draw. A drawn update the relay pushes as it came,
and the root judges and replays it as a direct push; an update not drawn gets a commit token, an HMAC
under the root's secret over (block, worker, update id, base version, frames digest), which its
manifest entry must carry. A manifest entry without a valid token is an update the relay counted
without committing it (one it kept from the draw) and is refused (reason "uncommitted"). Tokens need
no memory at the root and survive its restarts, as the secret does.

The root also remembers, per round, which relay committed which update (`open`), and once the round's
version is out it counts those the version does not include (`settle`): a relay that drops a committed
child update is seen at the root, not only by the child (a relay's screen, a child refused at the relay
after its commit, or a combined push that came too late are the honest reasons; the count is a signal
to look, by relay).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections import Counter, OrderedDict

from btnode.errors import MalformedInput
from btnode.protocol import PushHeader, VersionInfo

REMEMBERED = 1 << 16  # committed update ids kept to answer a relay that commits one again (after a failover)


class Commits:
    """Commit tokens: made for child updates not drawn, checked on the manifests that list them."""

    def __init__(self, secret: bytes):
        self._key = hashlib.sha256(b"btnode-commit\0" + secret).digest()  # not the draw key itself
        self._known: OrderedDict[str, bytes] = OrderedDict()  # update id → its token
        self._open: dict[tuple[int, int], dict[str, str]] = {}  # (block, round) → update id → the relay that committed it
        self._drawn: OrderedDict[str, None] = OrderedDict()  # drawn, not yet pushed and judged
        self._lock = threading.Lock()

    def token(self, block: int, worker_id: str, update_id: str, base_version: int, digest: str) -> bytes:
        message = json.dumps([block, worker_id, update_id, base_version, digest]).encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def known(self, update_id: str) -> bytes | None:
        """The token of an update committed here before (None: not, or forgotten)."""
        with self._lock:
            return self._known.get(update_id)

    def commit(self, header: PushHeader, digest: str, relay: str = "") -> bytes:
        """The token of `header`'s update, remembered (a relay may commit it again after a failover),
        and the update noted as committed by `relay` in its round (its base version)."""
        token = self.token(header.block, header.worker_id, header.update_id, header.base_version, digest)
        with self._lock:
            self._known[header.update_id] = token
            while len(self._known) > REMEMBERED:
                self._known.popitem(last=False)
            self._open.setdefault((header.block, header.base_version), {})[header.update_id] = relay
        return token

    def drew(self, update_id: str) -> None:
        """A drawn update: its relay may push it here as it came, once (`was_drawn`, `judged`)."""
        with self._lock:
            self._drawn[update_id] = None
            while len(self._drawn) > REMEMBERED:
                self._drawn.popitem(last=False)

    def was_drawn(self, update_id: str) -> bool:
        with self._lock:
            return update_id in self._drawn

    def judged(self, update_id: str) -> None:
        """A drawn update pushed and judged: a re-push gets its answer; nobody may push it anew."""
        with self._lock:
            self._drawn.pop(update_id, None)

    def rounds(self, block: int) -> list[int]:
        """The rounds of `block` with commits not settled yet."""
        with self._lock:
            return sorted(v for b, v in self._open if b == block)

    def settle(self, block: int, info: VersionInfo | None, round_version: int) -> Counter[str]:
        """Forget round `round_version`'s commits; with `info`, the version that round published, count by
        relay those it does not include (None: the round's summary is gone, nothing to count)."""
        with self._lock:
            committed = self._open.pop((block, round_version), {})
        if info is None:
            return Counter()
        included = set(info.included)
        return Counter(relay for update_id, relay in committed.items() if update_id not in included)

    def check(self, header: PushHeader) -> None:
        """MalformedInput("uncommitted") naming the entries of a combined push whose token is not this
        root's for that entry (a forged, missing or moved token: each binds its update's frames digest)."""
        bad = [e.update_id for e in header.manifest
               if not hmac.compare_digest(e.token, self.token(header.block, e.worker_id, e.update_id, e.base_version,
                                                              e.sha256))]
        if bad:
            raise MalformedInput("uncommitted", f"relay {header.worker_id} lists {len(bad)} child updates this "
                                                f"aggregator did not commit (Draw); it replays audits, so every "
                                                f"child update is committed before it is counted: {','.join(bad[:8])}")
