"""The token-in hot path: a dialect's request → token-id prompt → upstream completion → reply.

In: a Responses or Messages request (rollout id from the path or the default). Out: the reply in
that dialect, whole or streamed as the upstream samples, whose last bytes leave only after the
call record (exact prompt ids, sampled ids, logprobs, the harness's own request) is committed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import orjson
from starlette.routing import Route

from harnessrl.http.listener import send_json
from harnessrl.http.types import Receive, Scope, Send
from harnessrl.traces.parse import CaptureError, StreamAssembler, parse_response
from harnessrl.traces.schema import EndpointKind
from proxy_sidecar.capture import build_record, decode_body, error_message
from proxy_sidecar.control import SidecarState, parse_object, read_body, rollout_of
from proxy_sidecar.dialects.call import Completion, Conversation, completion_of
from proxy_sidecar.dialects.messages import Messages
from proxy_sidecar.dialects.responses import Responses
from proxy_sidecar.dialects.sse import SSEReader, TextSplitter
from proxy_sidecar.dialects.tokens import Prompt, Renderer, TurnLedger, load_tokenizer
from proxy_sidecar.errors import (
    BadRequest,
    NotFound,
    NoUpstream,
    SidecarError,
    Unavailable,
    error_headers,
)
from proxy_sidecar.prompts.segments import SegmentCache
from proxy_sidecar.proxy import (
    read_failure,
    refuse,
    reported_version,
    response_headers,
    store_call,
    watch_disconnect,
)
from proxy_sidecar.upstream import UpstreamFailure, UpstreamResponse

_COMPLETIONS = EndpointKind.COMPLETIONS
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Writer(Protocol):
    def start(self) -> bytes: ...

    def delta(self, kind: str, text: str) -> bytes: ...

    def finish(self, done: Completion) -> tuple[bytes, dict[str, Any]]: ...


class Dialect(Protocol):
    """One wire format: its request → `Conversation`, a `Completion` → its reply and events."""

    name: str

    def parse(self, body: dict[str, Any]) -> Conversation: ...

    def reply(self, conv: Conversation, done: Completion, served: str) -> dict[str, Any]: ...

    def writer(self, conv: Conversation, served: str, prompt_len: int) -> Writer: ...

    def remember(self, conv: Conversation, done: Completion, reply: dict[str, Any]) -> None: ...

    def error(self, err: SidecarError) -> dict[str, Any]: ...

    def stream_error(self, err: SidecarError) -> bytes: ...


class TokenIn:
    """Token-in state of one sidecar: the renderer (once its tokenizer is loaded), the ledger."""

    # Rendering on the event loop holds up every other call; on a thread it costs a hop (a wait
    # for a core, on a busy machine). The template runs inline for conversations up to this many
    # messages, tokenizing inline while the text left is this short (about a millisecond).
    INLINE_MESSAGES = 256
    INLINE_CHARS = 4096

    def __init__(self) -> None:
        self.renderer: Renderer | None = None
        self.ledger = TurnLedger()
        self.segments = SegmentCache()  # per rollout, what its latest prompt's text tokenized to
        self.max_model_len: int | None = None  # the upstream's context, from its /v1/models
        # One of each, shared by the plain and the per-rollout routes.
        self.dialects: dict[str, Dialect] = {"responses": Responses(), "messages": Messages()}

    async def load(self, spec: str) -> None:
        self.renderer = Renderer(await asyncio.to_thread(load_tokenizer, spec))

    async def prompt(self, rollout_id: str, conv: Conversation) -> Prompt:
        """The token-id prompt: rendered and tokenized on a thread where that takes long."""
        renderer = self.renderer
        if renderer is None:
            raise NotFound(
                "token-in mode is off: start the sidecar with --tokenizer (the model spec the "
                "server loads, e.g. smollm2 or an HF folder) to serve this route"
            )
        sampled = [  # looked up here: the ledger is only ever touched on the event loop
            self.ledger.find(rollout_id, m) if m.get("role") == "assistant" else None
            for m in conv.messages
        ]
        known = self.segments.get(rollout_id)  # the same: read, never changed, by a thread
        args = (conv.messages, conv.tools, sampled, known)
        try:
            if len(conv.messages) <= self.INLINE_MESSAGES:
                draft = renderer.prepare(*args)
            else:
                draft = await asyncio.to_thread(renderer.prepare, *args)
            if draft.untokenized <= self.INLINE_CHARS:
                prompt = renderer.finish(draft)
            else:
                prompt = await asyncio.to_thread(renderer.finish, draft)
        except Exception as err:  # the template is code run on client data: its failure is a 400
            raise BadRequest(f"the chat template cannot render this conversation: {err}") from err
        if prompt.segments is not None:
            self.segments.put(rollout_id, prompt.segments)
        return prompt

    async def room(self, state: SidecarState, rollout_id: str, scope: Scope, prompt: int) -> int:
        """What a call without a token limit may sample: the rest of the upstream's context (its
        `/v1/completions` default would be 16 tokens, where a chat server fills the context).
        0 when the upstream names no `max_model_len`; then its own default applies."""
        if self.max_model_len is None:
            try:
                _, resp = await state.pool.request(
                    rollout_id, "GET", "/v1/models", _headers(scope), None
                )
                models = orjson.loads(await resp.read()).get("data") or [{}]
                self.max_model_len = int(models[0].get("max_model_len") or 0)
            except (SidecarError, UpstreamFailure, ValueError, TypeError, AttributeError):
                return 0  # asked again at the next such call
        return max(1, self.max_model_len - prompt) if self.max_model_len else 0


def upstream_error(status: int, body: Any) -> SidecarError:
    """The upstream's own error answer, kept at its status, for the dialect to reshape."""
    err = SidecarError(f"upstream: {error_message(body)}")
    err.status = status
    err.type = "invalid_request_error" if status < 500 else "upstream_error"
    return err


def _headers(scope: Scope) -> list[tuple[str, str]]:
    """The credentials of the harness, as the upstream takes them (a Messages key as a bearer)."""
    out = [("content-type", "application/json"), ("accept-encoding", "identity")]
    headers = dict(scope["headers"])
    auth = headers.get(b"authorization")
    if auth is None and b"x-api-key" in headers:
        auth = b"Bearer " + headers[b"x-api-key"]
    if auth is not None:
        out.append(("authorization", auth.decode("latin-1")))
    return out


class DialectEndpoint:
    """Pure-ASGI handler of one dialect's route."""

    def __init__(self, state: SidecarState, tokenin: TokenIn, dialect: Dialect) -> None:
        self.state = state
        self.tokenin = tokenin
        self.dialect = dialect

    async def _error(self, send: Send, err: SidecarError) -> None:
        await send_json(send, err.status, self.dialect.error(err), error_headers(err))

    async def _refuse(self, scope: Scope, send: Send, err: SidecarError) -> None:
        refuse(self.state, scope, self.dialect.name, err)
        await self._error(send, err)

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
                del raw
                rollout_id = rollout_of(scope, state.config.default_rollout)
                conv = self.dialect.parse(request)
                prompt = await self.tokenin.prompt(rollout_id, conv)
                await state.enter()
            except SidecarError as err:
                await self._refuse(scope, send, err)
                return
            try:
                call = _Call(self, scope, request, rollout_id, conv, prompt, started)
                await call.run(receive, send)
            finally:
                state.leave()
        finally:
            state.budget.give(size)


class _Call:
    """One token-in call in flight."""

    def __init__(
        self,
        endpoint: DialectEndpoint,
        scope: Scope,
        request: dict[str, Any],
        rollout_id: str,
        conv: Conversation,
        prompt: Prompt,
        started: float,
    ) -> None:
        self.state = endpoint.state
        self.dialect = endpoint.dialect
        self.ledger = endpoint.tokenin.ledger
        self.tokenin = endpoint.tokenin
        self.error = endpoint._error
        self.scope = scope
        self.rollout_id = rollout_id
        self.conv = conv
        self.prompt = prompt
        config = self.state.config
        self.served = config.model or conv.model or "default"
        self.common: dict[str, Any] = dict(
            endpoint=_COMPLETIONS, rollout_id=rollout_id, started=started, request=request
        )

    def _body(self, room: int) -> bytes:
        state = self.state
        body: dict[str, Any] = {"prompt": list(self.prompt.ids), **self.conv.sampling}
        if body.get("max_tokens") is None and room:
            body["max_tokens"] = room
        model = state.config.model or self.conv.model
        if model is not None:
            body["model"] = model
        body.update(logprobs=1, return_token_ids=True, stream=self.conv.stream)
        body.update(state.config.overrides(state.mode))
        return orjson.dumps(body)

    async def run(self, receive: Receive, send: Send) -> None:
        state = self.state
        room = 0
        if self.conv.sampling.get("max_tokens") is None:
            room = await self.tokenin.room(state, self.rollout_id, self.scope, len(self.prompt.ids))
        try:
            upstream, resp = await state.pool.request(
                self.rollout_id, "POST", "/v1/completions", _headers(self.scope), self._body(room)
            )
        except SidecarError as err:
            state.metrics.upstream_errors.labels("connect").inc()
            await self._fail(send, err, None, upstream="", policy_version=state.policy_version)
            return
        headers, raw_version = response_headers(resp)
        self.common["upstream"] = upstream.url
        version = reported_version(raw_version)
        self.common["policy_version"] = (
            state.version_of(upstream.url) if version is None else version
        )
        stream = any(n == b"content-type" and b"text/event-stream" in v for n, v in headers)
        if resp.status != 200:
            try:
                data = await resp.read()
            except UpstreamFailure as err:
                await self._fail(send, read_failure(err), None)
                return
            body = decode_body(data)
            await self._fail(send, upstream_error(resp.status, body), body, status=resp.status)
        elif stream:
            await self._stream(receive, send, resp)
        else:
            await self._buffered(send, resp)

    async def _fail(
        self, send: Send, err: SidecarError, body: Any, status: int | None = None, **common: Any
    ) -> None:
        """Record a failed call and answer it in the dialect's error shape."""
        record = build_record(
            status=err.status if status is None else status,
            body=body,
            error=None if status is not None else err.message,
            **{**self.common, **common},
        )
        await store_call(self.state, record, stream=False)
        await self.error(send, err)

    def _completion(self, body: Any) -> Completion:
        prompt, choices = parse_response(_COMPLETIONS, body)
        if not choices:
            raise CaptureError("the upstream answered no choice")
        raw = body["choices"][0]
        return completion_of(choices[0], prompt, raw, tools=bool(self.conv.tools))

    async def _commit(
        self, body: dict[str, Any], done: Completion, reply: dict[str, Any], stream: bool
    ) -> bool:
        """Store the call; on success the sampled turn joins the ledger."""
        prompt = self.prompt
        turns = {"reused_turns": prompt.reused_turns, "rendered_turns": prompt.rendered_turns}
        recorded = {**body, "dialect": self.dialect.name, "reply": reply, "token_in": turns}
        record = build_record(status=200, body=recorded, **self.common)
        if await store_call(self.state, record, stream=stream) is None:
            return False
        self.ledger.add(self.rollout_id, done.message(), done.token_ids)
        self.dialect.remember(self.conv, done, reply)
        return True

    async def _buffered(self, send: Send, resp: UpstreamResponse) -> None:
        try:
            data = await resp.read()
        except UpstreamFailure as err:
            self.state.metrics.upstream_errors.labels("read").inc()
            await self._fail(send, read_failure(err), None)
            return
        body = decode_body(data)
        try:
            done = self._completion(body)
        except CaptureError as err:
            await self._fail(send, NoUpstream(f"upstream answer cannot be used: {err}"), body)
            return
        reply = self.dialect.reply(self.conv, done, self.served)
        if not await self._commit(body, done, reply, stream=False):
            await self.error(send, Unavailable("trace store could not record the call"))
            return
        await send_json(send, 200, reply)

    async def _stream(self, receive: Receive, send: Send, resp: UpstreamResponse) -> None:
        gone, watcher = watch_disconnect(receive, resp)
        writer = self.dialect.writer(self.conv, self.served, len(self.prompt.ids))
        reader, assembler = SSEReader(), StreamAssembler(_COMPLETIONS)
        splitter = TextSplitter(tools=bool(self.conv.tools))
        failure: SidecarError | None = None
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": writer.start(), "more_body": True})
        try:
            async for chunk in resp.chunks():
                out = b""
                for data in reader.feed(chunk):
                    assembler.feed(data)
                    out += self._delta(writer, splitter, data)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except CaptureError as err:
            failure = NoUpstream(f"upstream stream cannot be used: {err}")
        except Exception as err:
            if gone.is_set():
                failure = SidecarError("client disconnected")
            elif isinstance(err, UpstreamFailure):
                failure = read_failure(err)
                self.state.metrics.upstream_errors.labels("stream").inc()
            else:
                raise
        finally:
            watcher.cancel()
            await resp.close()
        body = assembler.body()
        if failure is None and assembler.error is not None:
            failure = NoUpstream(
                f"upstream stream error: {error_message({'error': assembler.error})}"
            )
        done = None
        if failure is None:
            try:
                done = self._completion(body)
            except CaptureError as err:
                failure = NoUpstream(f"upstream stream cannot be used: {err}")
        if done is None:
            assert failure is not None
            record = build_record(status=200, body=body, error=failure.message, **self.common)
            await store_call(self.state, record, stream=True)
            tail = self.dialect.stream_error(failure)
        else:
            tail, reply = writer.finish(done)
            if not await self._commit(body, done, reply, stream=True):
                tail = self.dialect.stream_error(
                    Unavailable("trace store could not record the call")
                )
        if not gone.is_set():
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    @staticmethod
    def _delta(writer: Writer, splitter: TextSplitter, data: bytes) -> bytes:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""  # [DONE]; anything else the assembler already refused
        choices = event.get("choices") if isinstance(event, dict) else None
        text = choices[0].get("text") if choices and isinstance(choices[0], dict) else None
        if not isinstance(text, str) or not text:
            return b""
        reasoning, content = splitter.feed(text)
        return writer.delta("reasoning", reasoning) + writer.delta("message", content)


def dialect_routes(state: SidecarState, tokenin: TokenIn, prefix: str) -> list[Route]:
    """The token-in routes under one prefix (`/v1` or `/rollouts/{rollout_id}/v1`)."""
    return [
        Route(f"{prefix}/{name}", DialectEndpoint(state, tokenin, dialect), methods=["POST"])
        for name, dialect in tokenin.dialects.items()
    ]
