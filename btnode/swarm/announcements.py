"""`Announcements`: the versions the aggregator announces for one block, read from its watch
stream by a thread that reconnects when the stream breaks or is refused (after a jittered backoff
that grows while it keeps failing), and waited on by the worker."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable

from btnode.errors import PeerUnavailable
from btnode.protocol import Upstream, VersionInfo

log = logging.getLogger(__name__)
RECONNECTED = object()  # put on the queue when the watch stream comes back
BACKOFF_S = (0.5, 15.0)  # the first wait before opening a broken stream again, and the longest


class Announcements:
    def __init__(self, link: Upstream, block: int, worker_id: str, *, wait_timeout_s: float,
                 on_reconnect: Callable[[], None] = lambda: None):
        """`on_reconnect` is called before each attempt to open the stream again (a worker counts them)."""
        self.link, self.block, self.worker_id, self.wait_timeout_s = link, block, worker_id, wait_timeout_s
        self.on_reconnect = on_reconnect
        self._queue: queue.Queue[object] = queue.Queue()
        self._newest: VersionInfo | None = None

    def follow(self, stop: threading.Event) -> None:
        """Feed announcements from the server stream into the queue; reconnect when it breaks
        (a thread's target, until `stop`)."""
        streams, failures = 0, 0  # streams opened before; attempts in a row that brought nothing
        while not stop.is_set():
            try:
                first = True
                for info in self.link.watch(self.block, self.worker_id):
                    if first and streams:
                        self._queue.put(RECONNECTED)  # the aggregator may have restarted
                    first, failures = False, 0
                    self._queue.put(info)
                    if stop.is_set():
                        return
                streams += 1
            except PeerUnavailable as exc:  # gone, or refused for now (Overloaded): both pass
                if stop.is_set():  # cancelled by the worker on the way out
                    return
                streams += 1
                log.warning("watch stream lost (%s); reconnecting", exc)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self._queue.put(exc)
                return
            first_s, most_s = BACKOFF_S
            stop.wait(min(most_s, first_s * 2**failures) * random.uniform(0.5, 1.0))
            failures += 1
            self.on_reconnect()

    def newer(self, version: int, stop: threading.Event, on_reconnect: Callable[[int], None]) -> VersionInfo | None:
        """Block until a version newer than `version` is announced (None if stopped first); when the
        stream reconnects meanwhile, call `on_reconnect(version)`. A failed stream's error is raised here."""
        deadline = time.monotonic() + self.wait_timeout_s
        while not stop.is_set():
            if self._newest is not None and self._newest.version > version:
                return self._newest
            try:
                item = self._queue.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PeerUnavailable(f"no version after {version} within {self.wait_timeout_s:.0f} s")
                continue
            if item is RECONNECTED:
                on_reconnect(version)
                continue
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, VersionInfo)
            if self._newest is None or item.version > self._newest.version:
                self._newest = item
        return None
