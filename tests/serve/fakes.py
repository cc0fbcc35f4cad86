"""Test doubles for the serving tests: a byte-level chat tokenizer with ChatML-style markers."""

from __future__ import annotations

import json
from typing import Any

IM_START, IM_END = 256, 257
VOCAB = 258


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
