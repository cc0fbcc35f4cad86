"""The fault-injection proxy itself: a cut after a message lets the server act on it, and never
lets the server's answer reach the client (else a cut COMMIT would look committed to the client).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from tcp_cut import CutProxy


@pytest.fixture
def echo() -> Iterator[tuple[int, list[bytes]]]:
    """A server that answers every message at once with the same bytes; `got` is what it read."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                got.append(data)
                conn.sendall(data)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1], got
    listener.close()


def answer(client: socket.socket) -> bytes:
    """Everything the client reads until the proxy closes its side."""
    client.settimeout(10)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while data := client.recv(65536):
            out += data
    return out


def test_a_cut_after_a_message_delivers_it_and_never_its_answer(
    echo: tuple[int, list[bytes]],
) -> None:
    port, got = echo
    proxy = CutProxy("127.0.0.1", port)
    try:
        for i in range(40):  # the answer used to win the race now and then
            with socket.create_connection(("127.0.0.1", proxy.port)) as client:
                client.sendall(b"hello")
                assert client.recv(5) == b"hello"  # untouched before it is armed
                proxy.cut_at(b"COMMIT", before=False)
                client.sendall(f"COMMIT{i}".encode()[:6])
                assert answer(client) == b""
                assert proxy.cuts == i + 1
        # The server got each cut message whole (its last read may still be on its way).
        deadline = time.monotonic() + 10
        while got.count(b"COMMIT") < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got.count(b"COMMIT") == 40
    finally:
        proxy.close()


def test_a_cut_before_a_message_never_delivers_it(echo: tuple[int, list[bytes]]) -> None:
    port, got = echo
    proxy = CutProxy("127.0.0.1", port)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as client:
            proxy.cut_at(b"COMMIT", before=True)
            client.sendall(b"COMMIT")
            assert answer(client) == b"" and proxy.cuts == 1
        with socket.create_connection(("127.0.0.1", proxy.port)) as client:
            client.sendall(b"after")  # a connection opened after the cut passes untouched
            assert client.recv(5) == b"after"
        assert b"COMMIT" not in b"".join(got)
    finally:
        proxy.close()
