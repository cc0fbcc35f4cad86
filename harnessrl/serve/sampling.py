"""Serving stage, sampling fields: an OpenAI/vLLM request body → the engine's `SamplingParams`.

Each field is checked for type and range here, so the engine only sees settings it can run;
errors are ValueErrors naming the field, which the HTTP edge answers as vLLM's 400.
"""

from __future__ import annotations

import math
from typing import Any

from harnessrl.engine.sampler import INT32_MAX, MAX_TOP_LOGPROBS, SamplingParams

# Stop strings are matched (and held back while streaming) on every token of every choice, so
# their number and length bound per-token host work; stop ids are looked up per token too.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 256, 256


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r:.200}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(
    body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r:.200}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r:.200}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r:.200}")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise ValueError(
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            f"characters, got {len(value)} (longest {max(map(len, value))})"
        )
    return tuple(value)


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"{name} must be a list of non-negative integers, got {value!r:.200}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name} takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    return tuple(value)


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1),
    ):
        value = body.get(name)
        if value is not None and value != neutral:
            raise ValueError(
                f"{name}={value!r:.50} is not supported by this server; omit it or use {neutral}"
            )
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ValueError(f"best_of={body['best_of']!r:.50} is not supported; omit it")


def parse_sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """OpenAI/vLLM request body → `SamplingParams`; raises ValueError naming the bad field."""
    _reject_unsupported(body)
    max_tokens = _integer(body, "max_tokens", None if chat else 16, 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", None, 1)
    top_k = _integer(body, "top_k", 0, -1, INT32_MAX)  # -1 and 0: off; above the vocab: all
    if chat:
        want = _flag(body, "logprobs", False)
        top = _integer(body, "top_logprobs", 0, 0)
        if top and not want:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = top if want else None
    else:
        logprobs = _integer(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be <= {MAX_TOP_LOGPROBS}, got {logprobs}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer, got {seed!r:.200}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(top_k or 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        n=_integer(body, "n", 1, 1) or 1,
        seed=seed,
        stop=_stop_strings(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=_flag(body, "ignore_eos", False),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
        logprobs=logprobs,
    )
