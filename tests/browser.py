"""A real headless Chromium (Debian's `chromium`) driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages ending in a NUL byte on fds 3 and 4), so tests can type into
a page, click and read it back without a websocket library or a browser download."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, width: int = 1000, height: int = 760):
        assert CHROMIUM is not None
        self.profile = tempfile.mkdtemp(prefix="btnode-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        cmd = (f"exec {CHROMIUM} --headless --no-sandbox --disable-gpu --no-first-run --disable-extensions "
               f"--user-data-dir={self.profile} --window-size={width},{height} --remote-debugging-pipe "
               f"about:blank 3<&{to_browser_r} 4>&{from_browser_w}")
        self.proc = subprocess.Popen(["bash", "-c", cmd], pass_fds=(to_browser_r, from_browser_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, *, timeout: float = 30.0, session: bool = True) -> dict:
        """One DevTools command; its result (events in between are dropped)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {timeout} s")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += chunk

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]

    def eval(self, expression: str) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll until `expression` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError as exc:  # the page is still being created: no context to evaluate in yet
                if "execution context" not in str(exc):
                    raise
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still falsy after {timeout} s")
            time.sleep(0.05)

    def type(self, selector: str, text: str) -> None:
        """Focus the element and type `text` key by key, as a user would."""
        self.click(selector)
        for ch in text:
            self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": ch, "key": ch})
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": ch})

    def key(self, key: str, code: str, *, vk: int = 0, modifiers: int = 0, commands: tuple[str, ...] = (),
            text: str = "") -> None:
        """One key pressed and released (`commands`: the editing command it triggers, e.g. selectAll;
        `text`: the character it types)."""
        down = {"type": "keyDown" if text else "rawKeyDown", "key": key, "code": code, "windowsVirtualKeyCode": vk,
                "modifiers": modifiers, **({"text": text} if text else {})}
        if commands:
            down["commands"] = list(commands)
        self.send("Input.dispatchKeyEvent", down)
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": key, "code": code, "windowsVirtualKeyCode": vk,
                                             "modifiers": modifiers})

    def retype(self, selector: str, text: str) -> None:
        """Click into a field, select all that is in it (Ctrl+A), delete it and type `text`."""
        self.click(selector)
        self.key("a", "KeyA", vk=65, modifiers=2, commands=("selectAll",))
        self.key("Backspace", "Backspace", vk=8)
        self.type(selector, text)

    def click(self, selector: str) -> None:
        box = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                        " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)
