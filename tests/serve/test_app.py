"""The server through the official `openai` SDK and raw HTTP: chat, completions, streaming,
tools, n=2, token-id dialect, errors, admin weight loading. A tiny random model with the real
SmolLM2 tokenizer; one scripted span of positions makes it emit a hermes tool call.
"""

from __future__ import annotations

import json

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.serve.app import start_server
from harnessrl.serve.config import ServeConfig

TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
FILLER = "Be brief. " * 100  # pushes the scripted prompt far beyond every other test's positions


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


def _tool_messages():
    return [
        {"role": "system", "content": FILLER},
        {"role": "user", "content": "Use the add tool to add 2 and 3."},
    ]


@pytest.fixture(scope="module")
def server(smol_tokenizer):
    tok = smol_tokenizer
    start = len(tok.apply_chat_template(_tool_messages(), tools=[ADD_TOOL]))
    assert start > 250
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, eos_token_id=2, max_position_embeddings=512)
    model = ScriptedDecoder(cfg, [*tok.encode(TOOL_TEXT, add_special_tokens=False), 2], start)
    other = nnx.state(Decoder(cfg, rngs=nnx.Rngs(1)), nnx.Param)

    def loader(path: str):  # stands in for reading an exported folder (covered in rollout tests)
        if path != "exported/other":
            raise ValueError(f"model spec {path!r} is not an HF model folder")
        return other

    config = ServeConfig(
        model="smol",
        port=0,
        num_slots=4,
        max_model_len=448,
        prefill_buckets=(32, 256),
        decode_buckets=(128, 448),
        # Repeated prompts here compare bitwise: a prompt resumed after a held prefix runs
        # another prefill program, equal only up to float32 rounding (tests/engine covers it).
        prefix_caching=False,
    )
    handle = start_server(model, tok, config, params_loader=loader)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is 11+5? Answer with just the number."}]
IDS = {"return_token_ids": True}


def test_chat_n2_with_token_ids_and_logprobs(client, server, smol_tokenizer):
    raw = client.chat.completions.with_raw_response.create(
        model="smol",
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        seed=5,
        logprobs=True,
        top_logprobs=2,
        extra_body=IDS,
    )
    assert raw.headers["x-harnessrl-policy-version"] == str(server.engine.version)
    reply = raw.parse()
    assert reply.prompt_token_ids == smol_tokenizer.apply_chat_template(MESSAGES)
    assert reply.prompt_token_ids[:3] == [1, 9690, 198]  # same ids as the recorded vLLM exchange
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        ids = choice.token_ids
        assert len(ids) == len(choice.logprobs.content) == 6 and choice.finish_reason == "length"
        assert choice.message.content == smol_tokenizer.decode(ids, skip_special_tokens=True)
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert reply.choices[0].token_ids != reply.choices[1].token_ids
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == len(
        reply.prompt_token_ids
    )


def test_stream_matches_non_stream_for_the_same_seed(client):
    body = dict(
        model="smol", messages=MESSAGES, max_tokens=8, seed=11, logprobs=True, extra_body=IDS
    )
    whole = client.chat.completions.create(**body)
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
    ids = [t for c in token_chunks for t in c.choices[0].token_ids]
    assert ids == whole.choices[0].token_ids
    lps = [e.logprob for c in token_chunks for e in c.choices[0].logprobs.content]
    # The same engine, seed and programs computed both: the logprobs are the same floats.
    assert lps == [e.logprob for e in whole.choices[0].logprobs.content]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completions_text_ids_and_legacy_logprobs(client):
    reply = client.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=5,
        logprobs=2,
        seed=1,
        extra_body=IDS,
    )
    (choice,) = reply.choices
    assert choice.prompt_token_ids == [504, 3575, 282, 4649, 314]  # as recorded from vLLM
    lp = choice.logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.text_offset)
        == len(choice.token_ids)
        == 5
    )
    assert lp.text_offset[0] == 0 and all(len(top) in (1, 2, 3) for top in lp.top_logprobs)
    by_ids = client.completions.create(
        model="smol", prompt=[1, 504, 2988, 314], max_tokens=3, seed=2, extra_body=IDS
    )
    assert by_ids.choices[0].prompt_token_ids == [1, 504, 2988, 314]
    stream = list(
        client.completions.create(
            model="smol", prompt="One, two,", max_tokens=4, stream=True, extra_body=IDS
        )
    )
    assert stream[0].choices[0].model_extra["prompt_token_ids"] == [2705, 28, 827, 28]
    assert all(c.choices[0].model_extra["prompt_token_ids"] is None for c in stream[1:])
    assert sum(len(c.choices[0].token_ids) for c in stream) == 4


def test_tool_calls_parsed_plain_and_streamed(client):
    body = dict(
        model="smol", messages=_tool_messages(), tools=[ADD_TOOL], max_tokens=40, extra_body=IDS
    )
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed[0].function.name == "add" and json.loads(streamed[0].function.arguments) == {
        "a": 2,
        "b": 3,
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stop_string_through_the_server(client):
    reply = client.chat.completions.create(
        model="smol", messages=_tool_messages(), max_tokens=40, stop=["add"], extra_body=IDS
    )
    choice = reply.choices[0]
    assert choice.message.content == '<tool_call>\n{"name": "'
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "add"


def test_errors_in_vllm_shape(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smol", prompt=[65] * 449, max_tokens=1)
    assert "maximum context length is 448 tokens" in info.value.message
    assert info.value.body["param"] == "input_tokens"
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smol", messages=MESSAGES, temperature=-1)
    bad = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert bad.headers["x-harnessrl-policy-version"] == str(server.engine.version)


def test_side_routes(server, smol_tokenizer):
    base = server.url
    assert httpx.get(base + "/health").status_code == 200
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 448
    tokens = httpx.post(base + "/tokenize", json={"prompt": "The capital of France is"}).json()
    assert tokens["tokens"] == [504, 3575, 282, 4649, 314] and tokens["count"] == 5
    chat = httpx.post(base + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == smol_tokenizer.apply_chat_template(MESSAGES)
    assert httpx.post(base + "/detokenize", json={"tokens": [504, 3575]}).json() == {
        "prompt": "The capital"
    }
    assert httpx.post(base + "/detokenize", json={"tokens": [-1]}).status_code == 400


def test_admin_load_weights_changes_version_and_output(client, server):
    start, compiles = server.engine.version, server.engine.compile_count
    before = client.completions.create(
        model="smol", prompt="Hi", max_tokens=6, temperature=0, extra_body=IDS
    )
    auth = {"Authorization": f"Bearer {server.admin_token}"}  # made by the server: none given

    def load(body: dict) -> httpx.Response:
        return httpx.post(server.url + "/admin/load_weights", json=body, headers=auth, timeout=60)

    bad = load({"path": "nowhere", "version": 9})
    assert bad.status_code == 400 and "nowhere" in bad.json()["error"]["message"]
    assert load({"path": "exported/other"}).status_code == 400
    ok = load({"path": "exported/other", "version": start + 1})
    assert ok.status_code == 200 and ok.json() == {"version": start + 1}
    raw = client.completions.with_raw_response.create(
        model="smol", prompt="Hi", max_tokens=6, temperature=0, extra_body=IDS
    )
    assert raw.headers["x-harnessrl-policy-version"] == str(start + 1)
    assert raw.parse().choices[0].token_ids != before.choices[0].token_ids
    assert server.engine.compile_count == compiles
