"""`NormHistory`: the norms of recent accepted updates, which a new update's norm is judged by: refused
far over their median (the norm check), or scaled down to it (--clip)."""

from __future__ import annotations

import statistics
from collections import deque

from btnode.errors import MalformedInput


class NormHistory:
    def __init__(self, max_norm_ratio: float, clip: bool, keep: int = 50):
        self.max_norm_ratio, self.clip = max_norm_ratio, clip
        self.recent: deque[float] = deque(maxlen=keep)

    def check(self, size: float) -> None:
        """MalformedInput (`norm`) for an update norm over max_norm_ratio × the median accepted norm."""
        if len(self.recent) >= 3:
            ref = statistics.median(self.recent)
            if ref > 0 and size > self.max_norm_ratio * ref:
                raise MalformedInput("norm", f"update norm {size:.4g} is over {self.max_norm_ratio:g}× "
                                             f"the median accepted norm {ref:.4g}")

    def clip_factor(self, size: float) -> float:
        """With --clip, the factor that scales an update over the median norm of recent accepted
        updates down to it (SparseLoCo clips each peer so; the norm check refuses far larger ones
        outright); 1 otherwise."""
        if not self.clip or len(self.recent) < 3:
            return 1.0
        ref = statistics.median(self.recent)
        return ref / size if size > ref > 0 else 1.0
