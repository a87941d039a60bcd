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


class ByteProgress:
    """Progress of work measured in input bytes (`btnode data prepare`, `data verify`). On a terminal:
    one line rewritten in place with bytes, documents, rate and ETA. Elsewhere (journald, a pipe):
    the same as a log line every `log_every_s` seconds, and nothing for short runs."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None, refresh_s: float = 0.5,
                 log_every_s: float = 30.0):
        self.what, self.total = what, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.period = refresh_s if self.tty else log_every_s
        self.started = time.monotonic()
        self._shown = self.started
        self._drawn = False

    def __call__(self, done: int, documents: int | None = None) -> None:
        now = time.monotonic()
        if now - self._shown < self.period:
            return
        self._shown = now
        line = self.line(done, documents, now - self.started)
        if self.tty:
            self.stream.write("\r\033[K" + line[:200])
            self.stream.flush()
            self._drawn = True
        else:
            logging.getLogger("btnode.data").info("%s", line)

    def line(self, done: int, documents: int | None, elapsed: float) -> str:
        rate = done / max(elapsed, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        docs = f", {documents:,} documents" if documents is not None else ""
        return (f"{self.what}: {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({done / max(self.total, 1):.0%}){docs}"
                f" | {rate / 1e6:,.1f} MB/s | ETA {duration(eta)}")

    def close(self) -> None:
        """End the terminal line (if one was drawn) so what follows starts on its own."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
