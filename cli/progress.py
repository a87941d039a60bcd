"""Progress of long training runs. On a terminal: one status line, rewritten in place, with the
step, loss, rate and ETA of each model. Not on a terminal (a log file, journald, a pipe): quiet
but for one line per model when it finishes, so logs hold results rather than thousands of
progress lines. `--log-every N` turns the per-N-steps log lines back on for files."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from btnode.train.loops import Progress

log = logging.getLogger("btnode.train")


def duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):  # NaN or unknown
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressPrinter:
    def __init__(self, every: int | None, n_models: int, stream: TextIO | None = None, refresh_s: float = 0.5):
        self.every = every  # log a line every N steps even when not on a terminal (None: only at the end)
        self.n_models = n_models
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.refresh_s = refresh_s
        self._shown = 0.0
        self._lines: dict[str, str] = {}

    def __call__(self, p: Progress) -> None:
        rate = p.tokens / max(p.elapsed, 1e-9)
        done = p.step / p.total
        eta = p.elapsed * (1 - done) / done if done > 0 else float("nan")
        finished = p.step == p.total
        if self.tty:
            self._lines[p.name] = f"{p.name} {p.step}/{p.total} loss {p.stats.loss:.3f}"
            now = time.monotonic()
            if finished or now - self._shown >= self.refresh_s:
                self._shown = now
                line = " | ".join(self._lines.values()) + f" | {rate:,.0f} bytes/s | ETA {duration(eta)}"
                self.stream.write("\r\033[K" + line[:200])
                self.stream.flush()
            if finished and len(self._lines) >= self.n_models and all(
                    v.split()[1].split("/")[0] == v.split()[1].split("/")[1] for v in self._lines.values()):
                self.stream.write("\n")
                self.stream.flush()
            return
        if finished or (self.every and p.step % self.every == 0):
            log.info("%s step %d/%d loss %.4f ce %.4f K=%d | %.0f bytes/s, ETA %s",
                     p.name, p.step, p.total, p.stats.loss, p.stats.ce, p.stats.k, rate, duration(eta))
