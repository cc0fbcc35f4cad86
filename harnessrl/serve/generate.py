"""Serving stage, generation endpoints: pure-ASGI `/v1/chat/completions` and `/v1/completions`.

In: the HTTP request. Out: one JSON body, or server-sent events (prompt ids in the first chunk,
then one chunk per sampled token with its id delta), headed by the policy version that sampled the
first token (`x-harnessrl-policy-version`). A client that goes away cancels its sequences.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from harnessrl.engine.decode import Cancel, Engine, EngineBusy, TokenEvent
from harnessrl.http.bodies import Offload
from harnessrl.http.listener import send_json
from harnessrl.serve.body import BodyLimits, decode_json, read_body
from harnessrl.serve.output import (
    ChoiceState,
    TokenText,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    usage,
)
from harnessrl.serve.protocol import (
    GenerationJob,
    RequestError,
    RequestLimits,
    Tokenizer,
    parse_job,
)

VERSION_HEADER = b"x-harnessrl-policy-version"


@dataclass(frozen=True)
class Backend:
    """What the endpoints share; built once by `build_app` and kept on `app.state`."""

    engine: Engine
    tokenizer: Tokenizer
    names: TokenText
    served: str
    max_model_len: int
    vocab_size: int
    limits: RequestLimits
    body: BodyLimits
    offload: Offload


async def send_error(send: Send, err: RequestError, version: int) -> None:
    headers = [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await send_json(send, err.status, err.body(), [_version(version), *headers])


def _version(version: int) -> tuple[bytes, bytes]:
    return VERSION_HEADER, str(version).encode()


def _busy(message: str) -> RequestError:
    return RequestError(message, status=503, headers={"retry-after": "1"})


def failure(choices: list[ChoiceState]) -> RequestError | None:
    """The error of a request whose engine run failed: 503 (retry) or 500; None if it did not."""
    failed = [c for c in choices if c.finish_reason in ("abort", "error")]
    if not failed:
        return None
    message = failed[0].error or "the engine stopped while generating"
    if any(c.finish_reason == "abort" for c in failed):
        return _busy(f"{message}; retry")
    return RequestError(message, status=500)


class GenerationEndpoint:
    """One of the two generation routes, as a pure ASGI app (streaming needs no buffering)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        backend: Backend = scope["app"].state.backend
        try:
            # The body's share of the budget is given back once it is parsed: what the job keeps
            # (token ids, tools, echo text) is bounded by the request limits.
            with backend.body.budget.hold() as hold:
                raw = await read_body(scope, receive, backend.body, hold)
                # JSON decoding and tokenizing take time proportional to the prompt: off the
                # loop, so one large request never stalls the others (or /health).
                job = await backend.offload.run(len(raw), self._parse, raw, backend)
                del raw
            queue, cancel = backend.engine.submit_async(job.prompt_ids, job.params, job.max_tokens)
        except RequestError as err:
            return await send_error(send, err, backend.engine.version)
        except ValueError as err:  # the engine refused the request itself
            return await send_error(send, RequestError(str(err)), backend.engine.version)
        except EngineBusy as err:
            return await send_error(send, _busy(str(err)), backend.engine.version)
        except ConnectionError:
            return None
        watcher = asyncio.create_task(_watch_disconnect(receive, cancel, queue))
        try:
            run = _Run(job, backend, self.chat, queue, cancel)
            await (run.stream(send) if job.stream else run.respond(send))
        finally:
            watcher.cancel()
            cancel()  # no-op for finished sequences; frees slots if we stopped early

    def _parse(self, raw: bytes, backend: Backend) -> GenerationJob:
        return parse_job(
            decode_json(raw),
            chat=self.chat,
            tokenizer=backend.tokenizer,
            served=backend.served,
            max_model_len=backend.max_model_len,
            vocab_size=backend.vocab_size,
            limits=backend.limits,
        )


async def _watch_disconnect(receive: Receive, cancel: Cancel, queue: asyncio.Queue[Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel()
    queue.put_nowait(None)


class _Run:
    """The choices of one request while their events arrive."""

    def __init__(
        self,
        job: GenerationJob,
        backend: Backend,
        chat: bool,
        queue: asyncio.Queue[Any],
        cancel: Cancel,
    ) -> None:
        self.job, self.backend, self.chat = job, backend, chat
        self.queue, self.cancel = queue, cancel
        self.choices = [ChoiceState(i, job, backend.tokenizer) for i in range(job.params.n)]
        self.offsets = [len(job.echo_text or "")] * job.params.n
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": backend.served,
        }
        self.version: int | None = None

    async def events(self) -> list[TokenEvent] | None:
        """The next batch of events; None once every choice has finished or the client left."""
        if all(c.finished for c in self.choices):
            return None
        events = await self.queue.get()
        if events is None:
            return None
        if self.version is None:
            self.version = events[0].version
        return events

    def accept(self, event: TokenEvent) -> bool:
        choice = self.choices[event.choice]
        if not choice.add(event):
            return False
        if choice.finished and event.finish_reason is None:
            self.cancel(event.choice)  # a stop string ended it: free the slot now
        return True

    async def respond(self, send: Send) -> None:
        while (events := await self.events()) is not None:
            for event in events:
                self.accept(event)
        if not all(c.finished for c in self.choices):
            return  # the client left
        version = self.version if self.version is not None else self.backend.engine.version
        if (error := failure(self.choices)) is not None:
            return await send_error(send, error, version)
        build = chat_body if self.chat else completion_body
        body = build(self.job, self.choices, self.backend.names, self.head)
        await send_json(send, 200, body, [_version(version)])

    async def stream(self, send: Send) -> None:
        events = await self.events()
        version = self.version if self.version is not None else self.backend.engine.version
        if events and len({e.choice for e in events if e.token < 0}) == len(self.choices):
            for event in events:  # failed before any token: nothing sent yet, a plain error
                self.accept(event)
            error = failure(self.choices)
            if error is not None:
                return await send_error(send, error, version)
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            _version(version),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.chat:
            for i, _ in enumerate(self.choices):
                await self._send_chunk(send, self._chat_first(i))
        while events is not None:
            for event in events:
                start = len(self.choices[event.choice].token_ids)
                if not self.accept(event):
                    continue
                error = failure([self.choices[event.choice]]) if event.token < 0 else None
                # vLLM's stream form of an error: a data chunk holding the error body
                chunk = error.body() if error is not None else self._chunk(event.choice, start)
                await self._send_chunk(send, chunk)
            events = await self.events()
        if not all(c.finished for c in self.choices):
            return
        if self.job.include_usage:
            await self._send_chunk(
                send,
                {
                    **self.head,
                    "object": self._object(),
                    "choices": [],
                    "usage": usage(self.job, self.choices),
                },
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    async def _send_chunk(self, send: Send, chunk: dict[str, Any]) -> None:
        await send(
            {
                "type": "http.response.body",
                "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                "more_body": True,
            }
        )

    def _chat_first(self, index: int) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            **self.head,
            "object": self._object(),
            "choices": [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if self.job.return_token_ids and index == 0:
            chunk["prompt_token_ids"] = list(self.job.prompt_ids)
        return chunk

    def _chunk(self, index: int, start: int) -> dict[str, Any]:
        choice = self.choices[index]
        ids = choice.token_ids[start:]
        text = choice.stream_text()
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            reason = choice.public_finish_reason()
            if choice.finished and reason == "tool_calls":
                calls = choice.tool_calls()[1]
                delta = {
                    "content": text,
                    "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)],
                }
            entry: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(choice, self.backend.names, start),
                "finish_reason": reason,
            }
        else:
            entry = {
                "index": index,
                "text": (self.job.echo_text or "") + text if start == 0 else text,
                "logprobs": completion_logprobs(
                    choice, self.backend.names, start, self.offsets[index]
                ),
                "finish_reason": choice.finish_reason,
                "prompt_token_ids": list(self.job.prompt_ids)
                if self.job.return_token_ids and start == 0
                else None,
            }
            self.offsets[index] += sum(len(self.backend.names.text(t)) for t in ids)
        if choice.finished:
            entry["stop_reason"] = choice.stop_reason
        if self.job.return_token_ids:
            entry["token_ids"] = ids
        return {**self.head, "object": self._object(), "choices": [entry]}
