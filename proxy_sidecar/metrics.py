"""Prometheus metrics and the one structured log line per call, served or refused.

In: the outcome of each proxied call. Out: counters/histograms on `/metrics` (own registry per app,
so several sidecars can live in one process) and a JSON log line without prompt or output content.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from harnessrl.traces.schema import CallRecord

call_log = logging.getLogger("proxy_sidecar.calls")

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "sidecar_calls", "Proxied model calls", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "sidecar_call_latency_seconds",
            "Call latency seen by the harness",
            ["route"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "sidecar_store_write_seconds",
            "Time to commit a call record",
            buckets=_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("sidecar_in_flight", "Calls being proxied now", registry=r)
        self.upstream_errors = Counter(
            "sidecar_upstream_errors", "Upstream failures", ["kind"], registry=r
        )
        self.store_errors = Counter(
            "sidecar_store_errors", "Call records the store refused", registry=r
        )
        self.capture_errors = Counter(
            "sidecar_capture_errors", "Responses without usable token ids/logprobs", registry=r
        )
        self.buffered_bytes = Gauge(
            "sidecar_buffered_request_bytes",
            "Request body bytes held by calls in flight",
            registry=r,
        )
        self.budget_refusals = Counter(
            "sidecar_budget_refusals",
            "Calls refused (503) because --max-buffered-bytes was reached",
            registry=r,
        )
        self.paused = Gauge("sidecar_paused", "1 while new calls are held", registry=r)
        self.policy_version = Gauge("sidecar_policy_version", "Current policy version", registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, call: CallRecord, seq: int | None, stream: bool, enabled: bool) -> None:
        route = call.endpoint.value
        self.calls.labels(route, str(call.status)).inc()
        self.latency.labels(route).observe(call.latency_ms / 1000.0)
        if call.error is not None and call.error.startswith("capture:"):
            self.capture_errors.inc()
        if enabled and call_log.isEnabledFor(logging.INFO):
            line: dict[str, Any] = {
                "event": "call",
                "rollout": call.rollout_id,
                "seq": seq,
                "route": route,
                "stream": stream,
                "status": call.status,
                "latency_ms": round(call.latency_ms, 3),
                "upstream": call.upstream,
                "policy_version": call.policy_version,
                "prompt_tokens": len(call.prompt_token_ids),
                "completion_tokens": sum(len(c.token_ids) for c in call.choices),
                "choices": len(call.choices),
                "error": call.error,
            }
            call_log.info(orjson.dumps(line).decode())

    @staticmethod
    def refused(rollout: str, route: str, status: int, message: str) -> None:
        """A call the sidecar answered itself before any upstream saw it: no store holds it, so
        its line is written whatever `log_calls` says."""
        line = {"event": "refused", "rollout": rollout[:256], "route": route, "status": status,
                "error": message[:500]}  # fmt: skip
        call_log.info(orjson.dumps(line).decode())
