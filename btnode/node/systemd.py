"""The sd_notify protocol, for `Type=notify` units: READY=1 once a node can serve, STATUS= lines,
STOPPING=1 on a drain, and WATCHDOG=1 keep-alives at half the unit's WatchdogSec.

It is a datagram to the AF_UNIX socket named by $NOTIFY_SOCKET (a leading '@' is Linux's abstract
namespace). Outside systemd the variable is unset and every call is a no-op. The protocol is a
few lines; a dependency (systemd-python needs libsystemd headers to build) would cost more.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send KEY=VALUE fields to systemd; False (and nothing sent) when not run under it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall("\n".join(fields).encode())
        return True
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", address, exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between keep-alives (half of WatchdogSec), or None when no watchdog is armed for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


def start_watchdog(alive: threading.Event | None = None, stop: threading.Event | None = None) -> threading.Thread | None:
    """Send WATCHDOG=1 every interval while the node is healthy. `alive`, when given, must be set
    again by the node's main loop within each interval: a hung loop then stops the keep-alives
    and systemd restarts the node, rather than a thread that outlives it pretending all is well."""
    interval = watchdog_interval()
    if interval is None:
        return None
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            if alive is not None:
                if not alive.is_set():
                    log.error("main loop did not report within %.1f s: withholding the watchdog keep-alive", interval)
                    continue
                alive.clear()
            notify("WATCHDOG=1")

    t = threading.Thread(target=loop, daemon=True, name="watchdog")
    t.start()
    return t
