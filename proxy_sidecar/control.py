"""Runtime state and the token-protected control and rollout APIs.

In: `POST /control/{pause,resume,policy_version,mode}`, `GET /control/status`,
`POST /rollouts/{id}/{reward,finish}`. Out: JSON status; a paused sidecar holds new calls (bounded)
instead of failing them, so a harness needs no retry logic across a weight swap.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson

from harnessrl.http.listener import send_json
from harnessrl.http.types import Receive, Scope, Send
from harnessrl.traces.schema import (
    TERMINAL_STATES,
    InvalidTransition,
    RolloutState,
    TraceStore,
    UnknownRollout,
    policy_version_error,
)
from harnessrl.traces.sql import StoreUnavailable
from proxy_sidecar.budget import BodyBudget
from proxy_sidecar.config import MODES, SidecarConfig
from proxy_sidecar.errors import (
    BadRequest,
    BodyTooLarge,
    Conflict,
    NotFound,
    RequestTimeout,
    SidecarError,
    Unauthorized,
    Unavailable,
    send_error,
)
from proxy_sidecar.metrics import Metrics


class SidecarState:
    """Everything a request handler needs; one per app, created at startup."""

    def __init__(self, config: SidecarConfig, store: TraceStore | None, metrics: Metrics) -> None:
        self.config = config
        self.store = store  # None until the app's lifespan opens the configured one
        self.metrics = metrics
        self.mode = config.mode
        self.policy_version = config.policy_version
        # Replica URL -> the version it serves, where it differs from policy_version (a push
        # that reached some replicas only); a call is labelled with its replica's version.
        self.upstream_versions: dict[str, int] = {}
        self.in_flight = 0
        self.paused = False
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.pool: Any = None
        self.recorder: Any = None
        self.budget = BodyBudget(config.max_buffered_bytes, metrics)
        if config.policy_version is not None:
            metrics.policy_version.set(config.policy_version)

    async def enter(self) -> None:
        """Admit one call, waiting (bounded) while paused."""
        if self.paused:
            try:
                await asyncio.wait_for(self._open.wait(), self.config.pause_timeout_s)
            except TimeoutError as err:
                raise Unavailable(
                    f"sidecar paused for more than {self.config.pause_timeout_s}s (weight swap?)"
                ) from err
        self.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()

    def pause(self) -> None:
        self.paused = True
        self._open.clear()
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self.paused = False
        self._open.set()
        self.metrics.paused.set(0)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if `timeout_s` passed first."""
        if self._idle.is_set():  # also with timeout 0, which wait_for would time out at once
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def version_of(self, upstream: str) -> int | None:
        """The policy version a call served by `upstream` is labelled with (no version header)."""
        return self.upstream_versions.get(upstream, self.policy_version)

    def status(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "in_flight": self.in_flight,
            "policy_version": self.policy_version,
            "upstream_versions": self.upstream_versions,
            "mode": self.mode,
        }


def rollout_token(control_token: str, rollout_id: str) -> str:
    """A rollout's own credential: it may post that rollout's reward and nothing else.

    HMAC of the rollout id under the control token, so a sidecar checks it without a table and
    the control token itself never has to reach a harness.
    """
    message = b"harnessrl-rollout-reward\0" + rollout_id.encode()
    return hmac.new(control_token.encode(), message, hashlib.sha256).hexdigest()


def rollout_url(sidecar_url: str, rollout_id: str, route: str = "v1") -> str:
    """A rollout's own address on a sidecar: `v1` is its OPENAI_BASE_URL, `reward` and `finish`
    its rollout API. The id in the path is what ties every call to its rollout."""
    return f"{sidecar_url}/rollouts/{rollout_id}/{route}"


def rollout_of(scope: Scope, default: str) -> str:
    """The rollout id in the request's path, or `default` on the plain routes; BadRequest if it
    cannot be one (distinct ids must stay distinct in the store, and printable in its logs)."""
    params = scope.get("path_params", {})
    if "rollout_id" not in params:
        return default
    raw = scope.get("raw_path")
    try:  # the server decoded the path with replacement characters: %ff and %fe would collide
        if raw is not None:
            unquote_to_bytes(raw).decode()
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.end].hex()
        raise BadRequest(
            f"rollout id is not UTF-8 once percent-decoded (bytes 0x{bad}): percent-encode "
            "the UTF-8 bytes of a text id"
        ) from err
    rollout_id = str(params["rollout_id"])
    if len(rollout_id) > 256 or not rollout_id.isprintable():
        raise BadRequest(f"rollout id must be printable and at most 256 chars, got {rollout_id!r}")
    return rollout_id


def authorize(scope: Scope, token: str | None, rollout_id: str | None = None) -> str:
    """Which credential the request carries: "control", or "rollout" (that rollout's own).

    `rollout_id` given: the rollout's own credential is accepted besides the control token.
    """
    if token is None:  # only allowed when bound to loopback (SidecarConfig checks)
        return "control"
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            if scheme.lower() != b"bearer":
                break
            if hmac.compare_digest(given.strip(), token.encode()):
                return "control"
            own = rollout_token(token, rollout_id).encode() if rollout_id is not None else b""
            if own and hmac.compare_digest(given.strip(), own):
                return "rollout"
            break
    if rollout_id is not None:
        raise Unauthorized(
            f"missing or wrong bearer token for rollout {rollout_id!r}: send the control token "
            "or this rollout's own HARNESSRL_REWARD_TOKEN"
        )
    raise Unauthorized("missing or wrong bearer token for the control API")


async def read_body(
    scope: Scope,
    receive: Receive,
    limit: int,
    budget: BodyBudget | None = None,
    timeout_s: float | None = None,
) -> bytearray:
    """The whole body, at most `limit` bytes, all of it within `timeout_s` seconds (408 past that).

    With a `budget`, bytes are taken from it as they arrive, never on the strength of a declared
    Content-Length: a body that is announced large and trickles in holds only what came (the
    caller gives `len(body)` back when the call is done). If the budget refuses, the rest of the
    body is read and dropped, so that the client gets the 503 rather than a reset."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"request body over the {limit}-byte limit")
    body = bytearray()  # grows in place: no second copy of a large body when it is complete
    try:
        async with asyncio.timeout(timeout_s):
            await _read_into(body, receive, limit, budget)
    except BaseException as err:
        if budget is not None:
            budget.give(len(body))
        if isinstance(err, TimeoutError):
            raise RequestTimeout(
                f"request body not received within {timeout_s} s (--body-timeout-s)"
            ) from err
        raise
    return body


async def _read_into(
    body: bytearray, receive: Receive, limit: int, budget: BodyBudget | None
) -> None:
    more = True  # the client has more of the body to send
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise BadRequest("client went away before sending the body")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) + len(chunk) > limit:
            raise BodyTooLarge(f"request body over the {limit}-byte limit")
        if budget is not None:
            try:
                budget.take(len(chunk))
            except Unavailable:
                allowance = limit - len(body) - len(chunk)
                budget.give(len(body))
                body.clear()
                if more:
                    await _drop_body(receive, allowance)
                raise
        body += chunk


async def _drop_body(receive: Receive, allowance: int) -> None:
    """Read what is left of a refused body (up to `allowance` bytes) without keeping it."""
    while allowance >= 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        allowance -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def parse_object(raw: bytes | bytearray) -> dict[str, Any]:
    """A request body that must be one JSON object; BadRequest says why it is not."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(value).__name__}")
    return value


async def read_json(
    scope: Scope, receive: Receive, timeout_s: float | None, limit: int = 1 << 20
) -> dict[str, Any]:
    """A control request's JSON object body (empty body: {})."""
    raw = await read_body(scope, receive, limit, timeout_s=timeout_s)
    return parse_object(raw) if raw.strip() else {}


def _number(body: dict[str, Any], key: str, *, integer: bool = False) -> Any:
    value = body.get(key)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{key}' must be {kind}, got {value!r}", param=key)
    if not math.isfinite(value):
        raise BadRequest(f"'{key}' must be finite, got {value!r}", param=key)
    return value


class ControlEndpoint:
    """`/control/{action}`; one pure-ASGI object serves all actions."""

    def __init__(self, state: SidecarState, action: str) -> None:
        self.state = state
        self.action = action

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            authorize(scope, self.state.config.control_token)
            timeout_s = self.state.config.body_timeout_s
            body = await read_json(scope, receive, timeout_s) if scope["method"] == "POST" else {}
            await send_json(send, 200, await self._act(body))
        except SidecarError as err:
            await send_error(send, err)

    async def _act(self, body: dict[str, Any]) -> dict[str, Any]:
        state = self.state
        if self.action == "pause":
            timeout = None
            if body.get("drain_timeout_s") is not None:
                timeout = _number(body, "drain_timeout_s")
                if not 0 <= timeout <= 3600:
                    raise BadRequest(
                        f"'drain_timeout_s' must be in [0, 3600], got {timeout!r}",
                        param="drain_timeout_s",
                    )
            state.pause()
            if timeout is not None and not await state.drain(float(timeout)):
                # A swap now would label calls sampled partly under the old weights with the
                # new version: refuse the hold whole, and let new calls in again.
                state.resume()
                raise Conflict(
                    f"{state.in_flight} call(s) still in flight after drain_timeout_s="
                    f"{timeout:g}; not paused (new calls resumed)"
                )
        elif self.action == "resume":
            state.resume()
        elif self.action == "policy_version":
            version = _number(body, "version", integer=True)
            error = policy_version_error(version)
            if error:
                raise BadRequest(f"'version' {error}", param="version")
            upstream = body.get("upstream")
            if upstream is None:  # every replica serves it now
                state.policy_version, state.upstream_versions = version, {}
                state.metrics.policy_version.set(version)
            elif isinstance(upstream, str) and upstream.startswith(("http://", "https://")):
                state.upstream_versions[upstream.rstrip("/").removesuffix("/v1")] = version
            else:
                raise BadRequest(f"'upstream' must be a replica URL, got {upstream!r}")
        elif self.action == "mode":
            if body.get("mode") not in MODES:
                raise BadRequest(f"'mode' must be one of {MODES}, got {body.get('mode')!r}")
            state.mode = body["mode"]
        return state.status()


class RolloutEndpoint:
    """`POST /rollouts/{rollout_id}/reward` and `/finish`: write to the trace store."""

    def __init__(self, state: SidecarState, action: str) -> None:
        self.state = state
        self.action = action

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            rollout_id = rollout_of(scope, "")
            # A harness holds its rollout's own credential, good for that rollout's reward only.
            own = rollout_id if self.action == "reward" else None
            caller = authorize(scope, self.state.config.control_token, own)
            body = await read_json(scope, receive, self.state.config.body_timeout_s)
            record = await asyncio.to_thread(self._apply, rollout_id, body, caller)
            payload = {
                "rollout_id": rollout_id,
                "state": record.state.value,
                "reward": record.reward,
            }
            await send_json(send, 200, payload)
        except UnknownRollout as err:
            await send_error(send, NotFound(str(err)))
        except InvalidTransition as err:
            await send_error(send, Conflict(str(err)))
        except StoreUnavailable as err:  # past the store's reconnect budget: nothing was written
            await send_error(send, Unavailable(f"trace store unavailable: {err}", retry_after_s=5))
        except (ValueError, TypeError) as err:
            await send_error(send, BadRequest(str(err)))
        except SidecarError as err:
            await send_error(send, err)

    def _apply(self, rollout_id: str, body: dict[str, Any], caller: str) -> Any:
        store = self.state.store
        assert store is not None, "the lifespan opens the store before any request"
        if self.action == "reward":
            reward = float(_number(body, "reward"))
            state = store.rollout(rollout_id).state if caller == "rollout" else None
            if state in TERMINAL_STATES:
                # The trainer has already scored (or excluded) the run: its reward is final.
                raise Conflict(f"rollout {rollout_id!r} is already {state}; reward refused")
            return store.set_reward(rollout_id, reward)
        target = body.get("state")
        if target not in (RolloutState.SUCCEEDED.value, RolloutState.FAILED.value):
            raise BadRequest(f"'state' must be 'succeeded' or 'failed', got {target!r}")
        fields = {k: body[k] for k in ("reward", "exit_code", "info") if k in body}
        if store.rollout(rollout_id).state is RolloutState.QUEUED:
            # A harness that reports back has run, even if nobody marked it running.
            store.transition(rollout_id, RolloutState.RUNNING)
        return store.transition(rollout_id, RolloutState(target), **fields)
