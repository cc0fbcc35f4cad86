"""Token-in calls without a token limit sample up to the rest of the upstream's context, as a chat
server would, not the 16 tokens that `/v1/completions` defaults to."""

from __future__ import annotations

from typing import Any

import httpx
from fake_vllm import LIMITS


def test_a_call_without_a_limit_gets_the_rest_of_the_context(fake: Any, make_sidecar: Any) -> None:
    upstream, server = fake
    sidecar = make_sidecar((server.url,), tokenizer="tiny")
    url = sidecar.base("r") + "/responses"
    for body in ({"model": "smol", "input": "hi"}, {"model": "smol", "input": "hi again"}):
        assert httpx.post(url, json=body, timeout=30).status_code == 200
    limited = {"model": "smol", "input": "hi", "max_output_tokens": 7}
    assert httpx.post(url, json=limited, timeout=30).status_code == 200
    sent = [r for r in upstream.requests if "prompt" in r]
    assert [r["max_tokens"] for r in sent] == [
        LIMITS.max_model_len - len(sent[0]["prompt"]),
        LIMITS.max_model_len - len(sent[1]["prompt"]),
        7,  # the harness's own limit is kept
    ]
