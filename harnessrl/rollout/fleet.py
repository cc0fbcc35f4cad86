"""Where the policy is served, and who holds the harness's calls while new weights go in.

In: the learner's weights and their policy version. Out: servers answering with them, and every
call after the swap recorded with that version. Two serving sides: the embedded JAX server in this
process, or remote servers (vLLM, or embedded servers elsewhere) loading an exported HF folder from
shared storage. Two capture sides: this process's own sidecar (local launcher), or the sidecar of
each harness pod in flight (Kubernetes launcher).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx

from harnessrl.rollout.weight_sync import EmbeddedSync, VLLMSync, VLLMSyncConfig, WeightSync
from harnessrl.serve.app import ServerHandle
from proxy_sidecar.control import rollout_token

KEEP_EXPORTS = 2  # the served version and the one before it: a server mid-reload still finds it


class Serving(Protocol):
    url: str  # what sidecars forward to (comma-separated when there are several servers)

    @property
    def compile_count(self) -> int: ...

    def push(self, learner: Any, version: int) -> None: ...

    def stop(self) -> None: ...


class EmbeddedServing:
    """The in-process server: new params are swapped into its engine, no copy to disk."""

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


class RemoteServing:
    """Servers elsewhere: export to `export_root` (shared storage), then make each server load it."""

    def __init__(self, urls: str, sync: WeightSync, export_root: Path, tokenizer: Any) -> None:
        self.url = urls
        self.sync = sync
        self.export_root = export_root
        self.tokenizer = tokenizer
        self.compile_count = 0  # remote servers compile on their own; not counted here

    def push(self, learner: Any, version: int) -> None:
        folder = self.export_root / f"v{version:06d}"
        learner.export_hf(folder, self.tokenizer)
        self.sync.push(folder, version)
        exports = sorted(p for p in self.export_root.glob("v*") if p.is_dir())
        for old in exports[:-KEEP_EXPORTS]:
            shutil.rmtree(old, ignore_errors=True)

    def stop(self) -> None:
        pass


def remote_serving(
    urls: str, weight_sync: str, export_root: Path, tokenizer: Any, admin_token: str = ""
) -> RemoteServing:
    """`weight_sync`: vllm (servers started with VLLM_SERVER_DEV_MODE=1) or embedded (whose
    `/admin/load_weights` takes `admin_token`, the servers' `--admin-token`)."""
    sync: WeightSync
    if weight_sync == "vllm":
        sync = VLLMSync(VLLMSyncConfig(urls=tuple(urls.split(","))))
    elif weight_sync == "embedded":
        sync = EmbeddedSync(urls=urls, admin_token=admin_token or None)
    else:
        raise ValueError(f"rollout.weight_sync must be vllm or embedded, got {weight_sync!r}")
    return RemoteServing(urls, sync, export_root, tokenizer)


class Capture(Protocol):
    def base_url(self, rollout_id: str) -> str: ...

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        """(URL, bearer token) with which this rollout's harness may post its own reward."""
        ...

    def hold(self, version: int) -> contextlib.AbstractContextManager[None]: ...

    def stop(self) -> None: ...


class LocalCapture:
    """This process's `python -m proxy_sidecar` (a `SidecarProcess`) in front of the servers."""

    def __init__(self, sidecar: Any) -> None:
        self.sidecar = sidecar
        self.base_url = sidecar.base_url

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        url = f"{self.sidecar.url}/rollouts/{rollout_id}/reward"
        return url, rollout_token(self.sidecar.token, rollout_id)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """New calls wait (in-flight ones drain) inside; after a clean exit they carry `version`."""
        self.sidecar.control("pause", {"drain_timeout_s": 120})
        try:
            yield
            self.sidecar.control("policy_version", {"version": version})
        finally:
            self.sidecar.control("resume")

    def stop(self) -> None:
        self.sidecar.stop()


class PodCapture:
    """The native sidecar of each harness Job: paused over their control API during a push."""

    def __init__(self, launcher: Any, token: str, client: httpx.Client | None = None) -> None:
        if not token:
            raise ValueError(
                "the Kubernetes launcher needs the sidecars' control token in "
                "HARNESSRL_CONTROL_TOKEN (key `token` of Secret harnessrl-control; the controller "
                "manifest in k8s/controller sets it)"
            )
        self.launcher = launcher
        self.port = launcher.config.sidecar.port
        self._token = token
        self.client = client or httpx.Client(
            headers={"Authorization": f"Bearer {token}"}, timeout=150.0
        )

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/rollouts/{rollout_id}/v1"  # inside the pod

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        # The pod's sidecar holds the same control token (Secret harnessrl-control).
        url = f"http://127.0.0.1:{self.port}/rollouts/{rollout_id}/reward"
        return url, rollout_token(self._token, rollout_id)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """Pause the sidecars of the runs in flight; Jobs created afterwards start at `version`."""
        paused = []
        try:
            for url in sorted(set(self.launcher.sidecar_urls())):
                if self._post(url, "pause", {"drain_timeout_s": 120}):
                    paused.append(url)
            yield
            self.launcher.policy_version = version
            for url in paused:
                self._post(url, "policy_version", {"version": version})
        finally:
            for url in paused:
                self._post(url, "resume", {})

    def _post(self, url: str, action: str, body: dict[str, Any]) -> bool:
        """False when the pod is gone (its run finished meanwhile); other answers must be 200."""
        try:
            r = self.client.post(f"{url}/control/{action}", json=body)
        except httpx.TransportError:
            return False
        if r.status_code != 200:
            raise RuntimeError(
                f"sidecar {url}/control/{action} answered {r.status_code}: {r.text[:300]}"
            )
        return True

    def stop(self) -> None:
        self.client.close()
