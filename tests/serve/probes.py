"""Probes for the server-hardening tests: a /health poller and raw-socket HTTP."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx


class HealthPoll:
    """Polls `GET /health` on its own connection while the block runs; keeps every latency.

    A request that blocked the server's event loop shows up as one long latency (or a timeout,
    recorded as status 0).
    """

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.latencies.append(time.monotonic() - t0)
                self.statuses.append(status)
                time.sleep(0.02)

    def __enter__(self) -> HealthPoll:
        self._thread.start()
        while not self.latencies:  # the poller is answering before the probe starts
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    @property
    def worst(self) -> float:
        return max(self.latencies)


def connect(url: str, timeout_s: float = 10.0) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never)."""
    sock.settimeout(timeout_s)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response."""
    line = response.split(b"\r\n", 1)[0]
    if not line.startswith(b"HTTP/1.1 "):
        raise AssertionError(f"not an HTTP response: {response[:200]!r}")
    return int(line.split()[1])


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]
