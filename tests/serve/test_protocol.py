"""Request parsing and vLLM-shaped errors (compared with exchanges recorded from real vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import IM_START, VOCAB, ByteTokenizer

from harnessrl.serve.protocol import RequestError, parse_job

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_exchanges.jsonl"


def _recorded(kind: str) -> dict:
    for line in FIXTURES.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == kind:
            return record
    raise KeyError(kind)


def _job(body, *, chat=True, max_model_len=2048):
    return parse_job(
        body,
        chat=chat,
        tokenizer=ByteTokenizer(),
        served="smol",
        max_model_len=max_model_len,
        vocab_size=VOCAB,
    )


def test_too_long_prompt_matches_vllm_error_exactly():
    recorded = _recorded("error_too_long")
    expected = json.loads(recorded["response_raw"])
    with pytest.raises(RequestError) as info:
        _job({"model": "smol", "prompt": [65] * 2049}, chat=False)
    assert info.value.status == recorded["status"] == 400
    assert info.value.body() == expected


def test_unknown_model_matches_vllm_error():
    recorded = _recorded("error_bad_model")
    with pytest.raises(RequestError) as info:
        _job(recorded["request"])
    assert info.value.status == 404
    assert info.value.body() == json.loads(recorded["response_raw"])


def test_max_tokens_over_the_room_says_the_limits():
    with pytest.raises(
        RequestError, match=r"too large: 100.*maximum context length is 64 tokens.*\(100 > 64 - 5\)"
    ):
        _job({"prompt": "hello", "max_tokens": 100}, chat=False, max_model_len=64)


def test_chat_job_renders_template_and_fills_context_by_default():
    job = _job(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": True,
        }
    )
    assert job.prompt_ids[0] == IM_START and job.stream
    assert job.max_tokens == 2048 - len(job.prompt_ids)
    assert job.params.max_tokens is None


def test_completion_prompt_forms():
    assert _job({"prompt": "hé"}, chat=False).prompt_ids == list("hé".encode())
    assert _job({"prompt": [5, 6]}, chat=False).prompt_ids == [5, 6]
    assert _job({"prompt": [[5, 6]]}, chat=False).prompt_ids == [5, 6]
    echo = _job({"prompt": [104, 105], "echo": True}, chat=False)
    assert echo.echo_text == "hi"


@pytest.mark.parametrize(
    ("body", "chat", "needle"),
    [
        ([], True, "JSON object"),
        ({"messages": []}, True, "messages must be"),
        ({"messages": [{"content": "x"}]}, True, "string role"),
        ({"messages": [{"role": "user", "content": 3}]}, True, "content must be"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "only text"),
        ({"prompt": ""}, False, "must not be empty"),
        ({"prompt": [VOCAB]}, False, "token ids must be in"),
        ({"prompt": ["a", "b"]}, False, "batched prompts"),
        ({"prompt": "x", "temperature": -2}, False, "temperature"),
        ({"prompt": "x", "stream": "yes"}, False, "booleans"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "add"}, True, "tools must be"),
    ],
)
def test_bad_requests_are_400_naming_the_field(body, chat, needle):
    with pytest.raises(RequestError, match=needle) as info:
        _job(body, chat=chat)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "BadRequestError"


class _FailingTemplate(ByteTokenizer):
    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        raise ValueError("Conversation roles must alternate user/assistant")


def test_template_failure_is_a_400():
    with pytest.raises(
        RequestError, match="cannot render these messages: Conversation roles"
    ) as info:
        parse_job(
            {"messages": [{"role": "user", "content": "x"}]},
            chat=True,
            tokenizer=_FailingTemplate(),
            served="smol",
            max_model_len=64,
            vocab_size=VOCAB,
        )
    assert info.value.status == 400 and info.value.param == "messages"
