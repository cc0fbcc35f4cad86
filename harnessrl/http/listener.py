"""HTTP edge shared by the embedded server and the sidecar: uvicorn with bounded request heads.

Also the JSON responses both servers' pure-ASGI handlers send, errors in the OpenAI/vLLM shape.

In: an ASGI app, a bind address and `HttpLimits`. Out: a `uvicorn.Config` whose connections are
refused (431) when their request head outgrows `max_header_bytes`, and closed (408) when a head
takes longer than `read_timeout_s` to arrive or a body pauses that long, so slow clients
(slowloris) cannot pin connections and memory forever. uvicorn's httptools protocol has neither.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from harnessrl.http.types import Send


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits applied before the app sees a request."""

    max_header_bytes: int = 64 * 1024  # request line + headers
    read_timeout_s: float = 30.0  # whole head, and the longest pause inside a body

    def __post_init__(self) -> None:
        size = self.max_header_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1024:
            raise ValueError(f"max_header_bytes must be an integer >= 1024, got {size!r}")
        timeout = self.read_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"read_timeout_s must be a number of seconds, got {timeout!r}")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"read_timeout_s must be finite and > 0, got {timeout!r}")


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI/vLLM error body (`kind` is its `type`), from both servers alike."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def send_body(
    send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    """One whole response from a pure-ASGI handler: `headers`, its length, then `body`."""
    start = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, body: Any, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    json_type = (b"content-type", b"application/json")
    await send_body(send, status, orjson.dumps(body), [json_type, *headers])


def error_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response in vLLM's error shape that closes the connection."""
    phrase = HTTPStatus(status).phrase
    body = orjson.dumps(error_body(status, message, phrase))
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a head size cap and head/body read deadlines.

    A head still arriving is measured as the bytes fed to the parser, so the parser never
    buffers more than the limit plus one socket read; a complete head is measured as parsed.
    """

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_seen = False  # some byte of the current head has arrived
        self._in_body = False
        self._refused = False  # answered by the listener itself: ignore whatever follows
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # an idle new connection is a head that never arrives

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        elif self._in_body:
            self._arm()  # the body moved: its pause timer starts again
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(431, self._too_large())

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        if not self._in_head:  # a keep-alive connection's next request: a fresh head deadline
            self._in_head, self._head_bytes = True, 0
            self._arm()
        self._head_seen = True

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        # request line (method, spaces, version: under 20 bytes) + "name: value\r\n" each
        size = len(self.url) + 20 + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.limits.max_header_bytes:
            return self._refuse(431, self._too_large())
        self._in_head, self._in_body = False, True
        self._arm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_body = self._head_seen = False
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers bytes it cannot parse as HTTP in plain text; both servers speak JSON.
        self._refuse(400, msg)

    def _too_large(self) -> str:
        return f"request line and headers exceed {self.limits.max_header_bytes} bytes"

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._refused:
            return
        if self._in_body and self.flow.read_paused:
            self._arm()  # the app has not read what it was sent: the client is not the slow one
            return
        if self._in_head and not self._head_seen:
            self.transport.close()  # nothing sent: a plain idle close, like keep-alive expiry
            return
        if self._in_head or self._in_body:
            what = "request headers" if self._in_head else "request body"
            self._refuse(408, f"{what} not received within {self.limits.read_timeout_s} s")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        self._refused = True
        # While a head arrives, `cycle` is still the previous request's (answered) one.
        if not self._in_head and self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # the app already answered part of it; just hang up
            return
        self.transport.write(error_response(status, message))
        self.transport.close()


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpTools]:
    """A `LimitedHttpTools` subclass bound to `limits` (uvicorn builds one per connection)."""
    if not isinstance(limits, HttpLimits):
        raise TypeError(f"limits must be an HttpLimits, got {type(limits).__name__}")
    chosen = limits

    class Bound(LimitedHttpTools):
        limits = chosen

    return Bound


def server_config(
    app: Any, *, host: str, port: int, limits: HttpLimits, **options: Any
) -> uvicorn.Config:
    """uvicorn's config for `app` with the limited protocol; `options` are uvicorn's own."""
    if "http" in options:
        raise ValueError("server_config sets uvicorn's `http` protocol itself; do not pass it")
    # Neither server speaks WebSocket: an upgrade request is an ordinary HTTP request to the app
    # (a JSON answer), not uvicorn's empty 403 once a WebSocket library happens to be installed.
    options.setdefault("ws", "none")
    return uvicorn.Config(app, host=host, port=port, http=limited_protocol(limits), **options)
