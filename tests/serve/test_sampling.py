"""Sampling fields of a request body: vLLM's defaults, and a ValueError naming each bad field."""

from __future__ import annotations

import pytest

from harnessrl.engine.sampler import SamplingParams
from harnessrl.serve.sampling import parse_sampling


def test_parse_sampling_defaults_follow_vllm():
    chat = parse_sampling({}, chat=True)
    completion = parse_sampling({}, chat=False)
    assert chat.max_tokens is None and completion.max_tokens == 16
    assert chat.temperature == 1.0 and chat.n == 1 and chat.logprobs is None
    assert parse_sampling({"logprobs": True, "top_logprobs": 3}, chat=True).logprobs == 3
    assert parse_sampling({"logprobs": 2}, chat=False).logprobs == 2
    assert parse_sampling({"stop": "x", "top_k": -1}, chat=False) == SamplingParams(
        max_tokens=16, stop=("x",), top_k=0
    )
    assert parse_sampling({"max_completion_tokens": 5}, chat=True).max_tokens == 5


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "a"}, "seed"),
        ({"top_logprobs": 2}, "needs logprobs=true"),
        ({"logprobs": True, "top_logprobs": 99}, "<= 20"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_parse_sampling_rejects_bad_fields(body, needle):
    with pytest.raises(ValueError, match=needle):
        parse_sampling(body, chat=True)
