"""`Receipts`: the final word on each update a block took into a round (protocol.RoundReceipt): APPLIED
in the version its round made, or DROPPED from it with the reason. Kept by update id (for a re-push
and the RoundReceipt call) and by version and sender (for the Watch reply that delivers the version),
both bounded, so memory does not grow with the run."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from btnode.protocol import Outcome, RoundReceipt

KEPT = 4096  # receipts kept by update id (as the block keeps its answers)
VERSIONS = 8  # versions whose receipts a watcher can still be handed


class Receipts:
    def __init__(self, on_settled: Callable[[str, RoundReceipt], None] | None = None):
        """`on_settled(worker id, receipt)`: called once per update, when its receipt is made (the
        aggregator puts it on the sender's identity record)."""
        self.on_settled = on_settled
        self._by_update: OrderedDict[str, tuple[str, RoundReceipt]] = OrderedDict()
        self._by_version: OrderedDict[int, dict[str, list[RoundReceipt]]] = OrderedDict()

    def settle(self, worker_id: str, update_id: str, version: int, reason: str = "") -> RoundReceipt | None:
        """The receipt of `worker_id`'s update: APPLIED in `version` (no `reason`), or DROPPED from it with
        `reason`. A receipt is final: an update settled before keeps its first one (None is returned)."""
        if update_id in self._by_update:
            return None
        r = RoundReceipt(update_id=update_id, outcome=Outcome.DROPPED if reason else Outcome.APPLIED, version=version,
                         reason=reason)
        self._by_update[update_id] = (worker_id, r)
        while len(self._by_update) > KEPT:
            self._by_update.popitem(last=False)
        self._by_version.setdefault(version, {}).setdefault(worker_id, []).append(r)
        while len(self._by_version) > VERSIONS:
            self._by_version.popitem(last=False)
        if self.on_settled is not None:
            self.on_settled(worker_id, r)
        return r

    def of(self, worker_id: str, update_id: str) -> RoundReceipt | None:
        """`worker_id`'s receipt for `update_id` (None: pending, forgotten, or not that worker's)."""
        kept = self._by_update.get(update_id)
        return kept[1] if kept is not None and kept[0] == worker_id else None

    def for_version(self, worker_id: str, version: int) -> tuple[RoundReceipt, ...]:
        """The receipts of `worker_id`'s updates whose round made `version` (or left them out of it)."""
        return tuple(self._by_version.get(version, {}).get(worker_id, ()))
