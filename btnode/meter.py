"""`Meter`: the running totals a node exposes as metrics, free of torch and of any metrics library
(the HTTP proxy, node/api.py, keeps one without loading torch)."""

from __future__ import annotations

import threading
from collections import Counter


class Meter:
    """Running totals a node exposes as metrics (node/metrics.py reads them at scrape time):
    counts keyed by a tuple of label values, and durations as (count, sum) per name. Thread-safe,
    and free of any metrics library, so the domain code does not depend on one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.durations: dict[str, tuple[int, float]] = {}

    def count(self, key: tuple[str, ...], n: float = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            c, s = self.durations.get(name, (0, 0.0))
            self.durations[name] = (c + 1, s + seconds)

    def snapshot(self) -> tuple[dict[tuple[str, ...], float], dict[str, tuple[int, float]]]:
        with self._lock:
            return dict(self.counts), dict(self.durations)
