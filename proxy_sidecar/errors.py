"""Sidecar domain errors and their OpenAI-style HTTP bodies.

In: failures raised anywhere in the sidecar. Out: `{"error": {...}}` JSON responses (4xx for bad
input, 502/503/504 for upstream or store trouble), sent only at the ASGI edge.
"""

from __future__ import annotations

from harnessrl.http.listener import error_body, send_json
from harnessrl.http.types import Send


class SidecarError(Exception):
    """An error that maps onto one HTTP status with an OpenAI-style body."""

    status = 400
    type = "invalid_request_error"
    close = False  # the connection closes after the answer (the request was not read to its end)

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s  # sent as Retry-After: when trying again makes sense


class BadRequest(SidecarError):
    pass


class Unauthorized(SidecarError):
    status = 401
    type = "authentication_error"


class NotFound(SidecarError):
    status = 404
    type = "not_found_error"


class Conflict(SidecarError):
    status = 409
    type = "conflict_error"


class RequestTimeout(SidecarError):
    """The request body did not arrive within --body-timeout-s."""

    status = 408
    type = "timeout_error"
    close = True


class BodyTooLarge(SidecarError):
    status = 413


class NoUpstream(SidecarError):
    """Every upstream refused the connection or answered 502/503/504 before any byte."""

    status = 502
    type = "upstream_error"


class Unavailable(SidecarError):
    """Paused longer than the bounded wait, or the trace store could not record the call."""

    status = 503
    type = "service_unavailable"


class UpstreamTimeout(SidecarError):
    status = 504
    type = "upstream_timeout"


def error_headers(err: SidecarError) -> list[tuple[bytes, bytes]]:
    """The headers an error answer carries beside its body, in any dialect."""
    headers = []
    if err.retry_after_s is not None:
        headers.append((b"retry-after", str(err.retry_after_s).encode()))
    if err.close:
        headers.append((b"connection", b"close"))
    return headers


async def send_error(send: Send, err: SidecarError) -> None:
    body = error_body(err.status, err.message, err.type, err.param)
    await send_json(send, err.status, body, error_headers(err))
