"""The embedded server for the token-in dialect tests: a tiny random model around SmolLM2's
tokenizer that emits one scripted hermes tool call when generation reaches a given position, so
the first turn of a conversation of known length calls a tool and later turns are free text."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.tokenizer import ChatTokenizer
from harnessrl.serve.app import ServerHandle, start_server
from harnessrl.serve.config import ServeConfig
from proxy_sidecar.dialects.tokens import Renderer, load_tokenizer

TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_SCHEMA},
    }
]


class ScriptedDecoder(Decoder):
    """A Decoder that emits `script` once generation reaches position `start` (test double)."""

    def __init__(self, cfg: ModelConfig, script: list[int], start: int) -> None:
        super().__init__(cfg, rngs=nnx.Rngs(0))
        self._script = np.asarray(script, np.int32)
        self._start = start

    def decode(self, tokens_bt, positions_bt, cache, *, slot=None, length=None, last=None):
        logits_btv, cache = super().decode(
            tokens_bt, positions_bt, cache, slot=slot, length=length, last=last
        )
        if last is not None:  # logits of the token at index `last` only
            positions_bt = positions_bt[:, last, None]
        index_bt = positions_bt + 1 - self._start  # logits at position p choose token p + 1
        active_bt = (index_bt >= 0) & (index_bt < len(self._script))
        want_bt = jnp.asarray(self._script)[jnp.clip(index_bt, 0, len(self._script) - 1)]
        vocab_v = jnp.arange(logits_btv.shape[-1])
        forced_btv = jnp.where(vocab_v == want_bt[..., None], 0.0, -1e4)
        return jnp.where(active_bt[..., None], forced_btv, logits_btv), cache


def tokenizer() -> ChatTokenizer:
    try:
        return load_tokenizer("tiny")
    except ValueError as err:
        pytest.skip(f"needs the shipped SmolLM2 model (its tokenizer): {err}")


def prompt_length(tok: ChatTokenizer, messages: list[dict[str, Any]]) -> int:
    """How long the sidecar's first-turn prompt for `messages` (with the add tool) is."""
    return len(Renderer(tok).render(messages, CHAT_TOOLS, [None] * len(messages)).ids)


def scripted_server(tok: ChatTokenizer, start: int) -> ServerHandle:
    """The server, calling `add(2, 3)` (then EOS) for a prompt of `start` tokens."""
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, eos_token_id=2, max_position_embeddings=1024)
    script = [*tok.encode(TOOL_TEXT, add_special_tokens=False), 2]
    config = ServeConfig(
        model="smol",
        port=0,
        num_slots=4,
        max_model_len=1024,
        prefill_buckets=(256,),
        decode_buckets=(1024,),
    )
    return start_server(ScriptedDecoder(cfg, script, start), tok, config)
