"""Calls to the Kubernetes API server: which failures are worth another try, and how long to wait.

In: the exceptions the official client raises. Out: a verdict (transient or not), a delay that
honours the server's `Retry-After`, and a one-line description for a run's stderr.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Answers the API server gives when it is busy or restarting: the request may succeed later.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is waited for this long, then asked again


def transport_errors(*more: type[Exception]) -> tuple[type[Exception], ...]:
    """Failures below HTTP (refused or reset connections, timeouts, a stream cut mid-chunk),
    and `more`.

    urllib3's own errors (MaxRetryError, ProtocolError, ReadTimeoutError, ...) are not OSErrors,
    so both families are named."""
    from urllib3.exceptions import HTTPError

    return (OSError, HTTPError, *more)


def retry_after_s(err: Any) -> float | None:
    """The server's `Retry-After` (seconds or an HTTP date) of an ApiException, capped; None
    when it sent none."""
    headers = getattr(err, "headers", None) or {}
    value = str(headers.get("Retry-After") or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def retry_delay(err: Any, attempt: int, base_s: float = 0.2) -> float:
    """Seconds before try `attempt + 1`: what the server asked for, else exponential backoff."""
    asked = retry_after_s(err)
    return asked if asked is not None else base_s * 2**attempt


def describe(err: Any) -> str:
    """`STATUS REASON: message` of an ApiException (the message from its Status body)."""
    try:
        message = str(json.loads(err.body).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        message = str(err.body or "")
    return f"{err.status} {err.reason}: {message}"


def default_api_client() -> Any:
    """In a pod: its service account; elsewhere: the user's kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def with_retries(call: Callable[[], T], tries: int = 4) -> T:
    """`call()`, tried again after a transient status or a transport error (Retry-After
    honoured); the last failure is raised."""
    from kubernetes.client.exceptions import ApiException

    for attempt in range(tries - 1):
        try:
            return call()
        except ApiException as err:
            if err.status not in TRANSIENT_STATUS:
                raise
            time.sleep(retry_delay(err, attempt))
        except transport_errors():
            time.sleep(retry_delay(None, attempt))
    return call()
