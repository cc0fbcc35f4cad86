"""Who holds the harness's calls while new weights go in, and tells each rollout where to call.

In: a rollout id, or a policy version to switch to. Out: the base URL and reward credential a
harness gets, and a hold during which new calls wait: this process's own sidecar (local launcher),
or the sidecar of each harness pod in flight (Kubernetes launcher).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import httpx

from harnessrl.fleet.weight_sync import WeightSyncError
from proxy_sidecar.control import rollout_token, rollout_url


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
        url = rollout_url(self.sidecar.url, rollout_id, "reward")
        return url, rollout_token(self.sidecar.token, rollout_id)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """New calls wait (in-flight ones drain) inside; after a clean exit they carry `version`
        (after a push that reached some servers only: the calls those serve)."""
        self.sidecar.control("pause", {"drain_timeout_s": 120})
        try:
            try:
                yield
            except WeightSyncError as err:
                for url, served in err.updated.items():
                    self.sidecar.control("policy_version", {"version": served, "upstream": url})
                raise
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
        self.sidecar_url = launcher.config.sidecar.url  # the pod's own sidecar, on localhost
        self._token = token
        self.client = client or httpx.Client(
            headers={"Authorization": f"Bearer {token}"}, timeout=150.0
        )

    def base_url(self, rollout_id: str) -> str:
        return rollout_url(self.sidecar_url, rollout_id)

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        # The pod's sidecar holds the same control token (Secret harnessrl-control).
        url = rollout_url(self.sidecar_url, rollout_id, "reward")
        return url, rollout_token(self._token, rollout_id)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """Pause the sidecars of the runs in flight; Jobs created afterwards start at `version`."""
        paused = []
        try:
            for url in sorted(set(self.launcher.sidecar_urls())):
                if self._post(url, "pause", {"drain_timeout_s": 120}):
                    paused.append(url)
            try:
                yield
            except WeightSyncError as err:  # the replicas that took it serve it: say so
                for url in paused:
                    for upstream, served in err.updated.items():
                        self._post(url, "policy_version", {"version": served, "upstream": upstream})
                raise
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
