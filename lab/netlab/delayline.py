"""A userspace delay line: every IP packet read from a TUN device is written back into it after a
fixed delay, in arrival order. Run inside a router namespace whose policy routing sends the
traffic between two hosts through the TUN device; re-injected packets then take the main table.

    python -m lab.netlab.delayline --tun dl0 --delay-ms 20
Prints "ready" once the device exists; exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import signal
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    def __init__(self, fd: int, delay_s: float):
        self.fd = fd
        self.delay_s = delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.packets = 0

    def read_forever(self) -> None:
        while True:
            packet = os.read(self.fd, 65536)
            with self.cond:
                self.queue.append((time.monotonic() + self.delay_s, packet))
                self.cond.notify()

    def write_forever(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                due, packet = self.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue
            with self.cond:
                self.queue.popleft()
            try:
                os.write(self.fd, packet)
            except OSError:  # a packet the kernel refuses (no route yet): drop it, as a link would
                pass
            self.packets += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tun", required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    args = ap.parse_args()
    line = DelayLine(open_tun(args.tun), args.delay_ms / 1000.0)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=line.read_forever, daemon=True).start()
    print("ready", flush=True)
    try:
        line.write_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
