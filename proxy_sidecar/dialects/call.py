"""The one internal call every dialect converts to and from.

In: a dialect's request, parsed into a `Conversation` (chat-shaped messages, tools, the sampling
fields of an upstream `/v1/completions` body). Out: a `Completion`, the upstream's sampled ids and
logprobs with the text split the model family's way: reasoning (`<think>`), content, and hermes
`<tool_call>` JSON blocks.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from harnessrl.model.tool_calls import parse_tool_calls
from harnessrl.traces.schema import Choice
from proxy_sidecar.errors import BadRequest

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK = re.compile(r"\s*<think>(.*?)(?:</think>|\Z)\s*", re.DOTALL)


@dataclass
class Conversation:
    """What the harness asked for, dialect-free."""

    messages: list[dict[str, Any]]  # OpenAI chat shape: role, content (str), tool_calls, ...
    tools: list[dict[str, Any]] | None  # OpenAI chat tools: {"type": "function", "function": {}}
    sampling: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, stop, ...
    stream: bool = False
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # what only the dialect itself reads


@dataclass(frozen=True)
class Completion:
    """The upstream's one choice, as every dialect answers it."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str | None  # stop | length | tool_calls (upstream's stop/length, or ours)
    stop_sequence: str | None  # the stop string that ended it, if one did
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments" (JSON text)}]

    def message(self) -> dict[str, Any]:
        """The assistant turn in chat shape: what the ledger matches echoed history against."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.tool_calls
            ]
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def split_output(text: str, tools: bool) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Completion text → (reasoning, content, tool calls) in the hermes/Qwen conventions."""
    reasoning = None
    match = _THINK.match(text) if text.lstrip().startswith(THINK_OPEN) else None
    if match is not None:
        reasoning, text = match.group(1), text[match.end() :]
    if not tools:
        return reasoning, text, []
    parsed = parse_tool_calls(text)
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in parsed.tool_calls
    ]
    return reasoning, parsed.content, calls


def completion_of(
    choice: Choice, prompt: tuple[int, ...], raw: dict[str, Any], tools: bool
) -> Completion:
    """A `Completion` from the parsed choice and the upstream's raw choice object."""
    reasoning, content, calls = split_output(choice.text, tools)
    stop = raw.get("stop_reason")
    finish = choice.finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    return Completion(
        prompt_ids=prompt,
        token_ids=choice.token_ids,
        logprobs=choice.logprobs,
        text=choice.text,
        finish_reason=finish,
        stop_sequence=stop if isinstance(stop, str) else None,
        reasoning=reasoning,
        content=content,
        tool_calls=calls,
    )


def arguments_text(value: Any, where: str) -> str:
    """Tool-call arguments as JSON text (dialects send objects or strings)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise BadRequest(f"{where} must be a JSON object or a JSON string, got {type(value).__name__}")


def text_of(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or the text of a list of text parts whose `type` is one of `kinds`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in kinds:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{where}[{i}] is a {kind!r} part; only {', '.join(kinds)} parts are supported "
                    "(the model reads text only)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{where}[{i}].text must be a string")
            out.append(text)
        return "".join(out)
    raise BadRequest(
        f"{where} must be a string or a list of text parts, got {type(value).__name__}"
    )


def number(body: dict[str, Any], key: str, *, integer: bool = False, low: float = 0.0) -> Any:
    """An optional numeric field (None if absent); BadRequest names a bad one."""
    value: Any = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
        or not math.isfinite(value)
        or value < low
    ):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{key!r} must be {kind} >= {low:g}, got {value!r:.50}", param=key)
    return value


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """One tool in the chat shape the chat templates take."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a non-empty string", param="tools")
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(f"{where}.description must be a string", param="tools")
        fn["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise BadRequest(f"{where} parameters must be a JSON schema object", param="tools")
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}
