"""Where the policy is served: the embedded JAX server in this process, or remote servers.

In: the learner's weights and their policy version. Out: servers answering with them. Remote
servers (vLLM, or embedded servers elsewhere) load an exported HF folder: from shared storage
(`weight_push=shared`), or fetched from this process over HTTP (`weight_push=http`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from harnessrl.fleet.export_server import ExportServer
from harnessrl.fleet.weight_sync import EmbeddedSync, VLLMSync, VLLMSyncConfig, WeightSync
from harnessrl.serve.app import ServerHandle

M = TypeVar("M", bound=nnx.Module)
KEEP_EXPORTS = 2  # the served version and the one before it: a server mid-reload still finds it


class Serving(Protocol):
    url: str  # what sidecars forward to (comma-separated when there are several servers)

    @property
    def compile_count(self) -> int: ...

    def push(self, learner: Any, version: int) -> None: ...

    def stop(self) -> None: ...


def copy_model(model: M) -> M:
    """The same module on fresh buffers, so the learner's donated updates never touch the server."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), state))


class EmbeddedServing:
    """The in-process server: new params are swapped into its engine, no copy to disk (so no
    `/admin` call: its admin token, made when `serve.admin_token` is empty, stays on
    `server.admin_token` for a caller that wants HTTP loads)."""

    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.url = server.url

    @property
    def compile_count(self) -> int:
        return int(self.server.engine.compile_count)

    def push(self, learner: Any, version: int) -> None:
        self.server.engine.swap_params(learner.params_state(), version)

    def stop(self) -> None:
        self.server.stop()


WEIGHT_PUSHES = ("shared", "http")


class RemoteServing:
    """Servers elsewhere: export to `export_root`, then make every server load it."""

    def __init__(
        self,
        urls: str,
        sync: WeightSync,
        export_root: Path,
        tokenizer: Any,
        source: ExportServer | None = None,
    ) -> None:
        self.url = urls  # a k8s:// Service too: sidecars list its replicas themselves
        self.sync = sync
        self.export_root = export_root
        self.tokenizer = tokenizer
        self.source = source
        self.compile_count = 0  # remote servers compile on their own; not counted here

    def push(self, learner: Any, version: int) -> None:
        folder = self.export_root / f"v{version:06d}"
        learner.export_hf(folder, self.tokenizer)
        self.sync.push(folder, version)
        exports = sorted(p for p in self.export_root.glob("v*") if p.is_dir())
        for old in exports[:-KEEP_EXPORTS]:
            shutil.rmtree(old, ignore_errors=True)

    def stop(self) -> None:
        if self.source is not None:
            self.source.stop()


def remote_serving(
    urls: str,
    weight_sync: str,
    export_root: Path,
    tokenizer: Any,
    admin_token: str = "",
    weight_push: str = "shared",
    push_address: str = "",
    api_client: Any = None,
) -> RemoteServing:
    """`weight_sync`: vllm (servers started with VLLM_SERVER_DEV_MODE=1; `admin_token` is their
    API key, which k8s/base/vllm_guard.py asks of every route) or embedded (whose
    `/admin/load_weights` always takes a token: `admin_token` is the one the servers were given
    with `--admin-token`, or the one a server given none wrote to its `--admin-token-file`).
    `weight_push`:
    shared (the servers read `export_root`) or http (they fetch it from this process, served on
    `push_address`). `urls` may be one k8s://NAMESPACE/SERVICE:PORT, read with `api_client`."""
    if weight_sync not in ("vllm", "embedded"):
        raise ValueError(f"rollout.weight_sync must be vllm or embedded, got {weight_sync!r}")
    if weight_push not in WEIGHT_PUSHES:
        raise ValueError(f"rollout.weight_push must be shared or http, got {weight_push!r}")
    key = admin_token or None
    vllm_cfg = (
        VLLMSyncConfig(urls=tuple(urls.split(",")), api_key=key) if weight_sync == "vllm" else None
    )
    source = None
    if weight_push == "http":
        export_root.mkdir(parents=True, exist_ok=True)
        source = ExportServer(export_root, push_address)
    sync: WeightSync
    if vllm_cfg is not None:
        sync = VLLMSync(vllm_cfg, source=source, api_client=api_client)
    else:
        sync = EmbeddedSync(urls, admin_token=key, source=source, api_client=api_client)
    return RemoteServing(urls, sync, export_root, tokenizer, source)
