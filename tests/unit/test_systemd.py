"""sd_notify in process: messages reach the socket, nothing happens outside systemd, and a main
loop that stops reporting stops the watchdog keep-alives."""

from __future__ import annotations

import socket
import threading
import time

from btnode.node import systemd


def listen(tmp_path, monkeypatch, watchdog_usec: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n.sock"))
    sock.settimeout(0.2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
    if watchdog_usec:
        monkeypatch.setenv("WATCHDOG_USEC", str(watchdog_usec))
    return sock


def drain(sock: socket.socket, seconds: float) -> list[str]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            out.append(sock.recv(1024).decode())
        except TimeoutError:
            pass
    return out


def test_notify_sends_fields_and_is_a_noop_outside_systemd(tmp_path, monkeypatch):
    sock = listen(tmp_path, monkeypatch)
    assert systemd.notify("READY=1", "STATUS=up")
    assert drain(sock, 0.3) == ["READY=1\nSTATUS=up"]
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not systemd.notify("READY=1")
    assert systemd.watchdog_interval() is None


def test_watchdog_is_withheld_when_the_main_loop_stops_reporting(tmp_path, monkeypatch):
    sock = listen(tmp_path, monkeypatch, watchdog_usec=100_000)  # a keep-alive every 0.05 s
    alive, stop, hang = threading.Event(), threading.Event(), threading.Event()

    def main_loop():
        while not hang.is_set():
            alive.set()
            time.sleep(0.01)

    loop = threading.Thread(target=main_loop, daemon=True)
    loop.start()
    systemd.start_watchdog(alive, stop)
    try:
        assert drain(sock, 0.6).count("WATCHDOG=1") >= 3
        hang.set()  # the loop hangs: it reports no more
        loop.join(timeout=10)
        # Its last report may still be taken (one keep-alive, possibly already queued in the socket):
        # let it through and discard it, then nothing more may come.
        drain(sock, 0.5)
        assert drain(sock, 0.6).count("WATCHDOG=1") == 0
    finally:
        stop.set()  # also when an assertion fails, so the thread does not log past the test


def test_a_watchdog_for_another_pid_is_not_ours(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd.watchdog_interval() is None
