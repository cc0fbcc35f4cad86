"""Request parsing and vLLM-shaped errors (compared with exchanges recorded from real vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import IM_START, VOCAB, ByteTokenizer

from harnessrl.serve.config import ServeConfig
from harnessrl.serve.protocol import RequestError, RequestLimits, parse_job, text_chars

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_exchanges.jsonl"


def _recorded(kind: str) -> dict:
    for line in FIXTURES.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == kind:
            return record
    raise KeyError(kind)


def _job(body, *, chat=True, max_model_len=2048, limits=None):
    return parse_job(
        body,
        chat=chat,
        tokenizer=ByteTokenizer(),
        served="smol",
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        limits=limits,
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


class _DroppingTokenizer(ByteTokenizer):
    """Encodes some text to nothing, as SmolLM2's tokenizer does with control characters."""

    def encode(self, text):
        return []


def test_a_prompt_that_tokenizes_to_nothing_is_a_400():
    with pytest.raises(RequestError, match="tokenizes to no tokens") as info:
        parse_job(
            {"prompt": "\x16"},
            chat=False,
            tokenizer=_DroppingTokenizer(),
            served="smol",
            max_model_len=64,
            vocab_size=VOCAB,
        )
    assert info.value.status == 400 and info.value.param == "prompt"


class _CountingTokenizer(ByteTokenizer):
    calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        self.calls += 1
        return super().apply_chat_template(messages, tools, add_generation_prompt)


@pytest.mark.parametrize(
    ("body", "chat", "param", "needle"),
    [
        ({"prompt": "x", "n": 5}, False, "n", "n must be <= 4"),
        ({"prompt": "x", "n": 3, "max_tokens": 40}, False, "max_tokens", "ask for 120 tokens"),
        ({"prompt": "x" * 101}, False, "prompt", "more than 100 characters"),
        ({"prompt": ["x" * 101]}, False, "prompt", "more than 100 characters"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 101}]}]},
            True,
            "messages",
            "more than 100 characters",
        ),
        (
            {
                "messages": [{"role": "user", "content": "z"}],
                "tools": [{"type": "function", "function": {"name": "f", "description": "t" * 99}}],
            },
            True,
            "messages",
            "more than 100 characters",
        ),
    ],
)
def test_limits_are_checked_before_the_prompt_is_tokenized(body, chat, param, needle):
    tokenizer = _CountingTokenizer()
    limits = RequestLimits(max_n=4, max_request_tokens=100, max_prompt_chars=100)
    with pytest.raises(RequestError, match=needle) as info:
        parse_job(
            body,
            chat=chat,
            tokenizer=tokenizer,
            served="smol",
            max_model_len=64,
            vocab_size=VOCAB,
            limits=limits,
        )
    assert info.value.status == 400 and info.value.param == param
    assert tokenizer.calls == 0


def test_unset_max_tokens_counts_the_room_left_against_the_budget():
    limits = RequestLimits(max_n=8, max_request_tokens=100, max_prompt_chars=1000)
    chat = {"messages": [{"role": "user", "content": "hello"}]}  # 24 prompt ids: 40 left
    with pytest.raises(RequestError, match=r"n=3 choices of 40 tokens each ask for 120"):
        _job({**chat, "n": 3}, max_model_len=64, limits=limits)
    assert _job({**chat, "n": 2}, max_model_len=64, limits=limits).max_tokens == 40


def test_limits_from_a_config_never_exceed_what_the_queue_can_hold():
    config = ServeConfig(num_slots=2, max_waiting=3, max_n=64, max_prompt_chars=10)
    assert RequestLimits.of(config) == RequestLimits(
        max_n=5, max_request_tokens=65536, max_prompt_chars=10
    )


def test_text_chars_walks_any_depth_and_stops_past_the_limit():
    deep: list = ["ab"]
    for _ in range(100_000):  # far deeper than Python's recursion limit
        deep = [deep, {"k": "c"}]
    assert text_chars(deep, 10**9) == 2 + 100_000 * 2
    assert text_chars({"a": ["x" * 50] * 1000}, 100) <= 151  # stopped early
