"""Hermes-style tool-call parsing and `tools` validation."""

from __future__ import annotations

import json

import pytest

from harnessrl.model.tool_calls import parse_tool_calls, validate_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_parses_calls_and_keeps_leading_content():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Sure.\n"
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


def test_several_calls_and_an_unclosed_last_one():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"x": "é"}}'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.tool_calls[1]["function"]["arguments"] == '{"x": "é"}'


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ],
)
def test_unparseable_text_stays_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_validate_tools():
    assert validate_tools([ADD], "auto") == [ADD]
    assert validate_tools([ADD], "none") is None
    assert validate_tools(None, None) is None
    with pytest.raises(ValueError, match="tools must be"):
        validate_tools([], None)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        validate_tools([{"type": "retrieval"}], None)
    with pytest.raises(ValueError, match="tool_choice"):
        validate_tools([ADD], "sometimes")
    with pytest.raises(ValueError, match="needs a `tools` list"):
        validate_tools(None, "required")
