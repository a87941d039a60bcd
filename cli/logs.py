"""Logging for the CLI: human-readable lines on a terminal or in a plain log file, JSON lines
(one object per record) under systemd, where journald and log shippers parse them.

systemd is detected by $JOURNAL_STREAM (set when stderr is connected to the journal) or
$INVOCATION_ID (set for every unit); `--log-format text|json` overrides the guess."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage(),
               "pid": record.process, "thread": record.threadName}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def under_systemd() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"))


def configure(level: int, fmt: str = "auto") -> str:
    """Set up the root logger; returns the format chosen ("text" or "json")."""
    chosen = ("json" if under_systemd() else "text") if fmt == "auto" else fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return chosen
