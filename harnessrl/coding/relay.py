"""The one way out of a sandbox with no network: a relay to the sidecar through a Unix socket.

In: the sidecar's host:port. Out: a socket file bound into the sandbox and, inside, a listener on
127.0.0.1 at the same port that carries bytes to it; nothing else is reachable.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

# Runs inside the sandbox as `python -I -S -c INNER SOCKET PORT -- argv...`: listen first (so the
# harness never races it), fork the relay off, then become the harness. The pid namespace ends the
# relay when the harness exits. Only the standard library, no project import.
INNER = """
import os, socket, sys, threading
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
def serve(conn, path):
    up = socket.socket(socket.AF_UNIX)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        return
    threading.Thread(target=pump, args=(up, conn), daemon=True).start()
    pump(conn, up)
args = sys.argv[1:]
cut = args.index("--")
listeners = []
for spec in args[:cut]:
    path, port = spec.rsplit("=", 1)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", int(port)))
    srv.listen(128)
    listeners.append((srv, path))
if listeners and os.fork() == 0:
    def accept(srv, path):
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn, path), daemon=True).start()
    for srv, path in listeners[1:]:
        threading.Thread(target=accept, args=(srv, path), daemon=True).start()
    accept(*listeners[0])
for srv, _ in listeners:
    srv.close()
os.execvp(args[cut + 1], args[cut + 1:])
"""


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Relay:
    """Host side: accepts on a Unix socket and connects each client to (host, port) over TCP."""

    def __init__(self, path: Path, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen(128)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"relay-{port}")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection((self.host, self.port), timeout=30)
            up.settimeout(None)
        except OSError:
            conn.close()
            return
        with self._lock:
            self._conns += [conn, up]
        back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
        back.start()
        _pump(conn, up)
        back.join()
        with self._lock:
            for s in (conn, up):
                s.close()
                if s in self._conns:
                    self._conns.remove(s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._server.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.close()
            self._conns.clear()
        self.path.unlink(missing_ok=True)
