"""The Anthropic Messages dialect (`POST /v1/messages`): content blocks in, a Message out.

In: a Messages request (system, messages of text / tool_use / tool_result blocks, tools,
stop_sequences). Out: a `Conversation` for token-in mode; from its `Completion`, the Message
(thinking, text and tool_use blocks, stop_reason, usage) or the Messages SSE event sequence;
errors in Anthropic's `{"type": "error", "error": {...}}` shape.
"""

from __future__ import annotations

import json
from typing import Any

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

_TEXT = ("text",)
# SidecarError types → Anthropic's error types.
_KINDS = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "not_found_error": "not_found_error",
    "service_unavailable": "overloaded_error",
}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}[{i}] must be a content block object with a type")
    return content


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its text, and each tool_result block as a tool message, in their order."""
    out: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "text":
            text = text_of([block], where, _TEXT)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}[{i}].tool_use_id must be a string")
            result = block.get("content", "")
            text = text_of(result, f"{where}[{i}].content", _TEXT)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise BadRequest(
                f"{where}[{i}] is a {kind!r:.40} block; user turns may hold text and tool_result "
                "blocks (the model reads text only)"
            )
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    text, calls = "", []
    for i, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "text":
            text += text_of([block], where, _TEXT)
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise BadRequest(f"{where}[{i}] needs string id and name")
            arguments = arguments_text(block.get("input", {}), f"{where}[{i}].input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # its text is inside the sampled ids of this turn
        else:
            raise BadRequest(
                f"{where}[{i}] is a {kind!r:.40} block; not supported in assistant turns"
            )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(value: Any, choice: Any) -> list[dict[str, Any]] | None:
    if choice is not None and (
        not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none")
    ):
        raise BadRequest(
            f"tool_choice must be an object of type auto, any, tool or none, got {choice!r:.80}"
        )
    if value is None or value == [] or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    if not isinstance(value, list):
        raise BadRequest("tools must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BadRequest(
                f"tools[{i}] is a {kind!r:.40} tool; only client tools (name, input_schema) are supported"
            )
        out.append(
            function_tool(
                tool.get("name"), tool.get("description"), tool.get("input_schema"), f"tools[{i}]"
            )
        )
    return out


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("stop_sequences must be a list of non-empty strings")
    return value


class Messages:
    """The dialect (it keeps no state: every Messages request carries its whole history)."""

    name = "messages"

    def parse(self, body: dict[str, Any]) -> Conversation:
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("model: field required (a string)")
        if number(body, "max_tokens", integer=True, low=1) is None:
            raise BadRequest("max_tokens: field required (an integer >= 1)")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list")
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if system is not None:
            text = text_of(system, "system", _TEXT)
            if text:
                messages.append({"role": "system", "content": text})
        for i, message in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
                raise BadRequest(f"{where} must be an object with role user or assistant")
            if message["role"] == "user":
                messages += _user(message.get("content"), f"{where}.content")
            else:
                messages.append(_assistant(message.get("content"), f"{where}.content"))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean")
        sampling = {
            "max_tokens": body["max_tokens"],
            "temperature": number(body, "temperature"),
            "top_p": number(body, "top_p"),
            "top_k": number(body, "top_k", integer=True, low=1),
            "stop": _stop(body.get("stop_sequences")),
        }
        tools = _tools(body.get("tools"), body.get("tool_choice"))
        kept = {k: v for k, v in sampling.items() if v is not None}
        return Conversation(messages, tools, kept, stream, model, {"body": body})

    def remember(self, conv: Conversation, done: Completion, reply: dict[str, Any]) -> None:
        return None

    def error(self, err: SidecarError) -> dict[str, Any]:
        kind = _KINDS.get(err.type, "invalid_request_error" if err.status < 500 else "api_error")
        if err.status == 413:
            kind = "request_too_large"
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def stream_error(self, err: SidecarError) -> bytes:
        return event("error", self.error(err))

    def writer(self, conv: Conversation, served: str, prompt_len: int) -> MessageWriter:
        return MessageWriter(conv, served, prompt_len)

    def reply(self, conv: Conversation, done: Completion, served: str) -> dict[str, Any]:
        writer = MessageWriter(conv, served)
        return writer.message(done, writer.blocks(done))


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def stop_reason(done: Completion) -> str:
    if done.finish_reason == "length":
        return "max_tokens"
    if done.tool_calls:
        return "tool_use"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


class MessageWriter:
    """Builds one Message, whole or as its SSE events, with one id."""

    def __init__(self, conv: Conversation, served: str, prompt_len: int = 0) -> None:
        self.conv = conv
        self.model = served
        self.prompt_len = prompt_len
        self.id = new_id("msg_")
        self.open: list[str] = []  # "reasoning", "message": blocks started in the stream, in order
        self.closed = 0  # blocks of `open` already stopped
        self.sent = {"reasoning": "", "message": ""}

    def message(self, done: Completion | None, content: list[dict[str, Any]]) -> dict[str, Any]:
        usage = {
            "input_tokens": len(done.prompt_ids) if done else 0,
            "output_tokens": len(done.token_ids) if done else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(done) if done else None,
            "stop_sequence": done.stop_sequence if done else None,
            "usage": usage,
        }

    def blocks(self, done: Completion) -> list[dict[str, Any]]:
        order = list(self.open)
        if done.reasoning and "reasoning" not in order:
            order.insert(0 if not order else len(order), "reasoning")
        if (done.content or not done.tool_calls) and "message" not in order:
            order.append("message")
        out: list[dict[str, Any]] = []
        for kind in order:
            if kind == "reasoning":
                out.append({"type": "thinking", "thinking": done.reasoning or "", "signature": ""})
            else:
                out.append({"type": "text", "text": done.content or ""})
        for call in done.tool_calls:
            tool_id = "toolu_" + call["id"][-24:]
            out.append(
                {
                    "type": "tool_use",
                    "id": tool_id,
                    "name": call["name"],
                    "input": _input(call["arguments"]),
                }
            )
        return out

    def start(self) -> bytes:
        head = self.message(None, [])
        head["usage"]["input_tokens"] = self.prompt_len
        return event("message_start", {"type": "message_start", "message": head}) + event(
            "ping", {"type": "ping"}
        )

    def _stop_open(self) -> bytes:
        out = b""
        while self.closed < len(self.open):
            out += event("content_block_stop", {"type": "content_block_stop", "index": self.closed})
            self.closed += 1
        return out

    def _start(self, kind: str) -> bytes:
        out = self._stop_open()  # one block at a time: reasoning ends before the text starts
        self.open.append(kind)
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "reasoning"
            else {"type": "text", "text": ""}
        )
        data = {"type": "content_block_start", "index": len(self.open) - 1, "content_block": block}
        return out + event("content_block_start", data)

    def delta(self, kind: str, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if kind in self.open else self._start(kind)
        self.sent[kind] += text
        index = self.open.index(kind)
        if kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        return out + event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def finish(self, done: Completion) -> tuple[bytes, dict[str, Any]]:
        """The closing events (message_stop last) and the whole Message."""
        out = b""
        if "message" not in self.open and (done.reasoning or "").startswith(self.sent["reasoning"]):
            out += self.delta("reasoning", (done.reasoning or "")[len(self.sent["reasoning"]) :])
        if (done.content or "").startswith(self.sent["message"]):
            out += self.delta("message", (done.content or "")[len(self.sent["message"]) :])
        blocks = self.blocks(done)
        for index, block in enumerate(blocks[len(self.open) :], start=len(self.open)):
            if block["type"] != "tool_use":  # an empty block the stream never started
                out += self._start("reasoning" if block["type"] == "thinking" else "message")
                continue
            out += self._stop_open()
            start = {**block, "input": {}}
            partial = json.dumps(block["input"], ensure_ascii=False)
            out += event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": start},
            )
            out += event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": partial},
                },
            )
            self.open.append("tool")
        out += self._stop_open()
        reply = self.message(done, blocks)
        delta = {"stop_reason": reply["stop_reason"], "stop_sequence": reply["stop_sequence"]}
        usage = {"output_tokens": reply["usage"]["output_tokens"]}
        out += event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        return out + event("message_stop", {"type": "message_stop"}), reply
