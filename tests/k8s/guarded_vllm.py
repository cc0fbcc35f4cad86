"""A vLLM stand-in behind the shipped middleware k8s/base/vllm_guard.py, for the cluster tests.

It serves what the sidecars and weight sync use (chat, completions, models, the dev-mode weight
routes, /invocations, /health) and, like vLLM with `--served-model-name`, 404s any model name but
one. Every route sits behind `vllm_guard.RequireKey`, loaded from the file the vLLM pods mount.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.benchmarks.sidecar.tokenin import completions_body

GUARD = Path(__file__).resolve().parents[2] / "k8s" / "base" / "vllm_guard.py"
KEY = "vllm-key-for-the-test"
SERVED = "policy"
DEV_ROUTES = ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
              "/update_weight_version", "/sleep", "/invocations")  # fmt: skip


def guard_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_guard", GUARD)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_completion(text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }  # fmt: skip


class GuardedVllm:
    """Served on 127.0.0.1 from a thread; `calls` lists (path, body) of what got past the guard."""

    def __init__(self, key: str = KEY) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        routes = [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", lambda r: Response(status_code=200), methods=["GET"]),
            *(Route(p, self._dev, methods=["POST"]) for p in DEV_ROUTES),
        ]
        old = os.environ.get("VLLM_API_KEY")
        os.environ["VLLM_API_KEY"] = key  # what the vLLM pod's env holds (Secret harnessrl-vllm)
        try:
            app = guard_module().RequireKey(Starlette(routes=routes))
        finally:
            os.environ.pop("VLLM_API_KEY") if old is None else os.environ.update(VLLM_API_KEY=old)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def _body(self, request: Request) -> dict[str, Any]:
        body = json.loads(await request.body() or b"{}")
        self.calls.append((request.url.path, body))
        return body

    async def _chat(self, request: Request) -> Response:
        body = await self._body(request)
        if body.get("model") != SERVED:
            msg = f"The model `{body.get('model')}` does not exist."
            return JSONResponse({"object": "error", "message": msg, "code": 404}, 404)
        return JSONResponse(chat_completion("5"))

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request)
        if body.get("model") != SERVED:
            return JSONResponse({"object": "error", "message": "no such model", "code": 404}, 404)
        return Response(completions_body(body), media_type="application/json")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def _dev(self, request: Request) -> Response:
        await self._body(request)
        return JSONResponse({})
