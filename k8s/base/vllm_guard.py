"""vLLM middleware (`--middleware=vllm_guard.RequireKey`): every route needs the server's API key.

In: each HTTP or WebSocket request to vLLM. Out: the request passed on if it carries
`Authorization: Bearer $VLLM_API_KEY`, else 401; only `GET /health` (the kubelet's probes) is
open. vLLM's own `--api-key` check covers only paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py, 0.32), which leaves `/invocations` (inference)
and the dev-mode routes (`/pause`, `/collective_rpc`, ...) open to anyone who reaches the port.
Mounted into the vLLM pods from a ConfigMap (k8s/base/kustomization.yaml); standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]
OPEN = frozenset({("GET", "/health")})  # the kubelet's startup and readiness probes


class RequireKey:
    """Pure-ASGI guard; vLLM adds it outermost, so it sees every route the server has."""

    def __init__(self, app: App) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:  # fail closed: an unguarded dev-mode server can be reset by anyone
            raise RuntimeError("vllm_guard.RequireKey needs VLLM_API_KEY (Secret harnessrl-vllm)")
        self.app = app
        self.digest = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def allowed(self, scope: Scope) -> bool:
        if (scope.get("method", "GET"), scope.get("path", "")) in OPEN:
            return True
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                return hmac.compare_digest(hashlib.sha256(value).digest(), self.digest)
        return False

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: send the server's API key"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
