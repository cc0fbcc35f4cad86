"""The memory budget of buffered request bodies: one total for every call in flight.

In: the size of each proxied request body as it is read. Out: the bytes are admitted while the
total held by calls in flight stays within `--max-buffered-bytes`; past it the call gets a 503
with `Retry-After` instead of the sidecar growing without bound. A call holds its share until its
response is done, because its parsed and re-encoded copies live that long.
"""

from __future__ import annotations

from proxy_sidecar.errors import Unavailable
from proxy_sidecar.metrics import Metrics


class BodyBudget:
    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.held = 0
        self.peak = 0  # the most ever held at once

    def take(self, size: int) -> None:
        """Admit `size` more bytes or raise Unavailable (nothing taken)."""
        if self.held + size > self.limit:
            self.metrics.budget_refusals.inc()
            raise Unavailable(
                f"the sidecar is buffering {self.held} bytes of request bodies; {size} more would "
                f"pass its {self.limit}-byte budget (--max-buffered-bytes); retry shortly",
                retry_after_s=1,
            )
        self.held += size
        self.peak = max(self.peak, self.held)
        self.metrics.buffered_bytes.set(self.held)

    def give(self, size: int) -> None:
        self.held -= size
        self.metrics.buffered_bytes.set(self.held)
