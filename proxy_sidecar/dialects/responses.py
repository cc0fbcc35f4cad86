"""The OpenAI Responses dialect (`POST /v1/responses`): input items in, a Response object out.

In: a Responses request (input string or items, instructions, function tools and their outputs,
previous_response_id, store). Out: a `Conversation` for token-in mode; from its `Completion`, the
Response object (message, reasoning and function_call items, usage) or the Responses SSE event
sequence; errors in OpenAI's `{"error": {...}}` shape.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from harnessrl.http.listener import error_body
from proxy_sidecar.dialects.call import (
    Completion,
    Conversation,
    arguments_text,
    function_tool,
    new_id,
    number,
    text_of,
)
from proxy_sidecar.dialects.sse import event
from proxy_sidecar.errors import BadRequest, SidecarError

MAX_STORED = 512  # responses kept for previous_response_id (least recently stored go first)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_UNSUPPORTED = ("background", "conversation", "prompt")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BadRequest(
                f"tools[{i}] is a {kind!r} tool; only function tools are supported",
                param="tools",
            )
        where = f"tools[{i}]"
        out.append(
            function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), where)
        )
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if value in (None, "auto", "required"):
        return tools
    if value == "none":
        return None
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("name"), str)
    ):
        return tools
    raise BadRequest(
        f"tool_choice must be 'none', 'auto', 'required' or a function, got {value!r:.80}",
        param="tool_choice",
    )


def _items(value: Any) -> list[dict[str, Any]]:
    """The input items as chat messages; function calls join the assistant turn before them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("input must be a string or a list of input items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise BadRequest(
                    f"{where}.role must be user, system, developer or assistant, got "
                    f"{item.get('role')!r:.40}",
                    param="input",
                )
            out.append(
                {
                    "role": role,
                    "content": text_of(item.get("content"), f"{where}.content", _TEXT_PARTS),
                }
            )
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise BadRequest(f"{where} needs string name and call_id", param="input")
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments_text(item.get("arguments", "{}"), f"{where}.arguments"),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}.call_id must be a string", param="input")
            output = text_of(item.get("output"), f"{where}.output", _TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # its text is inside the sampled ids of the turn it belongs to
        else:
            raise BadRequest(f"{where} is a {kind!r:.40} item; not supported", param="input")
    return out


class Responses:
    """The dialect, with the responses kept for `previous_response_id` (unless `store: false`)."""

    name = "responses"

    def __init__(self, max_stored: int = MAX_STORED) -> None:
        self.max_stored = max_stored
        self._stored: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def parse(self, body: dict[str, Any]) -> Conversation:
        for key in _UNSUPPORTED:
            if body.get(key):
                raise BadRequest(f"{key!r} is not supported by this server", param=key)
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or previous not in self._stored:
                raise BadRequest(
                    f"Previous response with id {previous!r:.80} not found (responses made with "
                    "store: false are not kept)",
                    param="previous_response_id",
                )
            history = list(self._stored[previous])
        if "input" not in body:
            raise BadRequest("input is required: a string or a list of input items", param="input")
        history += _items(body["input"])
        if not history:
            raise BadRequest("input must hold at least one item", param="input")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
        tools = _tool_choice(body.get("tool_choice"), _tools(body.get("tools")))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", param="stream")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("model must be a string", param="model")
        sampling = {
            "max_tokens": number(body, "max_output_tokens", integer=True, low=1),
            "temperature": number(body, "temperature"),
            "top_p": number(body, "top_p"),
        }
        sampling = {k: v for k, v in sampling.items() if v is not None}
        extra = {"history": history, "body": body}
        return Conversation(messages, tools, sampling, stream, model, extra)

    def remember(self, conv: Conversation, done: Completion, reply: dict[str, Any]) -> None:
        body = conv.extra["body"]
        if body.get("store") is False:
            return
        self._stored[reply["id"]] = [*conv.extra["history"], done.message()]
        while len(self._stored) > self.max_stored:
            self._stored.popitem(last=False)

    def error(self, err: SidecarError) -> dict[str, Any]:
        return error_body(err.status, err.message, err.type, err.param)

    def stream_error(self, err: SidecarError) -> bytes:
        data = {
            "type": "error",
            "code": err.type,
            "message": err.message,
            "param": err.param,
            "sequence_number": 0,
        }
        return event("error", data)

    def writer(self, conv: Conversation, served: str, prompt_len: int) -> ResponseWriter:
        return ResponseWriter(conv, served)

    def reply(self, conv: Conversation, done: Completion, served: str) -> dict[str, Any]:
        writer = ResponseWriter(conv, served)
        return writer.response(done, writer.items(done))


class ResponseWriter:
    """Builds one Response, whole or as its SSE events, with one set of item ids."""

    def __init__(self, conv: Conversation, served: str) -> None:
        self.conv = conv
        self.body: dict[str, Any] = conv.extra["body"]
        self.model = served
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.seq = 0
        self.msg_id, self.rs_id = new_id("msg_"), new_id("rs_")
        self.open: list[str] = []  # "reasoning", "message": items added to the stream, in order
        self.sent = {"reasoning": "", "message": ""}

    def response(self, done: Completion | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        status = "in_progress"
        incomplete = None
        if done is not None:
            status = "incomplete" if done.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if done is not None:
            n_in, n_out = len(done.prompt_ids), len(done.token_ids)
            usage = {
                "input_tokens": n_in,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + n_out,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "metadata": body["metadata"] if isinstance(body.get("metadata"), dict) else {},
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [_text_part(text)]
        return {
            "type": "message",
            "id": self.msg_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _reasoning(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": self.rs_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def items(self, done: Completion) -> list[dict[str, Any]]:
        """The output items of the finished response, in the order the stream added them."""
        order = list(self.open)
        if done.reasoning and "reasoning" not in order:
            order.insert(0 if not order else len(order), "reasoning")
        if (done.content or not done.tool_calls) and "message" not in order:
            order.append("message")
        out = []
        for kind in order:
            if kind == "reasoning":
                out.append(self._reasoning(done.reasoning or "", "completed"))
            else:
                out.append(self._message(done.content or "", "completed"))
        for call in done.tool_calls:
            out.append(
                {
                    "type": "function_call",
                    "id": "fc_" + call["id"][-24:],
                    "call_id": "call_" + call["id"][-24:],
                    "name": call["name"],
                    "arguments": call["arguments"],
                    "status": "completed",
                }
            )
        return out

    def _event(self, name: str, /, **data: Any) -> bytes:
        out = event(name, {"type": name, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def start(self) -> bytes:
        head = self.response(None, [])
        return self._event("response.created", response=head) + self._event(
            "response.in_progress", response=head
        )

    def _ids(self, kind: str) -> dict[str, Any]:
        item_id = self.rs_id if kind == "reasoning" else self.msg_id
        return {"item_id": item_id, "output_index": self.open.index(kind), "content_index": 0}

    def _add(self, kind: str) -> bytes:
        self.open.append(kind)
        if kind == "reasoning":
            item, part = self._reasoning("", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = self._message("", "in_progress"), _text_part("")
        ids = self._ids(kind)
        return self._event(
            "response.output_item.added", output_index=ids["output_index"], item=item
        ) + self._event("response.content_part.added", part=part, **ids)

    def delta(self, kind: str, text: str) -> bytes:
        """`kind` "reasoning" or "message": new text of that item."""
        if not text:
            return b""
        out = b"" if kind in self.open else self._add(kind)
        self.sent[kind] += text
        if kind == "reasoning":
            return out + self._event("response.reasoning_text.delta", delta=text, **self._ids(kind))
        return out + self._event(
            "response.output_text.delta", delta=text, logprobs=[], **self._ids(kind)
        )

    def finish(self, done: Completion) -> tuple[bytes, dict[str, Any]]:
        """The closing events (the completed Response last) and that Response."""
        out = b""
        for kind, final in (("reasoning", done.reasoning or ""), ("message", done.content or "")):
            if final.startswith(self.sent[kind]):
                out += self.delta(kind, final[len(self.sent[kind]) :])
        items = self.items(done)
        for index, item in enumerate(items):
            kind = "reasoning" if item["type"] == "reasoning" else item["type"]
            if kind in ("reasoning", "message"):
                if kind not in self.open:
                    out += self._add(kind)
                ids = self._ids(kind)
                if kind == "reasoning":
                    text = done.reasoning or ""
                    out += self._event("response.reasoning_text.done", text=text, **ids)
                    part = {"type": "reasoning_text", "text": text}
                else:
                    text = done.content or ""
                    out += self._event("response.output_text.done", text=text, logprobs=[], **ids)
                    part = _text_part(text)
                out += self._event("response.content_part.done", part=part, **ids)
            else:
                added = {**item, "arguments": "", "status": "in_progress"}
                out += self._event("response.output_item.added", output_index=index, item=added)
                ids = {"item_id": item["id"], "output_index": index}
                out += self._event(
                    "response.function_call_arguments.delta", delta=item["arguments"], **ids
                )
                out += self._event(
                    "response.function_call_arguments.done",
                    arguments=item["arguments"],
                    name=item["name"],
                    **ids,
                )
            out += self._event("response.output_item.done", output_index=index, item=item)
        reply = self.response(done, items)
        name = "response.incomplete" if reply["status"] == "incomplete" else "response.completed"
        return out + self._event(name, response=reply), reply


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
