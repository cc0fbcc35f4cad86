"""Token-in template input: a conversation in chat form as chat templates take it, and the key
that matches an assistant turn across calls and dialects.

In: chat messages (OpenAI chat shape, as every dialect converts to). Out: the messages a chat
template renders (tool-call arguments as objects, or as hermes text for templates that know no
`tool_calls`), and each assistant turn's key (its text and tool calls, arguments as canonical JSON).
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

MEMO_SIZE, MEMO_CHARS = 4096, 4096  # tool-call arguments remembered parsed: how many, how long


def _canonical_arguments(arguments: Any) -> str:
    """Tool arguments as one canonical JSON text, so `{"a":1}` and `{"a": 1}` match."""
    if isinstance(arguments, str):
        if len(arguments) <= MEMO_CHARS:
            return _canonical_text(arguments)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return str(arguments)
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


# An agent loop sends the same history call after call: the arguments of its tool calls are
# parsed and written again every call, for every turn, unless remembered (bounded: short ones).
@functools.lru_cache(maxsize=MEMO_SIZE)
def _canonical_text(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


@functools.lru_cache(maxsize=MEMO_SIZE)
def _parsed_arguments(arguments: str) -> Any:
    """Shared by the calls that hold the same text: templates run sandboxed, immutable."""
    return json.loads(arguments)


def _hermes(name: Any, arguments: Any) -> str:
    """A tool call as hermes text, for templates that know no `tool_calls`."""
    if isinstance(name, str) and isinstance(arguments, str) and len(arguments) <= MEMO_CHARS:
        return _hermes_text(name, arguments)
    return _hermes_block(name, arguments)


@functools.lru_cache(maxsize=MEMO_SIZE)
def _hermes_text(name: str, arguments: str) -> str:
    return _hermes_block(name, arguments)


def _hermes_block(name: Any, arguments: Any) -> str:
    call = {"name": name, "arguments": _template_arguments(arguments)}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _template_arguments(arguments: Any) -> Any:
    """Arguments as objects where they are JSON text (as vLLM passes them to templates)."""
    if not isinstance(arguments, str):
        return arguments
    with contextlib.suppress(json.JSONDecodeError):
        if len(arguments) <= MEMO_CHARS:
            return _parsed_arguments(arguments)
        return json.loads(arguments)
    return arguments


def turn_key(message: dict[str, Any]) -> str:
    """What identifies an assistant turn across dialects: its text and its tool calls."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        calls.append([str(fn.get("name")), _canonical_arguments(fn.get("arguments", {}))])
    return json.dumps([text, calls], ensure_ascii=False)


def template_messages(messages: list[dict[str, Any]], hermes: bool) -> list[dict[str, Any]]:
    """Messages as chat templates take them: arguments as objects (as vLLM passes them), content
    never None; `hermes`: templates that know no `tool_calls` get them as hermes text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            if hermes:
                blocks = [_hermes(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                text = message.get("content") or ""
                message["content"] = (text + "\n" if text else "") + "\n".join(blocks)
                del message["tool_calls"]
            else:
                parsed = []
                for call in calls:
                    fn = dict(call["function"])
                    fn["arguments"] = _template_arguments(fn["arguments"])
                    parsed.append({**call, "function": fn})
                message["tool_calls"] = parsed
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out
