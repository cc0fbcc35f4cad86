"""Headless Chromium driven over the DevTools protocol: load a page, read its DOM, screenshot parts.

Only the `chromium` binary (Debian's package) and websocket-client are needed; nothing is
downloaded. `Browser.find()` says why not when there is no browser to run.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket
from PIL import Image

NAMES = ("chromium", "chromium-browser", "google-chrome")


class Browser:
    def __init__(self, binary: str, profile: Path, width: int = 1280, height: int = 1000) -> None:
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{binary} did not start its DevTools endpoint")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            targets = json.load(reply)
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self._id = 0
        self.events: list[dict[str, Any]] = []
        self.call("Page.enable")
        self.call("Runtime.enable")

    @staticmethod
    def find() -> str | None:
        return next((found for n in NAMES if (found := shutil.which(n))), None)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def open(self, url: str, timeout_s: float = 60) -> None:
        """Navigate and wait for the load event."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load within {timeout_s} s")
            self.events.append(json.loads(self.ws.recv()))

    def eval(self, expression: str) -> Any:
        found = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression}: {found['exceptionDetails']}")
        return found["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (value := self.eval(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} stayed false for {timeout_s} s")
            time.sleep(0.05)
        return value

    def text(self, selector: str = "body") -> str:
        return str(self.eval(f"document.querySelector({json.dumps(selector)}).innerText"))

    def screenshot(self, selector: str | None = None) -> Image.Image:
        """The page (the viewport), or just the element `selector` matches, as an RGB image."""
        params: dict[str, Any] = {"format": "png"}
        if selector is not None:
            box = self.eval(
                f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                ".getBoundingClientRect(); return {x: r.left + window.scrollX, "
                "y: r.top + window.scrollY, width: r.width, height: r.height}; })()"
            )
            params.update(clip={**box, "scale": 1}, captureBeyondViewport=True)
        shot = self.call("Page.captureScreenshot", **params)
        return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")

    def console_errors(self) -> list[str]:
        return [
            str(e["params"])
            for e in self.events
            if e.get("method") in ("Runtime.exceptionThrown", "Log.entryAdded")
        ]

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def colors(image: Image.Image) -> dict[tuple[int, int, int], int]:
    """Pixel count of every colour in `image`."""
    counts: dict[tuple[int, int, int], int] = {}
    for count, color in image.getcolors(maxcolors=1 << 24) or []:
        counts[color] = count
    return counts


def hex_rgb(value: str) -> tuple[int, int, int]:
    value = value.lstrip("#")
    return (int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16))
