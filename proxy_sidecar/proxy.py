"""The hot path: OpenAI routes proxied to an upstream, every call recorded before it completes.

In: a harness's chat/completions request (rollout id from the path or the default). Out: the
upstream's response, byte for byte, whose final bytes leave only after the call record is
committed; so any response a client fully received is in the store, even after `kill -9`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from harnessrl.http.listener import send_body
from harnessrl.http.types import Receive, Scope, Send
from harnessrl.traces.schema import EndpointKind, policy_version_error
from proxy_sidecar.capture import SSETee, build_record, decode_body, sse_error_event
from proxy_sidecar.control import SidecarState, parse_object, read_body, rollout_of
from proxy_sidecar.errors import (
    BadRequest,
    NoUpstream,
    SidecarError,
    Unavailable,
    UpstreamTimeout,
    send_error,
)
from proxy_sidecar.upstream import UpstreamFailure, UpstreamResponse

# Never forwarded: connection-level headers, the length we recompute, and compression (the
# sidecar must read the upstream body, so it asks for identity encoding).
_HOP_REQUEST = frozenset(
    b"host content-length connection keep-alive transfer-encoding te upgrade "
    b"proxy-connection expect accept-encoding content-type".split()
)
_HOP_RESPONSE = frozenset(b"content-length connection keep-alive transfer-encoding".split())
_POLICY_HEADER = b"x-harnessrl-policy-version"

log = logging.getLogger("proxy_sidecar.proxy")


def refuse(state: SidecarState, scope: Scope, route: str, err: SidecarError) -> None:
    """Log a call refused before it reached an upstream (its answer is the caller's to send)."""
    rollout = scope.get("path_params", {}).get("rollout_id", state.config.default_rollout)
    state.metrics.refused(str(rollout), route, err.status, err.message)


def watch_disconnect(
    receive: Receive, resp: UpstreamResponse
) -> tuple[asyncio.Event, asyncio.Task[None]]:
    """While a stream is relayed: when the client leaves, set the event and abort the upstream
    request (the server stops generating). Cancel the task when the stream ends."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        resp.abort()

    return gone, asyncio.create_task(watch())


async def store_call(state: SidecarState, record: Any, stream: bool) -> int | None:
    """Commit the record; None if the store refused it (counted and logged)."""
    t0 = time.perf_counter()
    try:
        seq: int = await state.recorder.record(record)
    except Exception:
        state.metrics.store_errors.inc()
        state.metrics.observe(record, None, stream, state.config.log_calls)
        return None
    state.metrics.overhead.observe(time.perf_counter() - t0)
    state.metrics.observe(record, seq, stream, state.config.log_calls)
    return seq


def rewrite(request: dict[str, Any], endpoint: EndpointKind, state: SidecarState) -> bytes:
    """The body to send: the server's token ids and sampled-token logprobs asked for, the mode's
    overrides applied. BadRequest if it cannot be re-encoded (nor so recorded)."""
    request["return_token_ids"] = True
    if endpoint is EndpointKind.CHAT:
        request["logprobs"] = True
    else:
        lp = request.get("logprobs")
        if isinstance(lp, bool) or not isinstance(lp, int) or lp < 1:
            request["logprobs"] = 1
    if state.config.model is not None:
        request["model"] = state.config.model
    overrides = state.config.overrides(state.mode)
    if overrides:
        request.update(overrides)
    try:
        return orjson.dumps(request)
    except TypeError as err:
        # orjson re-encodes at most 254 levels of nesting (it parses 1024). The trace store
        # encodes the same way, so such a call could not be recorded: refused, not forwarded.
        raise BadRequest(
            f"request body cannot be forwarded and recorded ({err}): JSON nested more than 254 "
            "levels deep is not supported"
        ) from err


def upstream_headers(scope: Scope) -> list[tuple[str, str]]:
    # Said explicitly: httpx would otherwise offer gzip, and the body must be readable here.
    out = [("content-type", "application/json"), ("accept-encoding", "identity")]
    for name, value in scope["headers"]:
        if name not in _HOP_REQUEST:
            out.append((name.decode("latin-1"), value.decode("latin-1")))
    return out


def response_headers(resp: UpstreamResponse) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
    """Headers for the client, and the raw policy-version header of the upstream (if any)."""
    headers, version = [], None
    for name, value in resp.headers:
        low = name.lower()
        if low in _HOP_RESPONSE:
            continue
        if low == _POLICY_HEADER:
            version = value
        headers.append((low, value))
    return headers, version


def reported_version(raw: bytes | None) -> int | None:
    """The upstream's policy version header as a storable version; None if absent or unusable."""
    if raw is None or not raw.strip().isdigit():
        return None
    version = int(raw)
    return None if policy_version_error(version) else version


def read_failure(err: UpstreamFailure) -> SidecarError:
    """What the client gets when the upstream failed after its headers: 504 if it went silent."""
    if err.timeout:
        return UpstreamTimeout(f"upstream timed out while answering: {err}")
    return NoUpstream(f"upstream failed while answering: {err}")


class ProxyEndpoint:
    """Pure-ASGI handler of one OpenAI route (chat or completions)."""

    def __init__(self, state: SidecarState, endpoint: EndpointKind, path: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.path = path
        self._warned: set[str] = set()  # upstreams already reported for a bad version header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.time()
        state, config = self.state, self.state.config
        try:
            raw = await read_body(
                scope, receive, config.max_body_bytes, state.budget, config.body_timeout_s
            )
        except SidecarError as err:
            await self._refuse(scope, send, err)
            return
        size = len(raw)
        try:  # the body's bytes stay taken from the budget until the call is done
            try:
                request = parse_object(raw)
                del raw  # from here on the parsed copy is all the call needs
                rollout_id = rollout_of(scope, config.default_rollout)
                await state.enter()
            except SidecarError as err:
                await self._refuse(scope, send, err)
                return
            try:
                await self._forward(scope, receive, send, request, rollout_id, started)
            finally:
                state.leave()
        finally:
            state.budget.give(size)

    async def _refuse(self, scope: Scope, send: Send, err: SidecarError) -> None:
        refuse(self.state, scope, self.endpoint.value, err)
        await send_error(send, err)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: dict[str, Any],
        rollout_id: str,
        started: float,
    ) -> None:
        state = self.state
        try:  # after the pause: the mode's overrides are those of the weights that will answer
            body = rewrite(request, self.endpoint, state)
        except SidecarError as err:
            await self._refuse(scope, send, err)
            return
        path = self.path + (
            "?" + scope["query_string"].decode("latin-1") if scope["query_string"] else ""
        )
        common: dict[str, Any] = dict(
            endpoint=self.endpoint, rollout_id=rollout_id, started=started, request=request
        )
        try:
            upstream, resp = await state.pool.request(
                rollout_id, "POST", path, upstream_headers(scope), body
            )
            del body  # sent (retries happen inside request()); the memory can go now
        except SidecarError as err:
            state.metrics.upstream_errors.labels("connect").inc()
            record = build_record(
                status=err.status,
                body=None,
                upstream="",
                policy_version=state.policy_version,
                error=f"upstream: {err.message}",
                **common,
            )
            await store_call(self.state, record, stream=False)
            await send_error(send, err)
            return
        headers, raw_version = response_headers(resp)
        common["upstream"] = upstream.url
        common["policy_version"] = self._served_version(raw_version, upstream.url)
        stream = any(n == b"content-type" and b"text/event-stream" in v for n, v in headers)
        if stream:
            await self._stream(receive, send, resp, headers, common)
        else:
            await self._buffered(send, resp, headers, common)

    def _served_version(self, raw: bytes | None, upstream: str) -> int | None:
        """The upstream's version header if usable, else the control API's version of it."""
        version = reported_version(raw)
        if version is not None:
            return version
        if raw is not None and upstream not in self._warned:
            # Not a version the stores can keep: the control API's value stands in, as for a
            # server that sends no header; said once per upstream.
            self._warned.add(upstream)
            log.warning(
                "upstream %s sent %s: %r, not an integer in [0, 2**63 - 1]; recording the "
                "control API's policy version instead",
                upstream,
                _POLICY_HEADER.decode(),
                raw[:40],
            )
        return self.state.version_of(upstream)

    async def _buffered(
        self, send: Send, resp: UpstreamResponse, headers: list[Any], common: dict[str, Any]
    ) -> None:
        try:
            raw = await resp.read()
        except UpstreamFailure as err:
            self.state.metrics.upstream_errors.labels("read").inc()
            failure = read_failure(err)
            record = build_record(
                status=failure.status, body=None, error=f"upstream: {err}", **common
            )
            await store_call(self.state, record, stream=False)
            await send_error(send, failure)
            return
        record = build_record(status=resp.status, body=decode_body(raw), **common)
        if await store_call(self.state, record, stream=False) is None:
            await send_error(send, Unavailable("trace store could not record the call"))
            return
        await send_body(send, resp.status, raw, headers)

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        resp: UpstreamResponse,
        headers: list[Any],
        common: dict[str, Any],
    ) -> None:
        gone, watcher = watch_disconnect(receive, resp)
        tee = SSETee(self.endpoint)
        error: str | None = None
        failure: SidecarError | None = None
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        try:
            async for chunk in resp.chunks():
                out = tee.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except Exception as err:
            if gone.is_set():
                error = "client disconnected"
            elif isinstance(err, UpstreamFailure):
                error, failure = f"upstream: {err}", read_failure(err)
                self.state.metrics.upstream_errors.labels("stream").inc()
            else:
                raise
        finally:
            watcher.cancel()
            await resp.close()
        assembled = tee.assembler
        if error is None and assembled.error is not None:
            error = f"upstream stream error: {assembled.error}"
        error = error or tee.capture_error
        record = build_record(status=resp.status, body=assembled.body(), error=error, **common)
        stored = await store_call(self.state, record, stream=True)
        if gone.is_set():
            return
        tail = tee.finish()
        if stored is None:
            tail = sse_error_event("trace store could not record the call", 503)
        elif failure is not None:
            tail += sse_error_event(f"mid-stream: {failure.message}", failure.status)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
