"""The model list in the caller's dialect: OpenAI's list as the upstream sent it, or Anthropic's.

In: `GET /v1/models`; a request carrying `anthropic-version` comes from an Anthropic client. Out:
the upstream's list unchanged for everyone else, and for Anthropic clients the same models as
`{"data": [{"type": "model", "id", "display_name", "created_at"}], "has_more": false, ...}`.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Any

from harnessrl.http.listener import send_json
from harnessrl.http.types import Message, Receive, Scope, Send
from proxy_sidecar.capture import decode_body, error_message
from proxy_sidecar.dialects.messages import Messages
from proxy_sidecar.errors import NoUpstream

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def anthropic_list(body: Any) -> dict[str, Any]:
    """An OpenAI model list as Anthropic's; NoUpstream if the upstream's is not one."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
    ):
        raise NoUpstream("upstream model list has no data list of models with ids")
    models = []
    for model in data:
        created = model.get("created")
        stamp = created if isinstance(created, int) and 0 <= created < 2**33 else 0
        when = datetime.datetime.fromtimestamp(stamp, datetime.UTC)
        models.append(
            {
                "type": "model",
                "id": model["id"],
                "display_name": model["id"],
                "created_at": when.isoformat().replace("+00:00", "Z"),
                "lifecycle": "active",
            }
        )
    first, last = (models[0]["id"], models[-1]["id"]) if models else (None, None)
    return {"data": models, "has_more": False, "first_id": first, "last_id": last}


class ModelList:
    """Wraps the pass-through model list: Anthropic clients get it in their own shape."""

    def __init__(self, passthrough: ASGIApp) -> None:
        self.passthrough = passthrough
        self.dialect = Messages()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not any(name == b"anthropic-version" for name, _ in scope["headers"]):
            await self.passthrough(scope, receive, send)
            return
        start: Message = {}
        chunks: list[bytes] = []

        async def held(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))

        await self.passthrough(scope, receive, held)
        status, body = start.get("status", 502), decode_body(b"".join(chunks))
        try:
            if status != 200:
                err = NoUpstream(error_message(body))
                err.status = status
                raise err
            await send_json(send, 200, anthropic_list(body))
        except NoUpstream as err:
            await send_json(send, err.status, self.dialect.error(err))
