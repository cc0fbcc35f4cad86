"""The trainer's side of `weight_push=http`: its exported folders, served over HTTP.

In: the export root (one `vNNNNNN` folder per pushed version) and the address the servers reach
the trainer at. Out: `GET /vNNNNNN/FILE` with a bearer token, answered with sendfile from the
trainer's own disk, one thread per connection: every replica fetches its copy at once, instead of
each re-reading the folder from shared storage in turn.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (PORT 0: a free one) → (host, port); "" → 127.0.0.1 on a free port."""
    host, _, port = (address or "127.0.0.1:0").rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"rollout.weight_push_address must be HOST:PORT (the trainer's address as the servers "
            f"reach it, e.g. the pod IP and a free port), got {address!r}"
        )
    return host.strip("[]"), int(port)


class ExportServer:
    """Serves the folders under `root` until `stop()`; `fetch_fields(folder)` is what a server
    needs to fetch one (its URL, file names and sizes, the token)."""

    def __init__(self, root: Path, address: str = "") -> None:
        self.root = root.resolve()
        host, port = parse_address(address)
        self.token = secrets.token_hex(16)
        bind = host if host in LOOPBACK else "0.0.0.0"  # a pod's IP is reached on every interface
        self._server = ThreadingHTTPServer((bind, port), _handler(self))
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(0.1,),
            daemon=True,  # quick to stop
        )
        self._thread.start()

    def fetch_fields(self, folder: Path) -> dict[str, Any]:
        folder = folder.resolve()
        if folder.parent != self.root:
            raise ValueError(f"{folder} is not a folder of the export root {self.root}")
        files = sorted(p for p in folder.iterdir() if p.is_file())
        return {
            "url": f"http://{self.host}:{self.port}/{folder.name}",
            "files": [[p.name, p.stat().st_size] for p in files],
            "token": self.token,
        }

    def file(self, path: str) -> Path | None:
        """The served file a request path names: ROOT/FOLDER/FILE exactly, nothing else."""
        parts = unquote(path.split("?", 1)[0]).strip("/").split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") for p in parts):
            return None
        target = self.root / parts[0] / parts[1]
        return target if target.is_file() and target.parent.parent == self.root else None

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(export: ExportServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # one line per shard is noise in the run log
            pass

        def do_GET(self) -> None:
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), export.token.encode()
            ):
                return self._plain(401, "missing or wrong bearer token for the trainer's exports")
            target = export.file(self.path)
            if target is None:
                return self._plain(404, f"no exported file {self.path[:200]}")
            with target.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.flush()
                sent = 0
                while sent < size:  # zero-copy from the page cache to the socket
                    n = os.sendfile(self.connection.fileno(), f.fileno(), sent, size - sent)
                    if n == 0:
                        break
                    sent += n

        def _plain(self, status: int, text: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
