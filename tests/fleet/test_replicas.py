"""Every replica of a Kubernetes Service gets the new weights, and each call is labelled with the
version of the replica that served it: real embedded servers as the replicas, found through the
fake API server's EndpointSlices, behind one real sidecar; the push goes through `RemoteServing`
as the train loop runs it (weights fetched from the trainer over HTTP)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.fleet.capture import LocalCapture
from harnessrl.fleet.replicas import Replicas, ready_addresses
from harnessrl.fleet.serving import remote_serving
from harnessrl.fleet.sidecar import SidecarProcess
from harnessrl.fleet.weight_sync import WeightSyncError
from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.config import SidecarConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
from fake_apiserver import FakeKube, Outcome

HOSTS = ("127.0.0.2", "127.0.0.3")  # two pods: one port, two addresses, as in a cluster
ADMIN_TOKEN = "replicas-admin-token"  # one for every replica, as a cluster's Secret gives them


def common_port() -> int:
    """A port free on both replica addresses."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((HOSTS[0], 0))
            port = int(s.getsockname()[1])
        try:
            with socket.socket() as s:
                s.bind((HOSTS[1], port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both replica addresses")


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


class Learner:
    """What `RemoteServing.push` needs of a learner: an HF export of its weights."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def export_hf(self, folder: Path, tokenizer: Any) -> Path:
        from harnessrl.model.formats.export import export_hf

        return export_hf(self.model, folder)


class Refusing:
    """Replica b's loader: it loads until `refuse` is set (a replica that cannot take a push)."""

    def __init__(self) -> None:
        from harnessrl.engine.swap import load_params

        self.load, self.refuse = load_params, False

    def __call__(self, path: str) -> Any:
        if self.refuse:
            raise OSError("disk full")
        return self.load(path)


@pytest.fixture
def replicas() -> Iterator[tuple[list[Any], int, Refusing, Any]]:
    from flax import nnx

    from harnessrl.model.families.dense.config import ModelConfig
    from harnessrl.model.families.dense.decoder import Decoder
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    cfg = ModelConfig.tiny(vocab_size=258, eos_token_id=257)
    port, refusing = common_port(), Refusing()
    servers = []
    for host, loader in zip(HOSTS, (None, refusing), strict=True):
        serve = ServeConfig(
            host=host, port=port, num_slots=2, max_model_len=64, prefill_buckets=(16,),
            warmup=False, admin_token=ADMIN_TOKEN,
        )  # fmt: skip
        kw = {"params_loader": loader} if loader else {}
        servers.append(start_server(Decoder(cfg, rngs=nnx.Rngs(0)), ByteTokenizer(), serve, **kw))
    try:
        yield servers, port, refusing, Learner(Decoder(cfg, rngs=nnx.Rngs(1)))
    finally:
        for s in servers:
            s.stop()


def call_all(sidecar: SidecarProcess, tag: str, n: int = 10) -> None:
    for k in range(n):
        r = httpx.post(
            sidecar.base_url(f"{tag}{k}") + "/completions",
            json={"model": "smollm2", "prompt": [72, 105], "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text


SLOW = pytest.mark.skipif(
    not os.environ.get("HARNESSRL_SLOW"), reason="decodes on both replicas: set HARNESSRL_SLOW=1"
)


@pytest.mark.parametrize("with_calls", [False, pytest.param(True, marks=SLOW)])
def test_every_replica_is_pushed_and_calls_carry_their_replicas_version(
    replicas: Any, tmp_path: Path, with_calls: bool
) -> None:
    """Without calls: the push and the versions the sidecar is told; with: the recorded calls."""
    from kubernetes import client

    servers, port, refusing, learner = replicas
    urls = {s.url: s for s in servers}
    decide = lambda job: Outcome("complete")  # noqa: E731  (no Jobs in this test)
    with FakeKube(decide) as kube:
        # Both pods ready, a third still starting: it must be neither pushed nor called.
        kube.add_endpoint_slice("harnessrl", "vllm", [(h, True) for h in HOSTS], port)
        kube.add_endpoint_slice("harnessrl", "vllm", [("127.0.0.4", False)], port)
        kube.add_endpoint_slice("other", "vllm", [("127.0.0.5", True)], port)
        api = client.ApiClient(client.Configuration(host=kube.url))
        serving = remote_serving(
            f"k8s://harnessrl/vllm:{port}", "embedded", tmp_path / "weights", None,
            admin_token=ADMIN_TOKEN, weight_push="http", api_client=api,
        )  # fmt: skip
        store_url = f"sqlite:///{tmp_path / 'traces.db'}"
        cfg = SidecarConfig(upstreams=tuple(urls), store=store_url, log_calls=False, port=0)
        sidecar = SidecarProcess(cfg, tmp_path / "sidecar.log")
        capture = LocalCapture(sidecar)
        try:
            with capture.hold(1):
                serving.push(learner, 1)
            assert {s.engine.version for s in servers} == {1}, "every replica took version 1"
            assert set(serving.sync.last_push_s) == set(urls)  # seconds per replica
            if with_calls:
                call_all(sidecar, "a")
            refusing.refuse = True  # replica b cannot take version 2; a can
            hold = capture.hold(2)
            with pytest.raises(WeightSyncError, match=r"127\.0\.0\.3.*disk full") as err, hold:
                serving.push(learner, 2)
            a, b = sorted(urls)
            assert err.value.updated == {a: 2}
            assert (urls[a].engine.version, urls[b].engine.version) == (2, 1)
            assert sidecar.status()["upstream_versions"] == {a: 2}
            if with_calls:
                call_all(sidecar, "b")
        finally:
            capture.stop()
            serving.stop()
    if not with_calls:
        return
    store = SQLiteTraceStore(tmp_path / "traces.db")
    try:
        first = [c for k in range(10) for c in store.calls(f"a{k}")]
        after = [c for k in range(10) for c in store.calls(f"b{k}")]
    finally:
        store.close()
    assert {c.upstream for c in first} == {c.upstream for c in after} == set(urls)
    assert all(c.policy_version == 1 for c in first)
    assert all(c.policy_version == (2 if c.upstream == a else 1) for c in after)


def test_ready_addresses_follow_the_endpoint_conditions() -> None:
    slices = [
        {"addressType": "IPv4", "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {}},  # unknown counts as ready
            {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "terminating": True}},
            {"addresses": [], "conditions": {"ready": True}},
        ]},
        {"addressType": "FQDN", "endpoints": [{"addresses": ["vllm.example"]}]},
    ]  # fmt: skip
    assert ready_addresses(slices) == ["10.0.0.1", "10.0.0.2"]


def test_a_service_without_ready_replicas_stops_the_push() -> None:
    from kubernetes import client

    with FakeKube(lambda job: Outcome("complete")) as kube:
        kube.add_endpoint_slice("harnessrl", "vllm", [("127.0.0.9", False)], 8000)
        api = client.ApiClient(client.Configuration(host=kube.url))
        with pytest.raises(RuntimeError, match=r"no ready endpoint.*get endpointslices"):
            Replicas("k8s://harnessrl/vllm:8000", api).urls()
    assert Replicas("http://a:1/v1, http://b:2/").urls() == ("http://a:1", "http://b:2")
    with pytest.raises(ValueError, match=r"rollout\.servers must be"):
        Replicas("vllm:8000")
    with pytest.raises(ValueError, match="NAMESPACE/SERVICE:PORT"):
        Replicas("k8s://vllm:8000")
