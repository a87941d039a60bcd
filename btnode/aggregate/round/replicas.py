"""`Replicas`: which workers a block's round waits for: those registered (a version stream open here,
or joined), and those no longer waited for after missing rounds without a stream (`forget_silent`)."""

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

    def stream_opened(self, worker_id: str) -> None:
        self.streams[worker_id] += 1

    def stream_closed(self, worker_id: str) -> None:
        self.streams[worker_id] -= 1
        if self.streams[worker_id] <= 0:
            del self.streams[worker_id]

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
