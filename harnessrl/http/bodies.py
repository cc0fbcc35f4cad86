"""HTTP edge, request bodies: read under a per-request limit, a memory budget shared by every
request in flight, and a deadline for the whole body; their CPU work done off the event loop.

In: an ASGI request's `receive`. Out: its body's bytes, taken from the budget as they arrive
(never as a `Content-Length` declares: a slow client holds only what it sent), or an error the
server maps to its own protocol's shape. `Offload` runs work over a body on a worker thread, in
two lanes by body size: small bodies on a few threads of their own, so they never queue behind
a large one; large bodies one at a time, so however many arrive they take at most one core from
the event loop and the server's other threads. Not tied to one server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.types import Receive, Scope

T = TypeVar("T")
SMALL_BODY_BYTES = 64 << 10  # at most tens of milliseconds of parsing and tokenizing
SMALL_THREADS, LARGE_THREADS = 4, 1


class BodyTooLarge(Exception):
    """The body is over the per-request limit (the rest is left unread)."""


class BudgetFull(Exception):
    """Admitting the body's next chunk would pass the budget of bodies in flight."""


class BodyTimedOut(Exception):
    """The whole body did not arrive within its deadline."""


class BodyBudget:
    """The total; shared by the requests of one event loop (no locking: one thread uses it)."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"BodyBudget limit must be a positive integer, got {limit!r}")
        self.limit = limit
        self.held = 0
        self.peak = 0  # the most ever held at once

    def hold(self) -> BodyHold:
        """One request's share, empty; give it back with `release()` or a `with` block."""
        return BodyHold(self)


class BodyHold:
    """What one request has taken from a `BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def take(self, size: int) -> bool:
        """Admit `size` more bytes; False (nothing taken) if that would pass the budget."""
        budget = self.budget
        if budget.held + size > budget.limit:
            return False
        budget.held += size
        budget.peak = max(budget.peak, budget.held)
        self.size += size
        return True

    def release(self) -> None:
        self.budget.held -= self.size
        self.size = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


async def read_body(
    scope: Scope, receive: Receive, max_bytes: int, hold: BodyHold, timeout_s: float
) -> bytes:
    """The body, chunk by chunk into `hold` (the caller releases it). Raises BodyTooLarge (a
    declared length says so, or the bytes pass it), BudgetFull, BodyTimedOut, or
    ConnectionError when the client leaves first."""
    for name, value in scope["headers"]:
        if (
            name == b"content-length"
            and value.isdigit()
            and (len(value) > 18 or int(value) > max_bytes)
        ):
            raise BodyTooLarge
    try:
        async with asyncio.timeout(timeout_s):
            return await _chunks(receive, max_bytes, hold)
    except TimeoutError:
        raise BodyTimedOut from None


async def _chunks(receive: Receive, max_bytes: int, hold: BodyHold) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected before the body was read")
        chunk = message.get("body", b"")
        if hold.size + len(chunk) > max_bytes:
            raise BodyTooLarge
        if not hold.take(len(chunk)):
            raise BudgetFull
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Offload:
    """The two lanes of one server (anyio capacity limiters over worker threads)."""

    def __init__(self) -> None:
        self.small = anyio.CapacityLimiter(SMALL_THREADS)
        self.large = anyio.CapacityLimiter(LARGE_THREADS)

    async def run(self, size: int, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` on a worker thread of the lane for a body of `size` bytes."""
        lane = self.small if size <= SMALL_BODY_BYTES else self.large
        return await anyio.to_thread.run_sync(func, *args, limiter=lane)
