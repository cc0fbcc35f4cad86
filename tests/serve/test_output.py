"""Choice assembly: incremental detokenization, stop strings, hold-back, tool calls, logprob forms."""

from __future__ import annotations

from fakes import IM_END, VOCAB, ByteTokenizer

from harnessrl.engine.decode import TokenEvent
from harnessrl.serve.output import ChoiceState, TokenText, chat_body, completion_body
from harnessrl.serve.protocol import parse_job

ADD = {"type": "function", "function": {"name": "add", "parameters": {}}}


def _choice(body: dict, *, chat: bool = True) -> ChoiceState:
    if chat:
        body = {"messages": [{"role": "user", "content": "q"}], **body}
    else:
        body = {"prompt": "q", **body}
    job = parse_job(
        body, chat=chat, tokenizer=ByteTokenizer(), served="m", max_model_len=512, vocab_size=VOCAB
    )
    return ChoiceState(0, job, ByteTokenizer())


def _feed(choice: ChoiceState, ids: list[int], last_reason: str | None = None) -> list[str]:
    streamed = []
    for i, t in enumerate(ids):
        reason = last_reason if i == len(ids) - 1 else None
        choice.add(TokenEvent(0, t, -0.5, ((t, -0.5), (1, -2.0)), reason, None, 3))
        streamed.append(choice.stream_text())
    return streamed


def test_multibyte_characters_stream_whole():
    choice = _choice({})
    streamed = _feed(choice, list("aé€".encode()), last_reason="length")
    assert "".join(streamed) == choice.text == "aé€"
    assert "\ufffd" not in "".join(streamed)
    assert streamed[1] == ""  # first byte of "é" alone is held back


def test_stop_string_cuts_text_keeps_token_ids_and_is_held_back():
    choice = _choice({"stop": ["END"]})
    streamed = _feed(choice, list(b"ok EN") + list(b"D more"))
    assert choice.finish_reason == "stop" and choice.stop_reason == "END"
    assert choice.text == "ok "
    assert "".join(streamed) == "ok "
    assert "E" not in "".join(streamed)
    assert choice.token_ids == list(b"ok END")  # tokens after the stop are not accepted


def test_include_stop_str_in_output():
    choice = _choice({"stop": "D", "include_stop_str_in_output": True})
    _feed(choice, list(b"abDc"))
    assert choice.text == "abD"


def test_eos_is_kept_as_token_but_not_text():
    choice = _choice({})
    _feed(choice, [*b"hi", IM_END], last_reason="stop")
    assert choice.text == "hi" and choice.token_ids[-1] == IM_END
    assert choice.public_finish_reason() == "stop"


def test_tool_call_text_is_not_streamed_and_becomes_tool_calls():
    choice = _choice({"tools": [ADD]})
    text = 'Ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    streamed = _feed(choice, [*text.encode(), IM_END], last_reason="stop")
    assert "".join(streamed) == "Ok "
    content, calls = choice.tool_calls()
    assert content == "Ok " and calls[0]["function"]["name"] == "add"
    assert choice.public_finish_reason() == "tool_calls"
    body = chat_body(choice.job, [choice], TokenText(ByteTokenizer()), {"id": "x"})
    message = body["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_body_shape_with_token_ids_and_logprobs():
    choice = _choice({"logprobs": True, "top_logprobs": 1, "return_token_ids": True})
    _feed(choice, list(b"ab"), last_reason="length")
    body = chat_body(choice.job, [choice], TokenText(ByteTokenizer()), {"id": "x"})
    assert body["prompt_token_ids"] == choice.job.prompt_ids
    (out,) = body["choices"]
    assert out["token_ids"] == [97, 98] and out["finish_reason"] == "length"
    first = out["logprobs"]["content"][0]
    assert first == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
    }
    assert body["usage"] == {
        "prompt_tokens": len(choice.job.prompt_ids),
        "total_tokens": len(choice.job.prompt_ids) + 2,
        "completion_tokens": 2,
    }


def test_completion_body_legacy_logprobs_and_echo():
    choice = _choice({"logprobs": 2, "echo": True, "return_token_ids": True}, chat=False)
    _feed(choice, list(b"xy"), last_reason="length")
    body = completion_body(choice.job, [choice], TokenText(ByteTokenizer()), {"id": "x"})
    (out,) = body["choices"]
    assert out["text"] == "qxy" and out["prompt_token_ids"] == [ord("q")]
    assert out["logprobs"] == {
        "text_offset": [1, 2],
        "token_logprobs": [-0.5, -0.5],
        "tokens": ["x", "y"],
        "top_logprobs": [{"x": -0.5, "\x01": -2.0}, {"y": -0.5, "\x01": -2.0}],
    }
