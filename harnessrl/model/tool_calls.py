"""Model stage, tool calls: request `tools` → validated list; completion text → `tool_calls`.

The format is the hermes one that SmolLM2/Qwen-style templates define and vLLM's `hermes` parser
reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of times.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
# An unclosed final block still counts: generation may stop on the closing tag or on EOS.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ParsedTools:
    """Completion text split into the content before the first call and the calls themselves."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def validate_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The request's `tools`/`tool_choice` → tools to render, or None; ValueError on bad shapes."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice={tool_choice!r} needs a `tools` list")
        return None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of function tools, got {tools!r}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
    if tool_choice not in (None, "none", "auto", "required") and not isinstance(tool_choice, dict):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}"
        )
    return None if tool_choice == "none" else tools


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> ParsedTools:
    """Text → content + OpenAI `tool_calls`; text with no parseable call stays plain content."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedTools(content=text, tool_calls=[])
    calls: list[dict[str, Any]] = []
    for match in _BLOCK.finditer(text, start):
        raw = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            return ParsedTools(content=text, tool_calls=[])
        name = payload.get("name") if isinstance(payload, dict) else None
        if not isinstance(name, str):
            return ParsedTools(content=text, tool_calls=[])
        arguments = payload.get("arguments", payload.get("parameters", {}))
        calls.append(
            {
                "id": new_tool_call_id(),
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content = text[:start]
    return ParsedTools(content=content if content.strip() else None, tool_calls=calls)
