"""Progress output: a live line with rate and ETA on a terminal, quiet in logs otherwise."""

from __future__ import annotations

import io
import logging

from btnode.train.loops import Progress
from btnode.train.trainers import StepStats
from btnode_cli.progress import ByteProgress, ProgressPrinter, duration


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps(printer: ProgressPrinter, total: int = 100) -> None:
    for i in range(1, total + 1):
        printer(Progress(name="block-0", step=i, total=total, stats=StepStats(loss=1.5, ce=2.0, k=1),
                         elapsed=i * 0.1, tokens=i * 1000))


def test_a_terminal_gets_one_rewritten_line_with_rate_and_eta():
    out = Tty()
    steps(ProgressPrinter(None, 1, stream=out, refresh_s=0.0))
    text = out.getvalue()
    assert text.count("\r") == 100 and text.endswith("\n") and text.count("\n") == 1
    assert "10,000 bytes/s" in text and "ETA 9s" in text and "block-0 100/100" in text


def test_a_log_file_stays_quiet_but_for_the_end(caplog):
    caplog.set_level(logging.INFO, logger="btnode.train")
    out = io.StringIO()
    steps(ProgressPrinter(None, 1, stream=out))
    assert out.getvalue() == ""
    assert len(caplog.records) == 1 and "step 100/100" in caplog.records[0].getMessage()
    caplog.clear()
    steps(ProgressPrinter(25, 1, stream=out))
    assert len(caplog.records) == 4


def test_duration_format():
    assert duration(5) == "5s" and duration(125) == "2m05s" and duration(3725) == "1h02m" and duration(float("nan")) == "?"


def test_byte_progress_rewrites_a_terminal_line_and_logs_elsewhere(caplog):
    out = Tty()
    shown = ByteProgress("prepare", total=200_000_000, stream=out, refresh_s=0.0)
    shown.started -= 2.0  # two seconds in
    shown(50_000_000, 1234)
    shown.close()
    text = out.getvalue()
    assert text.startswith("\r\033[K") and text.endswith("\n") and "50.0/200.0 MB (25%), 1,234 documents" in text
    assert "25.0 MB/s" in text and "ETA 6s" in text
    caplog.set_level(logging.INFO, logger="btnode.data")
    quiet = io.StringIO()
    logged = ByteProgress("verify", total=10, stream=quiet, log_every_s=0.0)
    logged(5)
    logged.close()
    assert quiet.getvalue() == "" and len(caplog.records) == 1 and "verify: 0.0/0.0 MB (50%)" in caplog.records[0].getMessage()
