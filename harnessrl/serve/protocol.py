"""Serving stage, requests: OpenAI/vLLM JSON bodies → `GenerationJob`; errors in vLLM's shape.

Chat bodies are rendered with the model's chat template (with `tools`); completion prompts may be
text or token ids. Length limits are checked here so the engine only sees requests that fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from harnessrl.engine.sampler import SamplingParams
from harnessrl.http.listener import error_body
from harnessrl.model.tool_calls import validate_tools
from harnessrl.serve.config import ServeConfig
from harnessrl.serve.sampling import parse_sampling


class Tokenizer(Protocol):
    """The part of `harnessrl.model.tokenizer.ChatTokenizer` the server uses."""

    eos_token_ids: Any

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = ..., add_generation_prompt: bool = ...
    ) -> list[int]: ...


class RequestError(Exception):
    """A client error, rendered as vLLM's `{"error": {...}}` body with this status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}
        self.kind = kind

    def body(self) -> dict[str, Any]:
        # vLLM's own names where it has them; otherwise the status phrase, as vLLM's handler of
        # Starlette's HTTPException (404/405 routes, 413, 431...) writes it.
        kind = {
            400: "BadRequestError",
            404: "NotFoundError",
            500: "InternalServerError",
            503: "ServiceUnavailableError",
        }
        name = self.kind or kind.get(self.status) or HTTPStatus(self.status).phrase
        return error_body(self.status, self.message, name, self.param)


@dataclass(frozen=True)
class RequestLimits:
    """What one generation request may ask for; checked before tokenizing or queueing."""

    max_n: int = ServeConfig.max_n
    max_request_tokens: int = ServeConfig.max_request_tokens
    max_prompt_chars: int = ServeConfig.max_prompt_chars

    @classmethod
    def of(cls, config: ServeConfig) -> RequestLimits:
        # More choices than slots plus queue could never be admitted: a 400, not a 503 forever.
        return cls(
            max_n=min(config.max_n, config.num_slots + config.max_waiting),
            max_request_tokens=config.max_request_tokens,
            max_prompt_chars=config.max_prompt_chars,
        )


@dataclass(frozen=True)
class GenerationJob:
    """One validated request, ready for the engine and the response builder."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tools: list[dict[str, Any]] | None
    echo_text: str | None  # completions `echo`: the prompt text to prepend


def check_model(body: dict[str, Any], served: str) -> None:
    name = body.get("model")
    if name is not None and name != served:
        raise RequestError(
            f"The model `{name}` does not exist. Valid aliases: {served}.",
            status=404,
            param="model",
        )


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a string role", param="messages"
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text reaches a text-only model
            texts: list[Any] = [p.get("text") for p in content if isinstance(p, dict)]
            if any(p.get("type") != "text" for p in content if isinstance(p, dict)) or not all(
                isinstance(t, str) for t in texts
            ):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported", param="messages"
                )
            message = {**message, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of text parts", param="messages"
            )
        out.append(message)
    return out


def text_chars(value: Any, limit: int) -> int:
    """Characters in every string of a decoded JSON value (keys too); stops once past `limit`.

    Iterative, so a value nested as deep as the JSON parser allows cannot exhaust the stack.
    """
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _check_chars(value: Any, limits: RequestLimits, param: str) -> None:
    chars = text_chars(value, limits.max_prompt_chars)
    if chars > limits.max_prompt_chars:
        raise RequestError(
            f"the {param} hold more than {limits.max_prompt_chars} characters, this server's "
            f"limit before tokenizing; send a shorter {param}",
            param=param,
        )


def _prompt_ids(
    value: Any, tokenizer: Tokenizer, vocab_size: int, max_model_len: int
) -> tuple[list[int], str | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise RequestError("prompt must not be empty", param="prompt")
        ids = list(tokenizer.encode(value))
        if not ids:  # e.g. control characters the vocabulary drops: nothing to prefill
            raise RequestError(
                f"prompt {value[:40]!r} tokenizes to no tokens; the decoder prompt cannot be empty",
                param="prompt",
            )
        return ids, value
    if isinstance(value, list) and len(value) >= max_model_len:
        _check_length(len(value), SamplingParams(), max_model_len)  # before reading every id
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt"
            )
        return list(value), None
    raise RequestError(
        "prompt must be a string, a list of token ids, or a one-element list of either "
        "(batched prompts are not supported)",
        param="prompt",
    )


def _check_choices(n: int, max_tokens: int | None, limits: RequestLimits, room: int) -> None:
    """`n` and n × max_tokens against the limits; `room` is what an unset max_tokens fills."""
    if n > limits.max_n:
        raise RequestError(f"n must be <= {limits.max_n} on this server, got {n}", param="n")
    per_choice = room if max_tokens is None else max_tokens
    if n * per_choice > limits.max_request_tokens:
        what = f"max_tokens={max_tokens}" if max_tokens is not None else f"{room} tokens each"
        raise RequestError(
            f"n={n} choices of {what} ask for {n * per_choice} tokens, over this server's limit "
            f"of {limits.max_request_tokens} per request; lower n or max_tokens",
            param="max_tokens" if max_tokens is not None else "n",
        )


def _check_length(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The request's max_tokens after the limits; RequestError in vLLM's words if it cannot fit."""
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {prompt_len} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_len})",
            param="input_tokens",
        )
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise RequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This "
            f"model's maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({params.max_tokens} > {max_model_len} - {prompt_len}). "
            f"(parameter=max_tokens, value={params.max_tokens})",
            param="max_tokens",
        )
    return params.max_tokens


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream, ids = body.get("stream", False), body.get("return_token_ids", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(ids, bool) or not isinstance(options, dict):
        raise RequestError("stream and return_token_ids must be booleans, stream_options an object")
    return stream, bool(options.get("include_usage", False)), ids


def tokenize_body(body: Any, tokenizer: Tokenizer, limits: RequestLimits) -> list[int]:
    """`/tokenize`: `{"prompt": str}` or `{"messages": [...]}` (+ `tools`) → token ids."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "messages" in body:
        try:
            tools = validate_tools(body.get("tools"), body.get("tool_choice"))
        except ValueError as err:
            raise RequestError(str(err), param="tools") from err
        return chat_prompt(body, tokenizer, tools, limits)
    if not isinstance(body.get("prompt"), str):
        raise RequestError("give `prompt` (a string) or `messages` (a list)", param="prompt")
    _check_chars(body["prompt"], limits, "prompt")
    return list(tokenizer.encode(body["prompt"]))


def chat_prompt(
    body: dict[str, Any], tokenizer: Tokenizer, tools: Any, limits: RequestLimits
) -> list[int]:
    """The chat body's messages rendered by the model's template (checked, then tokenized)."""
    messages = _messages(body.get("messages"))
    _check_chars([messages, tools], limits, "messages")
    add_prompt = bool(body.get("add_generation_prompt", True))
    try:
        return list(
            tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_prompt)
        )
    except Exception as err:  # the template is code run on client data: its failure is a 400
        raise RequestError(
            f"the chat template cannot render these messages: {err}", param="messages"
        ) from err


def parse_job(
    body: Any,
    *,
    chat: bool,
    tokenizer: Tokenizer,
    served: str,
    max_model_len: int,
    vocab_size: int,
    limits: RequestLimits | None = None,
) -> GenerationJob:
    """A decoded JSON body → `GenerationJob`, or RequestError (400/404) saying what to fix.

    Everything cheap (fields, `n`, n × max_tokens, prompt characters) is checked before the
    prompt is tokenized, and nothing here allocates per choice.
    """
    limits = limits or RequestLimits()
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_model(body, served)
    try:
        params = parse_sampling(body, chat=chat)
        tools = validate_tools(body.get("tools"), body.get("tool_choice")) if chat else None
    except ValueError as err:
        raise RequestError(str(err)) from err
    _check_choices(params.n, params.max_tokens, limits, room=1)
    stream, include_usage, return_ids = _stream_flags(body)
    echo_text = None
    if chat:
        prompt_ids = chat_prompt(body, tokenizer, tools, limits)
    else:
        _check_chars(body.get("prompt"), limits, "prompt")
        prompt_ids, text = _prompt_ids(body.get("prompt"), tokenizer, vocab_size, max_model_len)
        if body.get("echo"):
            echo_text = text if text is not None else tokenizer.decode(prompt_ids)
    max_tokens = _check_length(len(prompt_ids), params, max_model_len)
    _check_choices(params.n, params.max_tokens, limits, room=max_tokens)
    return GenerationJob(
        chat=chat,
        prompt_ids=prompt_ids,
        params=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=return_ids,
        tools=tools,
        echo_text=echo_text,
    )
