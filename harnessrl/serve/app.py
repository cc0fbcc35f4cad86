"""Serving stage, HTTP edge: the Starlette app (route list) and an in-process server handle.

In: a loaded model (Decoder + tokenizer) and a `ServeConfig`. Out: an OpenAI/vLLM-compatible
server; every response carries `x-harnessrl-policy-version`. `start_server` runs uvicorn on a
thread for callers that also train in the same process, and swaps weights without HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from flax import nnx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.model.decoder import Decoder
from harnessrl.serve.config import ServeConfig
from harnessrl.serve.decode import Engine
from harnessrl.serve.generate import VERSION_HEADER, Backend, GenerationEndpoint, read_json
from harnessrl.serve.output import TokenText
from harnessrl.serve.protocol import RequestError, Tokenizer
from harnessrl.serve.swap import load_params

ParamsLoader = Callable[[str], Any]


class PolicyVersionHeader:
    """Pure-ASGI middleware: stamp the current policy version on responses that lack one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def stamped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == VERSION_HEADER for name, _ in headers):
                    version = scope["app"].state.backend.engine.version
                    headers.append((VERSION_HEADER, str(version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


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


async def tokenize(request: Request) -> JSONResponse:
    backend: Backend = request.app.state.backend
    try:
        body = await read_json(request.receive)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if "messages" in body:
            messages, add = body["messages"], bool(body.get("add_generation_prompt", True))
            ids = list(
                backend.tokenizer.apply_chat_template(
                    messages, tools=body.get("tools"), add_generation_prompt=add
                )
            )
        elif isinstance(body.get("prompt"), str):
            ids = list(backend.tokenizer.encode(body["prompt"]))
        else:
            raise RequestError("give `prompt` (a string) or `messages` (a list)", param="prompt")
    except RequestError as err:
        return _error(err)
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": backend.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


async def detokenize(request: Request) -> JSONResponse:
    backend: Backend = request.app.state.backend
    try:
        body = await read_json(request.receive)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and 0 <= t < backend.vocab_size for t in tokens
        ):
            raise RequestError(
                f"tokens must be a list of token ids in [0, {backend.vocab_size})", param="tokens"
            )
    except RequestError as err:
        return _error(err)
    return JSONResponse({"prompt": backend.tokenizer.decode(tokens)})


async def load_weights(request: Request) -> JSONResponse:
    """`{"path": "<exported HF folder>", "version": <int>}` → 200 `{"version": <int>}`."""
    backend: Backend = request.app.state.backend
    loader: ParamsLoader = request.app.state.params_loader
    try:
        body = await read_json(request.receive)
        path, version = (
            (body.get("path"), body.get("version")) if isinstance(body, dict) else (None, None)
        )
        if not isinstance(path, str) or not path:
            raise RequestError(
                f"path must be the exported model folder, got {path!r}", param="path"
            )
        if isinstance(version, bool) or not isinstance(version, int):
            raise RequestError(f"version must be an integer, got {version!r}", param="version")
        try:
            params = await asyncio.to_thread(loader, path)
            await asyncio.to_thread(backend.engine.swap_params, params, version)
        except (OSError, ValueError, TypeError) as err:
            raise RequestError(f"cannot load weights from {path!r}: {err}", param="path") from err
    except RequestError as err:
        return _error(err)
    return JSONResponse({"version": backend.engine.version})


def build_app(
    engine: Engine, tokenizer: Tokenizer, *, params_loader: ParamsLoader = load_params
) -> Starlette:
    """The server app around a started (or to-be-started) engine; the lifespan starts/stops it."""
    config = engine.config
    backend = Backend(
        engine=engine,
        tokenizer=tokenizer,
        names=TokenText(tokenizer),
        served=config.model_name,
        max_model_len=config.max_model_len,
        vocab_size=engine.model_config.vocab_size,
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
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.backend = backend
    app.state.params_loader = params_loader
    app.state.started = int(time.time())
    app.add_middleware(PolicyVersionHeader)
    return app


@dataclass
class ServerHandle:
    """A running in-process server: `url` (…/v1 is the OpenAI base), `engine`, `stop()`."""

    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.engine.stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    model: Decoder,
    tokenizer: Tokenizer,
    config: ServeConfig | None = None,
    *,
    params_loader: ParamsLoader = load_params,
) -> ServerHandle:
    """Warm up an engine for `model` and serve it on a background thread (port 0: any free port)."""
    config = config or ServeConfig()
    eos = getattr(tokenizer, "eos_token_ids", None) or [model.cfg.eos_token_id]
    engine = Engine(model, eos, config)
    if config.warmup:
        engine.warm_up()
    app = build_app(engine, tokenizer, params_loader=params_loader)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level, lifespan="on"
        )
    )
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
        url=f"http://{config.host}:{port}", engine=engine, server=server, thread=thread
    )


def params_of(model: nnx.Module) -> nnx.State:
    """The swappable part of a Decoder, as `engine.swap_params` takes it."""
    return nnx.state(model, nnx.Param)
