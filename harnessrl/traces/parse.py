"""vLLM-dialect responses -> (prompt token ids, sampled choices): the one parser of server output.

In: a chat or completions response body (or the data payloads of its SSE stream, assembled here
into the equivalent non-streaming body). Out: the server's own prompt ids and, per choice, the
sampled token ids with their logprobs. Nothing is ever re-tokenized.
"""

from __future__ import annotations

from typing import Any

import orjson

from harnessrl.traces.schema import Choice, EndpointKind


class CaptureError(ValueError):
    """A response that lacks what training needs (token ids, logprobs) or is malformed."""


def parse_response(endpoint: EndpointKind, body: Any) -> tuple[tuple[int, ...], tuple[Choice, ...]]:
    """The server's prompt ids and choices of one (assembled) response body."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise CaptureError("response has no 'choices' list")
    prompt = body.get("prompt_token_ids")
    choices = []
    for raw in body["choices"]:
        if not isinstance(raw, dict):
            raise CaptureError(f"choice is not an object: {type(raw).__name__}")
        if endpoint is EndpointKind.CHAT:
            choice = _chat_choice(raw)
        else:
            choice = _completion_choice(raw)
            own = raw.get("prompt_token_ids")
            if prompt is None:
                prompt = own
            elif own is not None and own != prompt:
                raise CaptureError("choices carry different prompts (batched prompts)")
        choices.append(choice)
    if prompt is None:
        raise CaptureError(
            "response has no prompt_token_ids; the upstream must honor return_token_ids (vLLM)"
        )
    return _ints(prompt, "prompt_token_ids"), tuple(choices)


def _chat_choice(raw: dict[str, Any]) -> Choice:
    logprobs = raw.get("logprobs") or {}
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    values = [] if content is None else [_entry_logprob(e) for e in content]
    message = raw.get("message") or {}
    text = message.get("content") if isinstance(message, dict) else None
    return _choice(raw, values, text if isinstance(text, str) else "")


def _completion_choice(raw: dict[str, Any]) -> Choice:
    logprobs = raw.get("logprobs") or {}
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    text = raw.get("text")
    return _choice(raw, values or [], text if isinstance(text, str) else "")


def _choice(raw: dict[str, Any], logprobs: list[Any], text: str) -> Choice:
    index = raw.get("index", 0)
    token_ids = raw.get("token_ids")
    if token_ids is None:
        raise CaptureError(f"choice {index} has no token_ids; request return_token_ids")
    ids = _ints(token_ids, f"choices[{index}].token_ids")
    if len(logprobs) != len(ids):
        raise CaptureError(
            f"choice {index} has {len(ids)} token ids but {len(logprobs)} logprobs; "
            "request logprobs of the sampled tokens"
        )
    if not all(isinstance(x, float | int) and not isinstance(x, bool) for x in logprobs):
        raise CaptureError(f"choice {index} has a non-numeric logprob")
    lps = tuple(float(x) for x in logprobs)
    finish = raw.get("finish_reason")
    return Choice(
        index=int(index) if isinstance(index, int) else 0,
        token_ids=ids,
        logprobs=lps,
        finish_reason=finish if isinstance(finish, str) else None,
        text=text,
    )


def _entry_logprob(entry: Any) -> Any:
    if not isinstance(entry, dict):
        raise CaptureError(f"logprobs.content entry is not an object: {entry!r}")
    return entry.get("logprob")


def _ints(values: Any, name: str) -> tuple[int, ...]:
    # Checked by their few distinct types: prompts run to 100k ids, on every call.
    kinds = set(map(type, values)) if isinstance(values, list) else {type(values)}
    if bool in kinds or not isinstance(values, list) or not all(issubclass(k, int) for k in kinds):
        raise CaptureError(f"{name} must be a list of integers")
    return tuple(values)


class StreamAssembler:
    """Folds the data payloads of an SSE stream into the equivalent non-streaming body."""

    def __init__(self, endpoint: EndpointKind) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None
        self.prompt_token_ids: Any = None
        self.error: Any = None
        self.done = False

    def feed(self, data: bytes) -> None:
        """One event's `data:` payload (without the prefix)."""
        if data.strip() == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as err:
            raise CaptureError("stream event is not JSON") from err
        if not isinstance(event, dict):
            raise CaptureError("stream event is not an object")
        if "error" in event:
            self.error = event["error"]
            return
        if not self.head:
            self.head = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("prompt_token_ids") is not None:
            self.prompt_token_ids = event["prompt_token_ids"]
        if event.get("usage") is not None:
            self.usage = event["usage"]
        for delta in event.get("choices") or ():
            if not isinstance(delta, dict):
                raise CaptureError("stream choice is not an object")
            self._fold(delta)

    def _fold(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", 0)
        if not isinstance(index, int):
            raise CaptureError(f"stream choice index is not an integer: {index!r}")
        # token_ids stays None unless the server sent some, so a server that ignores
        # return_token_ids is reported as such instead of as a length mismatch.
        acc = self.choices.setdefault(index, {"index": index, "token_ids": None, "lp": []})
        if delta.get("token_ids") is not None:
            if acc["token_ids"] is None:
                acc["token_ids"] = []
            acc["token_ids"].extend(delta["token_ids"])
        if delta.get("finish_reason") is not None:
            acc["finish_reason"] = delta["finish_reason"]
        if delta.get("stop_reason") is not None:
            acc["stop_reason"] = delta["stop_reason"]
        logprobs = delta.get("logprobs")
        if self.endpoint is EndpointKind.CHAT:
            _fold_chat(acc, delta.get("delta") or {}, logprobs)
        else:
            _fold_completion(acc, delta, logprobs)

    def body(self) -> dict[str, Any]:
        """The assembled body, shaped like the non-streaming response of the same request."""
        out: dict[str, Any] = dict(self.head)
        out["object"] = (
            "chat.completion" if self.endpoint is EndpointKind.CHAT else "text_completion"
        )
        out["choices"] = [_finish(self.endpoint, acc) for _, acc in sorted(self.choices.items())]
        if self.usage is not None:
            out["usage"] = self.usage
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


def _fold_chat(acc: dict[str, Any], delta: dict[str, Any], logprobs: Any) -> None:
    message = acc.setdefault("message", {"role": "assistant", "content": None})
    if delta.get("role"):
        message["role"] = delta["role"]
    if delta.get("content") is not None:
        message["content"] = (message["content"] or "") + str(delta["content"])
    for call in delta.get("tool_calls") or ():
        calls = message.setdefault("tool_calls", [])
        pos = call.get("index", len(calls))
        while len(calls) <= pos:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        slot = calls[pos]
        for key in ("id", "type"):
            if call.get(key):
                slot[key] = call[key]
        fn = call.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        slot["function"]["arguments"] += fn.get("arguments") or ""
    if isinstance(logprobs, dict):
        acc["lp"].extend(logprobs.get("content") or ())


def _fold_completion(acc: dict[str, Any], delta: dict[str, Any], logprobs: Any) -> None:
    acc["text"] = acc.get("text", "") + str(delta.get("text") or "")
    if delta.get("prompt_token_ids") is not None:
        acc["prompt_token_ids"] = delta["prompt_token_ids"]
    if isinstance(logprobs, dict):
        acc["lp"].extend(logprobs.get("token_logprobs") or ())
        acc.setdefault("tokens", []).extend(logprobs.get("tokens") or ())


def _finish(endpoint: EndpointKind, acc: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in acc.items() if k not in ("lp", "tokens")}
    out.setdefault("finish_reason", None)
    if endpoint is EndpointKind.CHAT:
        out.setdefault("message", {"role": "assistant", "content": None})
        out["logprobs"] = {"content": acc["lp"]}
    else:
        out["logprobs"] = {"tokens": acc.get("tokens", []), "token_logprobs": acc["lp"]}
    return out
