"""Test doubles for the serving tests: byte-level chat tokenizers with ChatML-style markers."""

from __future__ import annotations

import json
import time
from typing import Any

IM_START, IM_END = 256, 257
VOCAB = 258
ADMIN_TOKEN = "admin-test-token"  # the bounded server's (conftest)


def bounded_model_config() -> Any:
    """The tiny random model behind conftest's `bounded_server` (bytes, 1024 positions)."""
    from harnessrl.model.config import ModelConfig

    return ModelConfig.tiny(vocab_size=VOCAB, eos_token_id=IM_END, max_position_embeddings=1024)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256/257 are <|im_start|>/<|im_end|> (EOS).

    Multi-byte characters span several ids, which exercises incremental detokenization.
    """

    eos_token_ids = (IM_END,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        chunks, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            chunks.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                chunks.append("<|im_start|>" if t == IM_START else "<|im_end|>")
        chunks.append(buf.decode("utf-8", errors="replace"))
        return "".join(chunks)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        ids: list[int] = []
        if tools:
            messages = [{"role": "system", "content": "tools: " + json.dumps(tools)}, *messages]
        for m in messages:
            ids += [IM_START, *f"{m['role']}\n{m.get('content') or ''}".encode(), IM_END, 10]
        if add_generation_prompt:
            ids += [IM_START, *b"assistant\n"]
        return ids


class CostlyByteTokenizer(ByteTokenizer):
    """ByteTokenizer that costs what a BPE tokenizer costs: about 1 µs per character.

    Like the Rust `tokenizers` encoder it does not hold the GIL while it works, so a server that
    tokenizes on a worker thread keeps answering while it does. `longest` records the longest
    text it was asked to encode, so tests can tell whether a cap was applied before it.
    """

    seconds_per_char = 1e-6

    def __init__(self) -> None:
        self.longest = 0

    def encode(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        time.sleep(len(text) * self.seconds_per_char)
        return super().encode(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        chars = sum(len(m.get("content") or "") for m in messages)
        self.longest = max(self.longest, chars)
        time.sleep(chars * self.seconds_per_char)
        return super().apply_chat_template(messages, tools, add_generation_prompt)
