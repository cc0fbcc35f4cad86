"""Serving stage, request bodies: read under the server's `BodyLimits` (harnessrl.http.bodies), then
JSON-decoded on a worker thread.

In: the ASGI request. Out: the decoded body, or a `RequestError` in vLLM's shape: 413 over
`max_body_bytes`, 503 past `max_buffered_bytes`, 408 past `body_timeout_s`, 400 for bad JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Receive, Scope

from harnessrl.http import bodies
from harnessrl.http.bodies import (
    BodyBudget,
    BodyHold,
    BodyTimedOut,
    BodyTooLarge,
    BudgetFull,
    Offload,
)
from harnessrl.serve.config import ServeConfig
from harnessrl.serve.protocol import RequestError

# The rest of the body is never read, so the connection cannot carry another request.
CLOSE = {"connection": "close"}


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int  # one body
    timeout_s: float  # one whole body, however steadily it arrives
    budget: BodyBudget  # every body in flight

    @classmethod
    def of(cls, config: ServeConfig) -> BodyLimits:
        budget = BodyBudget(config.max_buffered_bytes)
        return cls(config.max_body_bytes, config.body_timeout_s, budget)


async def read_body(scope: Scope, receive: Receive, limits: BodyLimits, hold: BodyHold) -> bytes:
    """The request body, read into `hold` (the caller releases it)."""
    try:
        return await bodies.read_body(scope, receive, limits.max_body_bytes, hold, limits.timeout_s)
    except BodyTooLarge:
        message = f"the request body is over this server's {limits.max_body_bytes}-byte limit"
        raise RequestError(f"{message} (max_body_bytes)", status=413, headers=CLOSE) from None
    except BudgetFull:
        raise RequestError(
            f"the server is holding {limits.budget.held} bytes of request bodies in flight; this "
            f"one would pass its {limits.budget.limit}-byte budget (max_buffered_bytes); retry "
            "shortly",
            status=503,
            headers={"retry-after": "1", **CLOSE},
        ) from None
    except BodyTimedOut:
        raise RequestError(
            f"the request body did not arrive within {limits.timeout_s} s (body_timeout_s)",
            status=408,
            headers=CLOSE,
        ) from None


def decode_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from err


async def read_json(
    scope: Scope, receive: Receive, limits: BodyLimits, hold: BodyHold, offload: Offload
) -> Any:
    """The body, decoded on a worker thread (`offload`'s lane for its size)."""
    try:
        raw = await read_body(scope, receive, limits, hold)
    except ConnectionError as err:  # the answer goes nowhere; only the shape must be right
        raise RequestError(str(err)) from err
    return await offload.run(len(raw), decode_json, raw)
