"""The sidecar ASGI app: the route list and the lifespan that opens store, client and writer.

In: a `SidecarConfig` (and optionally an already-open trace store). Out: a Starlette app whose
routes are pure-ASGI handlers; nothing lives in module globals.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.http.listener import error_body, send_body, send_json
from harnessrl.http.types import Receive, Scope, Send
from harnessrl.traces import open_store
from harnessrl.traces.schema import EndpointKind, TraceStore
from proxy_sidecar import __version__
from proxy_sidecar.config import TOKEN_IN_CHAT, SidecarConfig
from proxy_sidecar.control import ControlEndpoint, RolloutEndpoint, SidecarState, rollout_of
from proxy_sidecar.dialects.chat import Chat
from proxy_sidecar.dialects.endpoint import DialectEndpoint, TokenIn, dialect_routes
from proxy_sidecar.dialects.messages import Messages
from proxy_sidecar.dialects.models import ModelList
from proxy_sidecar.errors import SidecarError, send_error
from proxy_sidecar.metrics import Metrics
from proxy_sidecar.proxy import read_failure, response_headers, upstream_headers
from proxy_sidecar.recorder import Recorder
from proxy_sidecar.upstream import UpstreamFailure, UpstreamPool

from proxy_sidecar.proxy import ProxyEndpoint  # isort: skip


class Passthrough:
    """`GET /v1/models`: answered by the rollout's upstream, not recorded."""

    def __init__(self, state: SidecarState, path: str) -> None:
        self.state = state
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            rollout_id = rollout_of(scope, self.state.config.default_rollout)
            _, resp = await self.state.pool.request(
                rollout_id, "GET", self.path, upstream_headers(scope), None
            )
            try:
                body = await resp.read()
            except UpstreamFailure as err:
                raise read_failure(err) from err
        except SidecarError as err:
            await send_error(send, err)
            return
        await send_body(send, resp.status, body, response_headers(resp)[0])


class Health:
    def __init__(self, state: SidecarState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ups = [{"url": u.url, "failures": u.failures} for u in self.state.pool.upstreams]
        body = {"status": "ok", "version": __version__, "upstreams": ups, **self.state.status()}
        await send_json(send, 200, body)


class MetricsEndpoint:
    def __init__(self, state: SidecarState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, ctype = self.state.metrics.render()
        await send_body(send, 200, body, [(b"content-type", ctype.encode())])


def _error_response(path: str, err: SidecarError) -> Response:
    """`err` in the shape of the route's dialect: Anthropic's under /v1/messages, else OpenAI's."""
    body = error_body(err.status, err.message, err.type, err.param)
    if path.endswith("/v1/messages") or "/v1/messages/" in path:
        body = Messages().error(err)  # the dialect keeps no state
    return JSONResponse(body, err.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route, wrong method) in the dialect's error shape."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    err = SidecarError(f"no route {path!r}" if exc.status_code == 404 else str(exc.detail))
    err.status = exc.status_code
    err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = _error_response(path, err)
    response.headers.update(exc.headers or {})  # 405: Allow
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug, not the client's doing: still an answer in the dialect's shape (and logged)."""
    err = SidecarError(f"internal error in the sidecar: {type(exc).__name__}")
    err.status, err.type = 500, "internal_error"
    return _error_response(request.url.path, err)


def routes(state: SidecarState, tokenin: TokenIn | None = None) -> list[Route]:
    chat, comp = EndpointKind.CHAT, EndpointKind.COMPLETIONS
    tokenin = tokenin or TokenIn()
    chat_route: Any = ProxyEndpoint(state, chat, "/v1/chat/completions")
    if state.config.token_in_chat:  # the chat dialect, with its tokenizer once loaded
        chat_route = DialectEndpoint(state, tokenin, Chat(tokenin))
    out = []
    for prefix in ("/rollouts/{rollout_id}/v1", "/v1"):
        out += [
            Route(f"{prefix}/chat/completions", chat_route, methods=["POST"]),
            Route(
                f"{prefix}/completions",
                ProxyEndpoint(state, comp, "/v1/completions"),
                methods=["POST"],
            ),
            Route(f"{prefix}/models", ModelList(Passthrough(state, "/v1/models")), methods=["GET"]),
            *dialect_routes(state, tokenin, prefix),
        ]
    out += [
        Route("/health", Health(state), methods=["GET"]),
        Route("/metrics", MetricsEndpoint(state), methods=["GET"]),
        Route("/rollouts/{rollout_id}/reward", RolloutEndpoint(state, "reward"), methods=["POST"]),
        Route("/rollouts/{rollout_id}/finish", RolloutEndpoint(state, "finish"), methods=["POST"]),
        Route("/control/status", ControlEndpoint(state, "status"), methods=["GET"]),
    ]
    for action in ("pause", "resume", "policy_version", "mode"):
        out.append(Route(f"/control/{action}", ControlEndpoint(state, action), methods=["POST"]))
    return out


def build_app(config: SidecarConfig, store: TraceStore | None = None) -> Starlette:
    """The sidecar app. A `store` passed in is used as is and left open at shutdown."""
    if config.token_in_chat and config.tokenizer is None:
        raise ValueError(TOKEN_IN_CHAT)
    state = SidecarState(config, store, Metrics())
    tokenin = TokenIn()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if config.tokenizer is not None:
            await tokenin.load(config.tokenizer)
        store = state.store
        own_store = store is None
        if store is None:
            options: dict[str, Any] = {}
            if config.store.startswith("sqlite"):
                # Checkpoints (the step that writes the database file) on a helper thread, so a
                # commit on the event loop only appends to the WAL.
                options["background_checkpoint"] = True
                if config.fsync:
                    options["synchronous"] = "FULL"
            store = state.store = open_store(config.store, **options)
        state.pool = UpstreamPool(config)
        await state.pool.start()
        state.recorder = Recorder(store, batch_max=config.batch_max)
        state.recorder.start()
        try:
            yield
        finally:
            await state.recorder.stop()
            await state.pool.close()
            if own_store:
                store.close()

    app = Starlette(
        routes=routes(state, tokenin),
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.sidecar = state
    return app
