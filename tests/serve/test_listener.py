"""The bounded HTTP listener, over raw sockets: an oversized request head is refused with 431, a
head that does not arrive in time (slowloris) or a body that stalls is closed with 408, for both
servers: the embedded one (conftest: 8 KiB heads, 1 s) and the sidecar, as `python -m
proxy_sidecar` and as its app under the same listener with a short deadline.

Deadlines are checked from below (the connection survives most of the deadline) and from above
with room for a loaded machine (closed well before the several-times-longer bound).
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
import uvicorn
from probes import body_of, connect, read_until_closed, status_of

from harnessrl.fleet.sidecar import SidecarProcess
from harnessrl.http.listener import HttpLimits, limited_protocol, server_config
from proxy_sidecar.app import build_app
from proxy_sidecar.config import SidecarConfig

HEAD = b"GET /health HTTP/1.1\r\nHost: test\r\n"


def _huge_head_is_refused(url: str, limit: int) -> None:
    sock = connect(url)
    sock.sendall(HEAD + b"x-big: " + b"a" * (limit + 100) + b"\r\n\r\n")
    response = read_until_closed(sock, timeout_s=10)
    assert status_of(response) == 431, response[:300]
    error = orjson.loads(body_of(response))["error"]
    assert error["code"] == 431 and f"exceed {limit} bytes" in error["message"]


def _endless_head_is_cut_short(url: str) -> int:
    """Stream a 100 MB header; return how many bytes went out before the server hung up."""
    sock = connect(url)
    sent, chunk = 0, b"a" * (1 << 16)
    sock.sendall(HEAD + b"x-big: ")
    try:
        while sent < 100 << 20:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    return sent


def test_embedded_server_refuses_an_oversized_head(bounded_server):
    _huge_head_is_refused(bounded_server.url, 8 << 10)
    # Kernel socket buffers absorb a few MB at most; the server itself stops at 8 KiB.
    assert _endless_head_is_cut_short(bounded_server.url) < 32 << 20
    fits = httpx.get(bounded_server.url + "/health", headers={"x-fits": "a" * 6000}, timeout=30)
    assert fits.status_code == 200


def test_a_stalled_head_is_closed_with_408_after_the_deadline(bounded_server):
    sock = connect(bounded_server.url)
    t0 = time.monotonic()
    sock.sendall(HEAD)  # and never the blank line
    response = read_until_closed(sock, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert status_of(response) == 408 and b"request headers" in response
    assert 0.9 <= elapsed < 6.0, elapsed


def test_a_trickled_head_meets_the_same_deadline(bounded_server):
    """Slowloris: one byte every 0.2 s keeps a connection busy but never finishes the head."""
    sock = connect(bounded_server.url)
    t0 = time.monotonic()
    closed_at = None
    for byte in HEAD * 4:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - t0
            break
        sock.settimeout(0.2)
        try:
            if sock.recv(4096):  # the server answered: it gave up on this head
                closed_at = time.monotonic() - t0
                break
        except TimeoutError:
            continue
    assert closed_at is not None and 0.9 <= closed_at < 6.0, closed_at


def test_an_idle_connection_is_closed_and_a_stalled_body_gets_408(bounded_server):
    idle = connect(bounded_server.url)
    t0 = time.monotonic()
    assert read_until_closed(idle, timeout_s=30) == b""  # nothing sent: closed without a word
    assert 0.9 <= time.monotonic() - t0 < 6.0
    body = connect(bounded_server.url)
    body.sendall(
        b"POST /tokenize HTTP/1.1\r\nHost: test\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n" + b'{"prompt": "'
    )
    response = read_until_closed(body, timeout_s=30)
    assert status_of(response) == 408 and b"request body" in response


def test_keep_alive_connection_gets_a_fresh_deadline_per_request(bounded_server):
    sock = connect(bounded_server.url)
    for _ in range(3):  # complete requests spaced under the deadline keep the connection
        sock.sendall(HEAD + b"\r\n")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
    t0 = time.monotonic()
    sock.sendall(HEAD)  # then a head that stalls
    response = read_until_closed(sock, timeout_s=30)
    assert status_of(response) == 408 and 0.9 <= time.monotonic() - t0 < 6.0


def test_the_sidecar_process_refuses_an_oversized_head(bounded_server, tmp_path):
    config = SidecarConfig(
        upstreams=(bounded_server.url,),
        store=f"sqlite:///{tmp_path / 'traces.db'}",
        port=0,
        model="tiny",
        log_calls=False,
    )
    sidecar = SidecarProcess(config, tmp_path / "sidecar.log")
    try:
        _huge_head_is_refused(sidecar.url, HttpLimits().max_header_bytes)
        assert _endless_head_is_cut_short(sidecar.url) < 32 << 20
        assert sidecar.client.get("/health").status_code == 200
    finally:
        sidecar.stop()


@pytest.fixture
def sidecar_app_server(bounded_server, tmp_path):
    """The sidecar's app under the shared listener with a 0.5 s deadline, on a thread."""
    config = SidecarConfig(upstreams=(bounded_server.url,), store=f"sqlite:///{tmp_path}/t.db")
    listener = server_config(
        build_app(config),
        host="127.0.0.1",
        port=0,
        limits=HttpLimits(max_header_bytes=4096, read_timeout_s=0.5),
        log_level="warning",
    )
    server = uvicorn.Server(listener)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_the_sidecar_app_closes_slow_heads_under_the_same_listener(sidecar_app_server):
    assert httpx.get(sidecar_app_server + "/health", timeout=30).status_code == 200
    sock = connect(sidecar_app_server)
    t0 = time.monotonic()
    sock.sendall(HEAD)
    response = read_until_closed(sock, timeout_s=30)
    assert status_of(response) == 408 and 0.4 <= time.monotonic() - t0 < 5.0
    _huge_head_is_refused(sidecar_app_server, 4096)


def _garbage_gets_a_json_400(url: str) -> None:
    sock = connect(url)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    response = read_until_closed(sock, timeout_s=10)
    assert status_of(response) == 400, response[:300]
    assert b"content-type: application/json" in response.lower()
    error = orjson.loads(body_of(response))["error"]
    assert error["code"] == 400 and error["message"] == "Invalid HTTP request received."


def test_bytes_that_are_not_http_get_a_json_400_from_both_servers(
    bounded_server, sidecar_app_server
):
    _garbage_gets_a_json_400(bounded_server.url)
    _garbage_gets_a_json_400(sidecar_app_server)


def test_a_websocket_upgrade_is_answered_as_http_json(bounded_server, sidecar_app_server):
    for url, path in ((bounded_server.url, "/v1/models"), (sidecar_app_server, "/v1/models")):
        sock = connect(url)
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
        )
        response = read_until_closed(sock, timeout_s=30)
        assert status_of(response) != 403, response[:300]
        assert b"application/json" in response.lower(), response[:300]
        orjson.loads(body_of(response))


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_header_bytes"):
        HttpLimits(max_header_bytes=10)
    with pytest.raises(ValueError, match="read_timeout_s"):
        HttpLimits(read_timeout_s=float("nan"))
    with pytest.raises(TypeError, match="HttpLimits"):
        limited_protocol(30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`http`"):
        server_config(None, host="127.0.0.1", port=0, limits=HttpLimits(), http="h11")
