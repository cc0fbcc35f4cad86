"""A rollout's calls as readable turns: prompt messages, completions, and what each call added.

In: `CallView`s of one rollout, in order. Out: `CallPage`s whose prompt shows only the messages
that are new since the previous call (the rest is one click away), each text bounded in size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.view.queries import CallView

MAX_TEXT = 20_000  # characters of one message shown inline; the full prompt is on demand
MAX_TURNS = 40  # new messages of one call shown inline (a harness that rewrites its history)


@dataclass(frozen=True)
class Turn:
    role: str
    text: str
    cut: int = 0  # characters left out of `text`


@dataclass(frozen=True)
class Completion:
    index: int
    text: str
    finish_reason: str | None
    tokens: int
    cut: int = 0


@dataclass(frozen=True)
class CallPage:
    view: CallView
    turns: list[Turn]  # the prompt's messages new since the previous call (all for the first)
    earlier: int  # leading messages repeated from the previous call, not shown
    hidden: int  # new messages past MAX_TURNS, not shown (the latest ones are)
    completions: list[Completion]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text parts as text, others as JSON
        return "\n".join(
            p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else _json(p)
            for p in value
        )
    return "" if value is None else _json(value)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _bounded(text: str, limit: int) -> tuple[str, int]:
    return (text, 0) if len(text) <= limit else (text[:limit], len(text) - limit)


def prompt_messages(request: dict[str, Any]) -> list[Any]:
    """The prompt of a request as a list of messages (a completions prompt is one message)."""
    for key in ("messages", "input"):
        found = request.get(key)
        if isinstance(found, list):
            return found
    if "prompt" in request:
        return [{"role": "prompt", "content": request["prompt"]}]
    if isinstance(request.get("input"), str):
        return [{"role": "user", "content": request["input"]}]
    return []


def turn_of(message: Any, limit: int = MAX_TEXT) -> Turn:
    if not isinstance(message, dict):
        text, cut = _bounded(_text(message), limit)
        return Turn("?", text, cut)
    parts = [_text(message.get("content"))]
    for key in ("tool_calls", "function_call", "reasoning_content"):
        if message.get(key):
            value = message[key]
            parts.append(f"{key}: {value if isinstance(value, str) else _json(value)}")
    text, cut = _bounded("\n".join(p for p in parts if p), limit)
    return Turn(str(message.get("role", message.get("type", "?"))), text, cut)


def completions_of(view: CallView) -> list[Completion]:
    call = view.record
    raw = (call.response or {}).get("choices")
    raw = raw if isinstance(raw, list) else []
    out = []
    for c in call.choices:
        text = c.text
        if not text and c.index < len(raw) and isinstance(raw[c.index], dict):
            message = raw[c.index].get("message")
            text = _text(message.get("content")) if isinstance(message, dict) else ""
        shown, cut = _bounded(text, MAX_TEXT)
        out.append(Completion(c.index, shown, c.finish_reason, len(c.token_ids), cut))
    return out


def call_pages(views: Sequence[CallView]) -> list[CallPage]:
    pages = []
    previous: list[Any] = []
    for view in views:
        messages = prompt_messages(view.record.request or {})
        same = 0
        for a, b in zip(previous, messages, strict=False):
            if a != b:
                break
            same += 1
        new = messages[same:]
        hidden = max(0, len(new) - MAX_TURNS)
        turns = [turn_of(m) for m in new[hidden:]]
        pages.append(CallPage(view, turns, same, hidden, completions_of(view)))
        previous = messages
    return pages
