"""A scripted model server that plays a coding agent's moves, for mini-swe-agent to run unchanged.

Answers `POST /v1/chat/completions` as vLLM does for a capturing proxy (`prompt_token_ids`,
per-choice `token_ids` and logprobs) with the SmolLM2 tokenizer the tiny model uses: prompts are
rendered with its chat template, replies are its token ids plus the end-of-turn token, so every id
is valid for the learner and each prompt is the one the embedded server would see. A reply's
logprobs are those of a uniform policy over the vocabulary (about the tiny random model's).

A conversation plays one `Script`: the k-th reply runs the script's k-th command, as a
```mswea_bash_command block in the text or, when the request offers tools, as a bash tool call.
A new conversation about a task (matched by a phrase of its first user message) gets the next of
that task's scripts in turn; a running one is told apart by its first command.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
THOUGHT = "THOUGHT: the next step of the plan."


@dataclass(frozen=True)
class Script:
    """The commands of one run; the first must tell this script apart from the task's others."""

    commands: tuple[str, ...]

    def command(self, turn: int) -> str:
        return self.commands[turn] if turn < len(self.commands) else SUBMIT


def apply_patch_command(patch: str) -> str:
    """A shell command that applies `patch` in the repository, as an agent would type it."""
    marker = "HARNESSRL_PATCH_END"
    assert marker not in patch
    return f"git apply <<'{marker}'\n{patch}{marker}"


def _command_of(message: dict[str, Any]) -> str | None:
    """The command an earlier assistant reply ran (text block or tool call)."""
    for call in message.get("tool_calls") or []:
        return str(json.loads(call["function"]["arguments"])["command"])
    content = message.get("content") or ""
    start = content.find("```mswea_bash_command\n")
    if start < 0:
        return None
    body = content[start + len("```mswea_bash_command\n") :]
    return body[: body.rfind("\n```")]


class ScriptedAgent:
    """State of one scripted server; `.app` is its ASGI app, `.requests` what it was sent."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[Script]], model: str) -> None:
        self.tokenizer, self.scripts, self.model = tokenizer, scripts, model
        self._turns: dict[str, Iterator[Script]] = {
            k: itertools.cycle(v) for k, v in scripts.items()
        }
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.logprob = -math.log(tokenizer.vocab_size)
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def _script(self, messages: list[dict[str, Any]]) -> Script:
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        phrase = next((p for p in self.scripts if p in first_user), None)
        if phrase is None:
            raise ValueError("no script for this conversation")
        replies = [m for m in messages if m["role"] == "assistant"]
        if not replies:
            with self._lock:
                return next(self._turns[phrase])
        first = _command_of(replies[0])
        return next(s for s in self.scripts[phrase] if s.commands[0] == first)

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        try:
            script = self._script(messages)
        except ValueError as err:
            return JSONResponse({"error": {"message": str(err), "code": 400}}, status_code=400)
        turn = sum(1 for m in messages if m["role"] == "assistant")
        command = script.command(turn)
        tools = body.get("tools")
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools)
        if tools:  # the hermes format the embedded server and vLLM's parser read
            call = json.dumps({"name": "bash", "arguments": {"command": command}})
            text = f"{THOUGHT}\n<tool_call>\n{call}\n</tool_call>"
            message: dict[str, Any] = {
                "role": "assistant",
                "content": THOUGHT,
                "tool_calls": [
                    {
                        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": command})},
                    }
                ],
            }
            finish = "tool_calls"
        else:
            text = f"{THOUGHT}\n\n```mswea_bash_command\n{command}\n```"
            message, finish = {"role": "assistant", "content": text}, "stop"
        ids = [*self.tokenizer.encode(text), *self.tokenizer.eos_token_ids[:1]]
        if len(ids) > body.get("max_tokens", len(ids)):
            return JSONResponse(
                {"error": {"message": f"a scripted reply of {len(ids)} tokens is over max_tokens"}},
                status_code=400,
            )
        return JSONResponse(self._body(body, prompt, ids, message, finish))

    def _body(
        self, body: dict[str, Any], prompt: list[int], ids: list[int], message: Any, finish: str
    ) -> dict[str, Any]:
        content = [
            {"token": self.tokenizer.decode([t]), "logprob": self.logprob, "bytes": None,
             "top_logprobs": []}
            for t in ids
        ]  # fmt: skip
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": content} if body.get("logprobs") else None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids if body.get("return_token_ids") else None,
        }
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [choice],
            "usage": {**usage, "total_tokens": len(prompt) + len(ids)},
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        }
