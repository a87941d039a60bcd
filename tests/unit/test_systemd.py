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
    sock = listen(tmp_path, monkeypatch, watchdog_usec=100_000)
    alive, stop = threading.Event(), threading.Event()
    beating = threading.Event()

    def main_loop():
        while not stop.is_set():
            if beating.is_set():
                alive.set()
            time.sleep(0.01)

    threading.Thread(target=main_loop, daemon=True).start()
    beating.set()
    systemd.start_watchdog(alive, stop)
    assert drain(sock, 0.6).count("WATCHDOG=1") >= 3
    beating.clear()  # the loop hangs
    time.sleep(0.1)
    assert drain(sock, 0.6).count("WATCHDOG=1") == 0
    stop.set()


def test_a_watchdog_for_another_pid_is_not_ours(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd.watchdog_interval() is None
