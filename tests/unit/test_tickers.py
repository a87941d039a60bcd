"""The aggregator's block tickers and its watchdog (issue #25): a close that takes long holds its
block's lock, yet the keep-alives to a real NOTIFY_SOCKET go on without a gap, another block's
deadlines are still checked, and the long tick is logged. The slow block is a stand-in (fault
injection): a tick that holds a lock until the test lets it go, as a long close does."""

from __future__ import annotations

import threading
import time

from btnode.node import systemd
from btnode.node.aggregator import BlockTickers, watch_ticks

from test_systemd import listen


class SlowCloseBlock:
    """A block whose next tick is a close that holds its lock until `release`."""

    def __init__(self) -> None:
        self.lock, self.closing, self.release = threading.Lock(), threading.Event(), threading.Event()
        self.slow = True

    def tick(self) -> None:
        with self.lock:
            if self.slow:
                self.closing.set()
                self.release.wait(30)
                self.slow = False


class CountingBlock:
    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


def test_a_long_close_neither_gaps_the_keep_alives_nor_stops_other_blocks(tmp_path, monkeypatch):
    sock = listen(tmp_path, monkeypatch, watchdog_usec=100_000)  # a keep-alive every 0.05 s
    slow, other = SlowCloseBlock(), CountingBlock()
    stop, alive = threading.Event(), threading.Event()
    tickers = BlockTickers({0: slow, 1: other}, stop).start()
    main = threading.Thread(target=watch_ticks, args=(tickers, alive, stop), kwargs={"warn_after_s": 0.5})
    systemd.start_watchdog(alive, stop)
    main.start()
    try:
        assert slow.closing.wait(10)
        ticks_before, stamps, t_end = other.ticks, [], time.monotonic() + 1.5  # 1.5 s into the close
        while time.monotonic() < t_end:
            try:
                if sock.recv(1024) == b"WATCHDOG=1":
                    stamps.append(time.monotonic())
            except TimeoutError:
                pass
        assert 0 in tickers.busy() and tickers.busy()[0] >= 1.4  # what watch_ticks warns of (after warn_after_s)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert len(stamps) >= 15 and max(gaps) < 0.5, (len(stamps), max(gaps, default=None))
        assert other.ticks - ticks_before >= 10  # block 1's deadlines were checked meanwhile
        slow.release.set()
        deadline = time.monotonic() + 5
        while 0 in tickers.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 not in tickers.busy()
    finally:
        slow.release.set()
        stop.set()
        main.join(timeout=5)
        tickers.join()
