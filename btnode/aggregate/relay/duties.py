"""`ChildDuties`: a relay's mailbox of its children's verification duties (docs/verification.md,
"Through relays"). The root hands a drawn update to a verifier behind a relay by keeping the duty for
the relay; the relay's version stream from the root says that duties wait, and the relay fetches all
of its children's at once (`Upstream.duties` under its own name, `Duties.children`), keeps each
child's until the child asks, and tells the child on the child's own version stream (`handed`). What
a child does with a duty (fetch the inputs, attest, send a trace or a state) the relay passes on to
the root in the child's name; attestations and traces carry the child's signature, so the relay
cannot forge or change them. The relay learns who verifies what only once the update is in: the
root draws verifiers after the push.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from btnode.errors import BtnodeError
from btnode.protocol import Duties

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # at most this often a child's ask fetches from the parent when its stream said nothing


class ChildDuties:
    """`fetch()`: the relay's children's duties from the parent (worker id → Duties); `told(worker)`:
    a child has new duties (its version stream says so: the relay's blocks wake their watchers)."""

    def __init__(self, fetch: Callable[[], dict[str, Duties]], told: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self._fetch, self._told, self.clock = fetch, told, clock
        self.lock = threading.Lock()
        self.mail: dict[str, Duties] = {}  # child → its duties not asked for yet
        self.handed_out: dict[str, int] = {}  # child → duties ever kept for it
        self.fetched = float("-inf")

    def refresh(self) -> int:
        """Fetch the children's duties from the parent now; how many items came (a failure: 0, logged)."""
        self.fetched = self.clock()
        try:
            got = self._fetch()
        except BtnodeError as exc:
            log.warning("could not fetch the children's verification duties: %s", exc)
            return 0
        n = 0
        with self.lock:
            for child, d in got.items():
                self.mail.setdefault(child, Duties()).add(d)
                self.handed_out[child] = self.handed_out.get(child, 0) + len(d)
                n += len(d)
        if n:
            self._told()
        return n

    def handed(self, worker_id: str) -> int:
        """How many duties were ever kept here for `worker_id` (its stream says when this grows)."""
        return self.handed_out.get(worker_id, 0)

    def take(self, worker_id: str) -> Duties:
        """`worker_id`'s duties since it last asked; fetched from the parent first when the last fetch is
        over REFRESH_S old (a child that polls: the relay's own stream from the parent may have broken)."""
        if self.clock() - self.fetched > REFRESH_S:
            self.refresh()
        with self.lock:
            return self.mail.pop(worker_id, None) or Duties()

    def forget(self, worker_id: str) -> None:
        """A child left: its unasked duties go (the root hands them to the aggregator when it times out)."""
        with self.lock:
            self.mail.pop(worker_id, None)
