"""ChatTokenizer: ids identical to transformers' for plain text and multi-turn chats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from harnessrl.model.formats.load import Checkpoint, gguf_tokenizer, smollm2_gguf_path
from harnessrl.model.tokenizer import ChatTokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 12 + 30? Answer with just the number."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Héllo, naïve café — 日本語で答えて 🚀"},
        {"role": "assistant", "content": "こんにちは!\n\n  Indented line\ttab"},
        {"role": "user", "content": "Now call the tool."},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        },
        {"role": "tool", "content": '{"result": 1, "note": "ünïcödé ✓"}'},
        {"role": "user", "content": "Thanks <|im_end|> is literal text here"},
    ],
    [
        {"role": "user", "content": "  leading spaces and trailing  "},
        {"role": "assistant", "content": "1234567890 3.14159 -42 1e10"},
        {"role": "tool", "content": "line1\r\nline2\n\n\nline3"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TEXTS = [
    "",
    "What is 12345 + 678?  x\n\n y",
    "emoji 🤖🚀 and CJK 中文 and RTL עברית",
    "a\u00a0b\u200bc",
]


@pytest.fixture(scope="session")
def reference_tokenizer() -> Any:
    path = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def ours(smollm2_checkpoint: Checkpoint) -> ChatTokenizer:
    assert smollm2_checkpoint.tokenizer is not None
    return smollm2_checkpoint.tokenizer


def _reference_chat(tok: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def test_gguf_tokenizer_matches_transformers(ours: ChatTokenizer, reference_tokenizer: Any) -> None:
    for text in TEXTS:
        assert ours.encode(text) == reference_tokenizer(text).input_ids, text
        assert ours.decode(ours.encode(text)) == text
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = _reference_chat(
                reference_tokenizer, messages, tools=TOOLS, add_generation_prompt=gen
            )
            assert (
                ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=gen) == want
            )
    assert ours.eos_token_ids == (reference_tokenizer.eos_token_id,)
    # Special tokens stay whole; written as text inside content they still map to the special id.
    assert ours.encode("<|im_start|>user") == [1, 4093]


def test_gguf_tokenizer_reads_the_files_tokenizer_once_per_process(ours: ChatTokenizer) -> None:
    path = smollm2_gguf_path()
    shared = gguf_tokenizer(path)
    assert gguf_tokenizer(path) is shared
    for messages in CONVERSATIONS:
        assert shared.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert shared.eos_token_ids == ours.eos_token_ids


def test_saved_tokenizer_loads_in_transformers_and_in_ours(
    ours: ChatTokenizer, tmp_path: Path
) -> None:
    ours.save(tmp_path)
    reloaded = ChatTokenizer.from_hf_folder(tmp_path)
    via_transformers = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in CONVERSATIONS:
        want = ours.apply_chat_template(messages)
        assert reloaded.apply_chat_template(messages) == want
        assert _reference_chat(via_transformers, messages, add_generation_prompt=True) == want
    assert reloaded.eos_token_ids == ours.eos_token_ids
    assert via_transformers.eos_token == "<|im_end|>"


def test_tokenizer_errors_name_the_problem(ours: ChatTokenizer, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="encode"):
        ours.encode(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="messages"):
        ours.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tokenizer"):
        ChatTokenizer.from_hf_folder(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        ChatTokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    bare = ChatTokenizer(ours.tokenizer, None, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
