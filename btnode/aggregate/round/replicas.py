"""`Replicas`: which workers a block's round waits for: those registered (a version stream open here,
or joined), and those no longer waited for after missing rounds without a stream (`forget_silent`) or,
at a relay, once the child relay they came through has no version stream here (`relay_closed`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

FORGET_AFTER = 2  # deadline rounds in a row a replica without a stream here may miss before it is not waited for


class Replicas:
    """The block's lock guards it (round/block.py): no lock of its own."""

    def __init__(self) -> None:
        self.registered: set[str] = set()
        self.streams: Counter = Counter()  # worker id → its version streams open here (rpc/server.py Watch)
        self.forgotten: set[str] = set()  # not waited for since they missed rounds (`forget_silent`)
        self.missed: Counter = Counter()  # worker id → deadline rounds in a row it missed without a stream here
        self.via: dict[str, str] = {}  # worker id → the child relay it came through (its last join or manifest)
        self.relays: Counter = Counter()  # child relay name → its version streams open here

    def stream_opened(self, worker_id: str) -> None:
        self.streams[worker_id] += 1

    def stream_closed(self, worker_id: str) -> None:
        self.streams[worker_id] -= 1
        if self.streams[worker_id] <= 0:
            del self.streams[worker_id]

    def joined(self, worker_id: str, via: str) -> None:
        """`worker_id` joined, through child relay `via` ("": itself)."""
        if via:
            self.via[worker_id] = via
        else:
            self.via.pop(worker_id, None)

    def listed(self, relay: str, workers: Iterable[str]) -> None:
        """`relay`'s combined update lists `workers`: they come through it now."""
        for w in workers:
            self.via[w] = relay

    def relay_opened(self, relay: str) -> None:
        """A version stream of child relay `relay`. Not what takes its children back: a relay that
        reconnects joins them again (node/relay.py `_follow`); one restarted empty knows them no more."""
        self.relays[relay] += 1

    def relay_closed(self, relay: str, *, set_aside: bool) -> list[str]:
        """A version stream of child relay `relay` ended. Its last, and `set_aside` (at a relay: the root
        keeps waiting, see docs/relays.md): its registered children are not waited for until they report
        or join again, as a child whose own stream ended. Returns those."""
        self.relays[relay] -= 1
        if self.relays[relay] > 0:
            return []
        del self.relays[relay]
        if not set_aside:
            return []
        aside = sorted(w for w in self.registered if self.via.get(w) == relay)
        self.registered.difference_update(aside)
        self.forgotten.update(aside)
        return aside

    def forget_silent(self, reported: Iterable[str]) -> list[str]:
        """At a deadline close: stop waiting for the registered workers that missed FORGET_AFTER deadline
        rounds in a row without a version stream here (workers under relays: their relay tells us when
        their streams end, but a relay that died cannot), until they report again (`recall`). Not after
        one: a dead relay's live children join again through a spare and report in the next round,
        whose close must wait for them (forgotten after one round, they were not, and the spare's
        push came late: bench/soak.py's relay kill runs count such lost updates). Returns those forgotten."""
        missing = [w for w in self.registered - set(reported) if not self.streams.get(w)]
        for w in set(self.missed) - set(missing):
            del self.missed[w]
        self.missed.update(missing)
        silent = sorted(w for w in missing if self.missed[w] >= FORGET_AFTER)
        for w in silent:
            del self.missed[w]
        self.registered.difference_update(silent)
        self.forgotten.update(silent)
        return silent

    def recall(self, *workers: str) -> None:
        """Workers that reported again (any answer, or listed in a relay's manifest) are waited for again."""
        back = self.forgotten.intersection(workers)
        self.forgotten.difference_update(back)
        for w in workers:
            self.missed.pop(w, None)
        self.registered.update(back)
