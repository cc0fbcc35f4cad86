"""The train loop's own sidecar serves token-in mode with the served model's tokenizer: a Responses
call through the openai SDK reaches the embedded tiny server as a token-id completion."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from openai import OpenAI

from harnessrl.fleet import copy_model, served_tokenizer
from harnessrl.model.formats.load import load_policy
from harnessrl.serve.app import start_server
from harnessrl.stack import start_capture
from harnessrl.traces import open_store
from harnessrl.train import parse_args


def test_served_tokenizer_names_local_sources_only(tmp_path: Path) -> None:
    for spec in ("tiny", "smollm2", "tiny-qwen3_5", "smollm2-qwen3_5"):
        assert served_tokenizer(spec) == "smollm2"
    folder = tmp_path / "hf"
    folder.mkdir()
    assert served_tokenizer(str(folder)) is None  # weights alone: no tokenizer to render with
    (folder / "tokenizer.json").write_text("{}")
    assert served_tokenizer(str(folder)) == str(folder.absolute())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_tokenizer(str(gguf)) == str(gguf.absolute())
    assert served_tokenizer("org/model-on-a-hub") is None
    assert served_tokenizer(str(tmp_path / "missing.gguf")) is None


def test_the_loops_sidecar_answers_responses_with_the_policys_tokens(tmp_path: Path) -> None:
    try:
        model, tokenizer = load_policy("tiny")
    except ValueError as err:  # the shipped SmolLM2 package holds the tokenizer
        pytest.skip(f"needs the shipped SmolLM2 model: {err}")
    cfg = parse_args(["--smoke", f"run.out_dir={tmp_path}", "sidecar.port=0"])
    assert cfg.sidecar.tokenizer is None  # nothing set: the loop takes serve.model's
    serve_cfg = dataclasses.replace(cfg.serve, port=0)
    store_url = f"sqlite:///{tmp_path / 'traces.db'}"
    with start_server(copy_model(model), tokenizer, serve_cfg) as server:
        capture = start_capture(cfg, None, server.url, store_url, tmp_path)  # type: ignore[arg-type]
        try:
            client = OpenAI(base_url=capture.base_url("r1"), api_key="x", max_retries=0)
            reply = client.responses.create(model="policy", input="Say hi.", max_output_tokens=4)
        finally:
            capture.stop()
    assert reply.status in ("completed", "incomplete") and reply.usage is not None
    store = open_store(store_url)
    try:
        (call,) = store.calls("r1")
    finally:
        store.close()
    assert call.request["input"] == "Say hi."  # the harness's own body
    assert call.response["dialect"] == "responses"
    # The prompt the server got is SmolLM2's chat template of the conversation, as token ids.
    expected = tokenizer.encode(
        tokenizer.render_chat(
            [{"role": "user", "content": "Say hi."}], tools=None, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert list(call.prompt_token_ids) == list(expected)
    assert len(call.choices[0].token_ids) == reply.usage.output_tokens
