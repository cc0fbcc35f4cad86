"""Fixtures: the upstreams (a fake vLLM for fault injection, the real embedded server with a tiny
random model) and in-process sidecars in front of them, all on real ports."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "fixtures" / "vllm"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "traces"))

from fake_vllm import FakeVLLM, ServerThread
from pg_cluster import pg_ctl, pg_dsn, pg_server  # noqa: F401  (fixtures for the PostgreSQL tests)

from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.app import build_app
from proxy_sidecar.config import SidecarConfig


class Sidecar:
    def __init__(self, server: ServerThread, store: SQLiteTraceStore, app: Any) -> None:
        self.server = server
        self.url = server.url
        self.store = store
        self.state = app.state.sidecar

    def base(self, rollout: str) -> str:
        return f"{self.url}/rollouts/{rollout}/v1"


@pytest.fixture(scope="module")
def _fake_server() -> Iterator[tuple[FakeVLLM, ServerThread]]:
    upstream = FakeVLLM()
    with ServerThread(upstream.app) as server:
        yield upstream, server


@pytest.fixture
def fake(_fake_server: tuple[FakeVLLM, ServerThread]) -> tuple[FakeVLLM, ServerThread]:
    """The module's fake upstream with its knobs back at their defaults."""
    upstream = _fake_server[0]
    upstream.policy_version = None
    upstream.fail_statuses = []
    upstream.delay_s = 0.0
    upstream.drop_after_chunks = None
    upstream.requests = []
    upstream.seen = []
    upstream.honor_token_ids = True
    return _fake_server


@pytest.fixture(scope="session")
def embedded() -> Iterator[str]:
    """The embedded server `harnessrl.serve`, as `python -m harnessrl.train --smoke` runs it: a
    tiny random model around SmolLM2's tokenizer. Its own limits stay at their defaults except
    tokens per request, kept small so that a fuzzed request cannot decode for long."""
    from harnessrl.model.formats.load import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ValueError as err:
        pytest.skip(f"needs the shipped SmolLM2 model (its tokenizer): {err}")
    from harnessrl.model.formats.load import load_policy
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    model, tokenizer = load_policy("tiny", seed=0)
    config = ServeConfig(
        model="smol",
        port=0,
        num_slots=4,
        max_model_len=512,
        prefill_buckets=(64,),
        decode_buckets=(512,),
        max_request_tokens=2048,
    )
    handle = start_server(model, tokenizer, config)
    yield handle.url
    handle.stop()


@pytest.fixture(params=["fake", "embedded"])
def upstream_url(request: pytest.FixtureRequest, fake: tuple[FakeVLLM, ServerThread]) -> str:
    """Each upstream in turn: the fake vLLM, then the real embedded server."""
    if request.param == "fake":
        return fake[1].url
    return str(request.getfixturevalue("embedded"))


@pytest.fixture
def make_sidecar(tmp_path: pathlib.Path) -> Iterator[Callable[..., Sidecar]]:
    servers: list[ServerThread] = []
    stores: list[SQLiteTraceStore] = []

    def make(upstreams: tuple[str, ...], store: Any = None, **kw: Any) -> Sidecar:
        store = store or SQLiteTraceStore(tmp_path / f"traces{len(stores)}.db")
        kw.setdefault("log_calls", False)
        config = SidecarConfig(upstreams=upstreams, store="sqlite:///unused", **kw)
        app = build_app(config, store=store)
        server = ServerThread(app).__enter__()
        servers.append(server)
        stores.append(store)
        return Sidecar(server, store, app)

    yield make
    for server in servers:
        server.__exit__(None, None, None)
    for store in stores:
        store.close()


@pytest.fixture
def sidecar(fake: tuple[FakeVLLM, ServerThread], make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    return make_sidecar((fake[1].url,))
