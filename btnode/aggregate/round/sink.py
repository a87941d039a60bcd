"""`RoundSink`: what a block's closed round becomes. The root's `Publisher` (round/publish.py)
publishes a version; a relay's `Forwarder` (relay/forward.py) forwards one combined update upstream
with its manifest, amendments and round log. The block's admission, judging, screening and sums are
the same for both: only these few moments differ."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill
from btnode.protocol import PushHeader, VersionInfo

if TYPE_CHECKING:
    from btnode.aggregate.round.block import BlockAggregator


class RoundSink(Protocol):
    """The moments of a block's round where the root and a relay differ. Each is called under the
    block's lock (the lock is re-entrant), except `member`, which a sink may use to call out."""

    durable: bool  # keep every accepted update's bytes in the spill, an in-process one included (a relay's round log)
    # a later update still reaches the parent's round in an amendment (a relay's, while the parent waits for its
    # sender): the round need not wait for children whose relay went away, who may report through another
    amends: bool

    def spill(self, block: BlockAggregator, now: float) -> Spill:
        """Where a new round keeps its updates' bytes."""
        ...

    def took(self, block: BlockAggregator, update: Update) -> None:
        """`update` went into the open round (its bytes spilled); before its sender hears PENDING."""
        ...

    def refuses(self, block: BlockAggregator, header: PushHeader) -> str:
        """Why a new update can no longer be carried by this round (answered LATE), or ""."""
        ...

    def due(self, block: BlockAggregator) -> bool:
        """Whether the open round holds anything this sink has not made something of yet."""
        ...

    def close(self, block: BlockAggregator, reason: str, ups: list[Update],
              dropped: list[tuple[str, str]]) -> VersionInfo | None:
        """Make the closed round's kept updates `ups` into what this sink makes (`dropped`: (worker id,
        reason) of those the screen dropped, already out of the sum); the version published, if any."""
        ...

    def member(self, block: BlockAggregator, worker_id: str, here: bool) -> None:
        """A replica's registration changed (`here`: registered); outside the block's lock."""
        ...
