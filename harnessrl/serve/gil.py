"""Serving stage, tokenizing without the GIL: the Rust tokenizer's work on long texts called the
way that leaves other threads running.

In: the served tokenizer. Out: the same ids and text, computed with the GIL released where the
input is long (a ChatTokenizer), so tokenizing on a worker thread stalls nobody else.
"""

from __future__ import annotations

from typing import Any

from harnessrl.model.tokenizer import ChatTokenizer
from harnessrl.serve.protocol import Tokenizer

RELEASE_AT = 4096  # characters or ids: shorter Rust calls take microseconds, the GIL held


class _ReleasingGil:
    """A ChatTokenizer whose Rust calls on long inputs are the batch forms: HF `tokenizers` holds
    the GIL for a whole `encode` or `decode` (a MiB of text: 1-2 s in which no other Python
    thread of the process runs, the event loop and the engine's thread included) and releases
    it in `encode_batch` and `decode_batch`, which return the same ids and text. Short inputs
    (the per-token decodes on the event loop) keep the plain calls: no GIL hand-over each."""

    def __init__(self, inner: ChatTokenizer) -> None:
        self.inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self._prefix = inner.encode("")  # the BOS token it adds, if any

    def _ids(self, text: str) -> list[int]:
        rust = self.inner.tokenizer
        if len(text) < RELEASE_AT:
            return list(rust.encode(text, add_special_tokens=False).ids)
        return list(rust.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode(text=...) needs a str, got {type(text).__name__}")
        return [*self._prefix, *self._ids(text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(ids) < RELEASE_AT:
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        rust = self.inner.tokenizer
        return str(rust.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes its special tokens itself, as ChatTokenizer.apply_chat_template.
        text = self.inner.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        return self._ids(text)


def releasing_gil(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer`, its Rust work made to release the GIL where it is a ChatTokenizer."""
    return _ReleasingGil(tokenizer) if isinstance(tokenizer, ChatTokenizer) else tokenizer
