"""A TCP proxy in front of a server that cuts its open connections at a chosen byte.

`CutProxy(host, port)` listens on 127.0.0.1:`proxy.port` and forwards every connection. Armed with
`cut_after(direction, n)`, it forwards `n` more bytes that way ("up": client to server, "down":
server to client) and then cuts that connection: the client's side is closed at once; the server
is sent end-of-file after exactly the bytes forwarded, so it acts on a message it got whole (a
COMMIT it received is committed) and never sees the rest. `cut_at(pattern, before)` cuts just
before or just after the first `pattern` sent up. Connections opened after a cut pass untouched.

A cut going up closes the client's side *before* the last bytes go to the server: the server's
answer to them (a COMMIT's "done") must never reach the client, or the client would see a write
succeed and only find the connection gone at its next statement. `cuts` counts a cut when it is
decided, so it is up to date once the client has seen the cut.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CutProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._left: dict[str, int] = {}  # direction → bytes still to forward before the cut
        self._pattern: tuple[bytes, bool] | None = None
        self.sent = {"up": 0, "down": 0}  # bytes forwarded each way, for sizing cut points
        self.cuts = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def cut_after(self, direction: str, n: int) -> None:
        assert direction in ("up", "down") and n >= 0
        with self._lock:
            self._left = {direction: n}
            self._pattern = None

    def cut_at(self, pattern: bytes, before: bool) -> None:
        with self._lock:
            self._left = {}
            self._pattern = (pattern, before)

    def disarm(self) -> None:
        with self._lock:
            self._left = {}
            self._pattern = None

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _start(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._start(self._pump, client, server, "up", client, server)
            self._start(self._pump, server, client, "down", client, server)

    def _take(self, direction: str, data: bytes) -> tuple[bytes, bool]:
        """What of `data` to forward, and whether to cut after it."""
        with self._lock:
            if direction == "up" and self._pattern is not None:
                pattern, before = self._pattern
                at = data.find(pattern)
                if at >= 0:
                    self._pattern = None
                    self.cuts += 1
                    return data[: at if before else at + len(pattern)], True
            left = self._left.get(direction)
            if left is None:
                return data, False
            if len(data) > left:
                self._left = {}
                self.cuts += 1
                return data[:left], True
            self._left[direction] = left - len(data)
            return data, False

    def _pump(
        self, src: socket.socket, dst: socket.socket, direction: str, client: socket.socket,
        server: socket.socket,
    ) -> None:  # fmt: skip
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                data, cut = self._take(direction, data)
                if cut and direction == "up":  # no answer to these bytes may reach the client
                    with contextlib.suppress(OSError):
                        client.shutdown(socket.SHUT_RDWR)
                if data:
                    dst.sendall(data)
                    self.sent[direction] += len(data)
                if cut:
                    with contextlib.suppress(OSError):
                        client.shutdown(socket.SHUT_RDWR)
                    with contextlib.suppress(OSError):
                        server.shutdown(socket.SHUT_WR)
                    break
        except OSError:
            pass
        finally:
            if direction == "up":  # the client is done or cut: the server gets end-of-file
                with contextlib.suppress(OSError):
                    server.shutdown(socket.SHUT_WR)
            else:
                # Read the server's answer to its end, so that what it was sent is never reset
                # away by closing a socket with unread data, then close both sides.
                with contextlib.suppress(OSError):
                    while server.recv(65536):
                        pass
                client.close()
                server.close()
