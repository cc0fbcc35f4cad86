"""Fixtures: a fake vLLM upstream and an in-process sidecar in front of it, both on real ports."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "fixtures" / "vllm"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "traces"))

from fake_vllm import FakeVLLM, ServerThread
from pg_cluster import pg_dsn, pg_server  # noqa: F401  (fixtures for the PostgreSQL-backed test)

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
