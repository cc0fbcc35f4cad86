"""Serving stage, responses: engine token events → vLLM-shaped choices, bodies and stream chunks.

Each choice detokenizes incrementally, applies stop strings (text is cut, token ids are kept, as
vLLM does), holds back text that may still turn into a stop string or a tool-call tag, and keeps
the sampled ids and raw logprobs for `return_token_ids` / `logprobs`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from harnessrl.engine.decode import TokenEvent
from harnessrl.model.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from harnessrl.serve.protocol import GenerationJob, Tokenizer


class TokenText:
    """Per-token strings and byte lists for logprobs, cached per tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = functools.lru_cache(maxsize=65536)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False)
        )

    def text(self, token: int) -> str:
        return self._decode(token)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that starts one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


@dataclass
class ChoiceState:
    """One choice of a request: its tokens, logprobs and text as they arrive."""

    index: int
    job: GenerationJob
    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set when the engine failed this choice ("abort" or "error")
    _prefix: int = 0
    _read: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _detokenize(self, final: bool) -> str:
        skip = self.job.params.skip_special_tokens
        before = self.tokenizer.decode(
            self.token_ids[self._prefix : self._read], skip_special_tokens=skip
        )
        now = self.tokenizer.decode(self.token_ids[self._prefix :], skip_special_tokens=skip)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, len(self.token_ids)
        return now[len(before) :]

    def add(self, event: TokenEvent) -> bool:
        """Append one token (False if the choice had already finished); may hit a stop string."""
        if self.finished:
            return False
        if event.token < 0:  # the engine ended it without a token (shutdown or fault)
            self.finish_reason, self.error = event.finish_reason, event.error
            return True
        self.token_ids.append(event.token)
        self.logprobs.append(event.logprob)
        self.tops.append(event.top)
        start = len(self.text)
        self.text += self._detokenize(final=event.finish_reason is not None)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        for stop in self.job.params.stop:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                keep = len(stop) if self.job.params.include_stop_str_in_output else 0
                self.text = self.text[: at + keep]
                self.finish_reason, self.stop_reason = "stop", stop
                break
        return True

    def _tool_mode(self) -> bool:
        return bool(self.job.tools)

    def stream_text(self) -> str:
        """Text that is safe to stream now (never part of a stop string or a tool call)."""
        end = len(self.text)
        if self._tool_mode():
            at = self.text.find(TOOL_CALL_OPEN)
            end = at if at >= 0 else end
        if not self.finished:
            markers = (*self.job.params.stop, *((TOOL_CALL_OPEN,) if self._tool_mode() else ()))
            end = min(end, len(self.text) - _holdback(self.text, markers))
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def tool_calls(self) -> tuple[str | None, list[dict[str, Any]]]:
        if not self._tool_mode():
            return self.text, []
        parsed = parse_tool_calls(self.text)
        return parsed.content, parsed.tool_calls

    def public_finish_reason(self) -> str | None:
        if self.finish_reason == "stop" and self.tool_calls()[1]:
            return "tool_calls"
        return self.finish_reason


def chat_logprobs(choice: ChoiceState, names: TokenText, start: int = 0) -> dict[str, Any] | None:
    if choice.job.params.logprobs is None:
        return None
    k = choice.job.params.logprobs
    content = []
    for token, lp, top in zip(
        choice.token_ids[start:], choice.logprobs[start:], choice.tops[start:], strict=True
    ):
        entry = names.entry(token, lp)
        entry["top_logprobs"] = [names.entry(t, v) for t, v in top[:k]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    choice: ChoiceState, names: TokenText, start: int = 0, offset: int = 0
) -> dict[str, Any] | None:
    """The legacy form: text_offset, token_logprobs, tokens, top_logprobs (dicts)."""
    if choice.job.params.logprobs is None:
        return None
    k = choice.job.params.logprobs
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for token, lp, top in zip(
        choice.token_ids[start:], choice.logprobs[start:], choice.tops[start:], strict=True
    ):
        text = names.text(token)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(lp)
        out["tokens"].append(text)
        out["top_logprobs"].append(
            {text: lp, **{names.text(t): v for t, v in top[:k] if t != token}}
        )
        offset += len(text)
    return out


def usage(job: GenerationJob, choices: list[ChoiceState]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    prompt = len(job.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def chat_body(
    job: GenerationJob, choices: list[ChoiceState], names: TokenText, head: dict[str, Any]
) -> dict[str, Any]:
    out = []
    for c in choices:
        content, calls = c.tool_calls()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c, names),
                "finish_reason": c.public_finish_reason(),
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if job.return_token_ids else None,
            }
        )
    return {
        **head,
        "object": "chat.completion",
        "choices": out,
        "usage": usage(job, choices),
        "prompt_logprobs": None,
        "prompt_token_ids": list(job.prompt_ids) if job.return_token_ids else None,
    }


def completion_body(
    job: GenerationJob, choices: list[ChoiceState], names: TokenText, head: dict[str, Any]
) -> dict[str, Any]:
    echo = job.echo_text or ""
    out = [
        {
            "index": c.index,
            "text": echo + c.text,
            "logprobs": completion_logprobs(c, names, offset=len(echo)),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if job.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(job.prompt_ids) if job.return_token_ids else None,
        }
        for c in choices
    ]
    return {**head, "object": "text_completion", "choices": out, "usage": usage(job, choices)}
