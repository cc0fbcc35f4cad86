"""Serving stage, HTTP edge: the Starlette app (route list) and an in-process server handle.

In: a loaded model (a family's decoder + tokenizer) and a `ServeConfig`. Out: an OpenAI/vLLM-compatible
server; every response carries `x-harnessrl-policy-version`. `start_server` runs uvicorn on a
thread for callers that also train in the same process, and swaps weights without HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from harnessrl.engine.decode import Engine
from harnessrl.engine.swap import load_params
from harnessrl.http.bodies import Offload
from harnessrl.http.listener import server_config
from harnessrl.model.registry import AnyDecoder
from harnessrl.serve.admin import ParamsLoader, admin_token, load_weights
from harnessrl.serve.body import BodyLimits, read_json
from harnessrl.serve.config import ServeConfig
from harnessrl.serve.generate import VERSION_HEADER, Backend, GenerationEndpoint
from harnessrl.serve.gil import releasing_gil
from harnessrl.serve.output import TokenText
from harnessrl.serve.protocol import RequestError, RequestLimits, Tokenizer, tokenize_body

log = logging.getLogger(__name__)


class PolicyVersionHeader:
    """Pure-ASGI middleware: stamp the current policy version on responses that lack one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == VERSION_HEADER for name, _ in headers):
                    version = scope["app"].state.backend.engine.version
                    headers.append((VERSION_HEADER, str(version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


async def _request_error(request: Request, exc: Exception) -> Response:
    """A route's RequestError as vLLM's error body (the routes below just raise it)."""
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _route_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (and anything unforeseen) in vLLM's error body, not plain text.

    vLLM names these by their status phrase ("Not Found"), unlike its own 404 for a model.
    """
    if isinstance(exc, HTTPException):
        status, headers = exc.status_code, dict(exc.headers or {})
        message = {
            404: f"no route {request.url.path!r}; see /v1/models, /v1/chat/completions, "
            "/v1/completions",
            405: f"method {request.method} is not allowed on {request.url.path!r}",
        }.get(status, str(exc.detail))
    else:  # a bug: say so in the protocol's shape, without internals
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        status, headers, message = 500, {}, "internal server error"
    kind = HTTPStatus(status).phrase if isinstance(exc, HTTPException) else None
    return await _request_error(
        request, RequestError(message, status=status, headers=headers, kind=kind)
    )


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def models(request: Request) -> JSONResponse:
    backend: Backend = request.app.state.backend
    card = {
        "id": backend.served,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "harnessrl",
        "root": backend.served,
        "parent": None,
        "max_model_len": backend.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


def _json(body: Any) -> Response:
    return Response(body, media_type="application/json")


async def tokenize(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    with backend.body.budget.hold() as hold:
        body = await read_json(request.scope, request.receive, backend.body, hold, backend.offload)
        return _json(await backend.offload.run(hold.size, _tokenize, body, backend))


def _tokenize(body: Any, backend: Backend) -> bytes:
    ids = tokenize_body(body, backend.tokenizer, backend.limits)
    # A MiB of prompt is a million ids: encoded here on the worker thread, not on the loop.
    return orjson.dumps(
        {
            "count": len(ids),
            "max_model_len": backend.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


async def detokenize(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    with backend.body.budget.hold() as hold:
        body = await read_json(request.scope, request.receive, backend.body, hold, backend.offload)
        return _json(await backend.offload.run(hold.size, _detokenize, body, backend))


def _detokenize(body: Any, backend: Backend) -> bytes:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < backend.vocab_size
        for t in tokens
    ):
        raise RequestError(
            f"tokens must be a list of token ids in [0, {backend.vocab_size})", param="tokens"
        )
    return orjson.dumps({"prompt": backend.tokenizer.decode(tokens)})


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    config: ServeConfig,
    *,
    params_loader: ParamsLoader = load_params,
) -> Starlette:
    """The server app around a started (or to-be-started) engine; the lifespan starts/stops it.

    `config.admin_token` must be set: `admin_token(config)` makes one where none was given.
    """
    if not config.admin_token:
        raise ValueError(
            "build_app needs ServeConfig.admin_token: /admin/* is never open; "
            "harnessrl.serve.admin.admin_token(config) makes one"
        )
    tokenizer = releasing_gil(tokenizer)
    backend = Backend(
        engine=engine,
        tokenizer=tokenizer,
        names=TokenText(tokenizer),
        served=config.model_name,
        max_model_len=config.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        limits=RequestLimits.of(config),
        body=BodyLimits.of(config),
        offload=Offload(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/chat/completions", GenerationEndpoint(chat=True), methods=["POST"]),
        Route("/v1/completions", GenerationEndpoint(chat=False), methods=["POST"]),
        Route("/admin/load_weights", load_weights, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            RequestError: _request_error,
            HTTPException: _route_error,
            Exception: _route_error,
        },
    )
    app.state.backend = backend
    app.state.params_loader = params_loader
    app.state.admin_token = config.admin_token
    app.state.load_lock = asyncio.Lock()
    app.state.started = int(time.time())
    app.add_middleware(PolicyVersionHeader)
    return app


@dataclass
class ServerHandle:
    """A running in-process server: `url` (…/v1 is the OpenAI base), `engine`, `stop()`, and
    the bearer token of its `/admin/*` (the configured one, or the one it made)."""

    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread
    admin_token: str = field(repr=False)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.engine.stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_server(
    model: AnyDecoder,
    tokenizer: Tokenizer,
    config: ServeConfig,
    *,
    params_loader: ParamsLoader = load_params,
) -> tuple[Engine, uvicorn.Server]:
    """An engine for `model` (warmed up unless `config.warmup` is off) and the uvicorn server of
    its app, not yet running: the foreground CLI and `start_server` both run one. `config` has
    its admin token set (`admin_token(config)`)."""
    eos = getattr(tokenizer, "eos_token_ids", None) or [model.cfg.eos_token_id]
    engine = Engine(model, eos, config)
    if config.warmup:
        engine.warm_up()
    app = build_app(engine, tokenizer, config, params_loader=params_loader)
    limits, level = config.http_limits, config.log_level
    listener = server_config(
        app, host=config.host, port=config.port, limits=limits, log_level=level, lifespan="on"
    )
    return engine, uvicorn.Server(listener)


def start_server(
    model: AnyDecoder,
    tokenizer: Tokenizer,
    config: ServeConfig | None = None,
    *,
    params_loader: ParamsLoader = load_params,
) -> ServerHandle:
    """Warm up an engine for `model` and serve it on a background thread (port 0: any free port).

    Without `config.admin_token` the server makes one: `handle.admin_token`.
    """
    config = config or ServeConfig()
    config = dataclasses.replace(config, admin_token=admin_token(config))
    engine, server = make_server(model, tokenizer, config, params_loader=params_loader)
    thread = threading.Thread(target=server.run, name="harnessrl-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.stop()
            raise RuntimeError(f"server did not start on {config.host}:{config.port}")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(
        url=f"http://{config.host}:{port}",
        engine=engine,
        server=server,
        thread=thread,
        admin_token=config.admin_token,
    )
