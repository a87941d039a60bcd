"""Progress lines for long training runs: rate and ETA every `every` steps."""

from __future__ import annotations

import logging

from btnode.train.loops import Progress

log = logging.getLogger("btnode.train")


class ProgressPrinter:
    def __init__(self, every: int, n_models: int):
        self.every = every
        self.n_models = n_models

    def __call__(self, p: Progress) -> None:
        if p.step % self.every and p.step != p.total:
            return
        rate = p.tokens / max(p.elapsed, 1e-9)
        done = p.step / p.total
        eta = p.elapsed * (1 - done) / done if done > 0 else float("nan")
        log.info("%s step %d/%d loss %.4f ce %.4f K=%d | %.0f bytes/s, ETA %.0fs",
                 p.name, p.step, p.total, p.stats.loss, p.stats.ce, p.stats.k, rate, eta)
