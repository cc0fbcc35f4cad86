"""Test doubles for the serving tests: byte-level chat tokenizers with ChatML-style markers."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

IM_START, IM_END = 256, 257
VOCAB = 258
ADMIN_TOKEN = "admin-test-token"  # the bounded server's (conftest)


def bounded_model_config() -> Any:
    """The tiny random model behind conftest's `bounded_server` (bytes, 1024 positions)."""
    from harnessrl.model.families.dense.config import ModelConfig

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


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer(long_chars: int = 100_000) -> tuple[Any, TimedRust]:
    """A real `ChatTokenizer`: HF `tokenizers` byte-level BPE (256 bytes, no merges) plus
    <|im_start|>/<|im_end|> (EOS) = 258 ids, as `bounded_model_config` has; and the timer of its
    Rust tokenizer's calls on texts of at least `long_chars` characters.

    Unlike the fakes above, its encoder is the Rust one the shipped models use (about 1 s per
    MiB of text).
    """
    from tokenizers import pre_tokenizers

    from harnessrl.model.tokenizer import ChatTokenizer

    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<|im_start|>", "<|im_end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],  # the two markers are control tokens
        "tokenizer.ggml.eos_token_id": IM_END,
        "tokenizer.chat_template": CHATML,
    }
    built = ChatTokenizer.from_gguf_metadata(meta)
    timer = TimedRust(built.tokenizer, long_chars)
    return ChatTokenizer(timer, built.chat_template, built.special_tokens), timer


class TimedRust:
    """Wraps a Rust `tokenizers.Tokenizer`: each encode call on a long text sets `started` as it
    begins and appends its (start, end) monotonic times to `windows` when it returns."""

    def __init__(self, inner: Any, long_chars: int) -> None:
        self.inner = inner
        self.long_chars = long_chars
        self.started = threading.Event()
        self.windows: list[tuple[float, float]] = []

    def reset(self) -> None:
        self.started.clear()
        self.windows.clear()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if name not in ("encode", "encode_batch"):
            return found

        def timed(texts: Any, *args: Any, **kwargs: Any) -> Any:
            chars = len(texts) if isinstance(texts, str) else sum(map(len, texts))
            if chars < self.long_chars:
                return found(texts, *args, **kwargs)
            start = time.monotonic()
            self.started.set()
            try:
                return found(texts, *args, **kwargs)
            finally:
                self.windows.append((start, time.monotonic()))

        return timed


class GatedLoader:
    """A params loader (`start_server(params_loader=...)`) that tests can stop inside a load:
    while `gate` is clear, loads wait there; `entered` is set as one arrives. `most_inside` is
    the most loads that were ever inside at once."""

    def __init__(self) -> None:
        from harnessrl.engine.swap import load_params

        self.load = load_params
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.inside = self.most_inside = 0
        self._lock = threading.Lock()

    def __call__(self, path: str) -> Any:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        try:
            self.gate.wait(timeout=30)
            return self.load(path)
        finally:
            with self._lock:
                self.inside -= 1
