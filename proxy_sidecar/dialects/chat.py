"""The OpenAI Chat Completions dialect in token-in mode (`POST /v1/chat/completions`).

In: a chat request (system/developer/user/assistant/tool messages of text, assistant tool calls,
function tools, sampling fields, `logprobs` and vLLM's `return_token_ids`). Out: a `Conversation`;
from its `Completion`, the `chat.completion` object or the `chat.completion.chunk` stream in
vLLM's shape (tool calls with ids, finish_reason, usage, and when asked the sampled ids, the prompt
ids and the sampled tokens' logprobs); errors in OpenAI's `{"error": {...}}` shape.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import orjson

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
from proxy_sidecar.errors import BadRequest, SidecarError

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT = ("text",)
# Sampling fields forwarded to the upstream's /v1/completions as they are: (name, integer, low).
_NUMBERS = (
    ("temperature", False, 0.0), ("top_p", False, 0.0), ("min_p", False, 0.0),
    ("top_k", True, -1.0), ("presence_penalty", False, -2.0), ("frequency_penalty", False, -2.0),
    ("repetition_penalty", False, 0.0), ("seed", True, -(2.0**63)), ("min_tokens", True, 0.0),
)  # fmt: skip
# Fields whose meaning token-in mode cannot keep: refused rather than silently ignored.
_REFUSED = {
    "functions": "the legacy functions field is not supported: send tools",
    "function_call": "the legacy function_call field is not supported: send tool_choice",
    "audio": "audio output is not supported (the model writes text only)",
    "prediction": "predicted outputs are not supported",
}


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list of tool calls", param="messages")
    out = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}[{i}] needs a function with a string name", param="messages")
        if not isinstance(call.get("id", ""), str):
            raise BadRequest(f"{where}[{i}].id must be a string", param="messages")
        arguments = arguments_text(fn.get("arguments", "{}"), f"{where}[{i}].function.arguments")
        function = {"name": fn["name"], "arguments": arguments}
        out.append({"id": call.get("id") or f"call_{i}", "type": "function", "function": function})
    return out


def _message(message: Any, where: str) -> dict[str, Any]:
    """One chat message as the templates take it; reasoning is dropped (inside the sampled ids)."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object", param="messages")
    given = message.get("role")
    if given == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise BadRequest(f"{where}.tool_call_id must be a string", param="messages")
        text = text_of(message.get("content", ""), f"{where}.content", _TEXT)
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise BadRequest(
            f"{where}.role must be system, developer, user, assistant or tool, got {given!r:.40}",
            param="messages",
        )
    content = message.get("content")
    if content is None and role != "assistant":
        raise BadRequest(f"{where}.content is required for a {given} message", param="messages")
    text = text_of(content or "", f"{where}.content", _TEXT)
    out: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _calls(message["tool_calls"], f"{where}.tool_calls")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _tools(value: Any, choice: Any) -> list[dict[str, Any]] | None:
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice not in (None, "none", "auto", "required") and not named:
        raise BadRequest(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r:.80}",
            param="tool_choice",
        )
    if value is None or value == [] or choice == "none":
        return None
    if not isinstance(value, list):
        raise BadRequest("tools must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise BadRequest(
                f"tools[{i}] must be a function tool with a function object", param="tools"
            )
        where = f"tools[{i}].function"
        out.append(
            function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where)
        )
    return out


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean", param=key)
    return bool(value)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    limit = number(body, "max_completion_tokens", integer=True, low=1)
    out = {
        "max_tokens": number(body, "max_tokens", integer=True, low=1) if limit is None else limit
    }
    for key, integer, low in _NUMBERS:
        out[key] = number(body, key, integer=integer, low=low)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
    ):
        raise BadRequest("stop must be a string or a list of strings", param="stop")
    out["stop"] = stop or None
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object of token id → bias", param="logit_bias")
    out["logit_bias"] = bias or None
    return {k: v for k, v in out.items() if v is not None}


class Chat:
    """The dialect; `tokenin.renderer.tokenizer` names each sampled token in logprobs (read when
    a reply is built: a route is only served once the tokenizer is loaded)."""

    name = "chat"

    def __init__(self, tokenin: Any) -> None:
        self.tokenin = tokenin

    def _tokens(self) -> Any:
        return self.tokenin.renderer.tokenizer

    def parse(self, body: dict[str, Any]) -> Conversation:
        for key, why in _REFUSED.items():
            if body.get(key) is not None:
                raise BadRequest(f"{key!r}: {why}", param=key)
        if body.get("n") not in (None, 1):
            raise BadRequest(
                f"n must be 1 in token-in mode, got {body.get('n')!r:.20}: send one request per "
                "sample (each continues its own history)",
                param="n",
            )
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise BadRequest(
                "structured output (response_format) is not supported", param="response_format"
            )
        if number(body, "top_logprobs", integer=True) not in (None, 0):
            raise BadRequest(
                "top_logprobs is not supported in token-in mode: logprobs=true gives the logprobs "
                "of the sampled tokens",
                param="top_logprobs",
            )
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list", param="messages")
        messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
        tools = _tools(body.get("tools"), body.get("tool_choice"))
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("model must be a string", param="model")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        extra = {
            "logprobs": _flag(body, "logprobs"),
            "token_ids": _flag(body, "return_token_ids"),
            "usage": bool((options or {}).get("include_usage")),
        }
        return Conversation(messages, tools, _sampling(body), _flag(body, "stream"), model, extra)

    def remember(self, conv: Conversation, done: Completion, reply: dict[str, Any]) -> None:
        pass  # every chat request carries its whole history

    def error(self, err: SidecarError) -> dict[str, Any]:
        return error_body(err.status, err.message, err.type, err.param)

    def stream_error(self, err: SidecarError) -> bytes:
        return b"data: " + orjson.dumps(self.error(err)) + b"\n\n"

    def writer(self, conv: Conversation, served: str, prompt_len: int) -> ChatWriter:
        return ChatWriter(conv, served, self._tokens())

    def reply(self, conv: Conversation, done: Completion, served: str) -> dict[str, Any]:
        return ChatWriter(conv, served, self._tokens()).completion(done)


class ChatWriter:
    """One chat completion, whole or as its chunks, with one id."""

    def __init__(self, conv: Conversation, served: str, tokens: Any) -> None:
        self.opts = conv.extra
        self.model = served
        self.id = new_id("chatcmpl-")
        self.created = int(time.time())
        self.sent = {"reasoning": "", "message": ""}
        self._name = functools.lru_cache(maxsize=4096)(
            lambda t: tokens.decode([t], skip_special_tokens=False)
        )

    def _logprobs(self, done: Completion) -> dict[str, Any] | None:
        if not self.opts["logprobs"]:
            return None
        content = []
        for token, logprob in zip(done.token_ids, done.logprobs, strict=True):
            text = self._name(token)
            entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            content.append({**entry, "top_logprobs": []})
        return {"content": content}

    @staticmethod
    def _tool_calls(done: Completion) -> list[dict[str, Any]]:
        return [
            {"id": "call_" + c["id"][-24:], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in done.tool_calls
        ]  # fmt: skip

    def completion(self, done: Completion) -> dict[str, Any]:
        """The `chat.completion` object."""
        message: dict[str, Any] = {"role": "assistant", "content": done.content or ""}
        if done.tool_calls:
            message["content"] = done.content or None
            message["tool_calls"] = self._tool_calls(done)
        if done.reasoning is not None:
            message["reasoning"] = done.reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(done),
            "finish_reason": done.finish_reason,
            "stop_reason": done.stop_sequence,
        }
        n_in, n_out = len(done.prompt_ids), len(done.token_ids)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        out = self._head("chat.completion", [choice], usage=usage)
        if self.opts["token_ids"]:
            choice["token_ids"] = list(done.token_ids)
            out["prompt_token_ids"] = list(done.prompt_ids)
        return out

    def _head(self, kind: str, choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **top}

    def _frame(self, choices: list[dict[str, Any]], **top: Any) -> bytes:
        return (
            b"data: " + orjson.dumps(self._head("chat.completion.chunk", choices, **top)) + b"\n\n"
        )

    def _chunk(self, delta: dict[str, Any], **fields: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._frame([{**choice, **fields}])

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, kind: str, text: str) -> bytes:
        """`kind` "reasoning" or "message": new text of that part."""
        if not text:
            return b""
        self.sent[kind] += text
        return self._chunk({"reasoning" if kind == "reasoning" else "content": text})

    def finish(self, done: Completion) -> tuple[bytes, dict[str, Any]]:
        """The closing chunks and `[DONE]`, and the whole `chat.completion` they add up to.

        The sampled ids and logprobs travel on the chunk with the finish_reason (their
        concatenation over the chunks is the same as vLLM's, which spreads them over the text)."""
        out = b""
        for kind, final in (("reasoning", done.reasoning or ""), ("message", done.content or "")):
            if final.startswith(self.sent[kind]):
                out += self.delta(kind, final[len(self.sent[kind]) :])
        reply = self.completion(done)
        calls = self._tool_calls(done)
        if calls:
            out += self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        choice = dict(reply["choices"][0])
        del choice["message"]
        top = {k: reply[k] for k in ("prompt_token_ids",) if k in reply}  # vLLM: on one chunk
        out += self._frame([{**choice, "delta": {}}], **top)
        if self.opts["usage"]:
            out += self._frame([], usage=reply["usage"])
        return out + b"data: [DONE]\n\n", reply
