"""Who holds the harness's calls while new weights go in, and tells each rollout where to call.

In: a rollout id, or a policy version to switch to. Out: the base URL and reward credential a
harness gets, a hold during which new calls wait, and an eval mode in which calls are sampled with
the sidecar's eval overrides: this process's own sidecar (local launcher), or the sidecar of each
harness pod (Kubernetes launcher).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import httpx

from harnessrl.fleet.sidecar import SidecarRefused
from harnessrl.fleet.weight_sync import WeightSyncError
from proxy_sidecar.control import rollout_token, rollout_url

# How long a hold waits for the calls in flight to finish; past it the swap is not made.
DRAIN_TIMEOUT_S = 120.0


class HoldFailed(RuntimeError):
    """A sidecar could not drain its calls in flight: the new weights were not swapped in."""


def hold_failed(version: int, err: SidecarRefused) -> HoldFailed:
    why = (
        " (a swap now would record calls sampled under the old weights as the new version)"
        if err.status == 409  # the sidecar's answer to a pause that could not drain
        else ""
    )
    return HoldFailed(f"weight swap to policy version {version} not made: {err}{why}")


class Capture(Protocol):
    def base_url(self, rollout_id: str) -> str: ...

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        """(URL, bearer token) with which this rollout's harness may post its own reward."""
        ...

    def hold(self, version: int) -> contextlib.AbstractContextManager[None]:
        """New calls wait inside; HoldFailed, before anything inside runs, if the calls in flight
        do not finish within the drain timeout."""
        ...

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Runs started inside are sampled with the sidecars' eval overrides."""
        ...

    def stop(self) -> None: ...


class LocalCapture:
    """This process's `python -m proxy_sidecar` (a `SidecarProcess`) in front of the servers."""

    def __init__(self, sidecar: Any, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.sidecar = sidecar
        self.base_url = sidecar.base_url
        self.drain_timeout_s = drain_timeout_s

    def reward_credential(self, rollout_id: str) -> tuple[str, str]:
        url = rollout_url(self.sidecar.url, rollout_id, "reward")
        return url, rollout_token(self.sidecar.token, rollout_id)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """New calls wait (in-flight ones drain) inside; after a clean exit they carry `version`
        (after a push that reached some servers only: the calls those serve)."""
        try:  # a sidecar that cannot drain withdraws the pause itself
            pause = {"drain_timeout_s": self.drain_timeout_s}
            self.sidecar.control("pause", pause, timeout_s=self.drain_timeout_s + 30)
        except SidecarRefused as err:
            raise hold_failed(version, err) from err
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

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        self.sidecar.control("mode", {"mode": "eval"})
        try:
            yield
        finally:
            self.sidecar.control("mode", {"mode": "train"})

    def stop(self) -> None:
        self.sidecar.stop()


class PodCapture:
    """The native sidecar of each harness Job: paused over their control API during a push."""

    def __init__(
        self,
        launcher: Any,
        token: str,
        client: httpx.Client | None = None,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        if not token:
            raise ValueError(
                "the Kubernetes launcher needs the sidecars' control token in "
                "HARNESSRL_CONTROL_TOKEN (key `token` of Secret harnessrl-control; the controller "
                "manifest in k8s/controller sets it)"
            )
        self.launcher = launcher
        self.sidecar_url = launcher.config.sidecar.url  # the pod's own sidecar, on localhost
        self._token = token
        self.drain_timeout_s = drain_timeout_s
        # Longer than a drain, so that a pod that is slow to drain is never taken for gone.
        self.client = client or httpx.Client(
            headers={"Authorization": f"Bearer {token}"}, timeout=drain_timeout_s + 30
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
                try:
                    if self._post(url, "pause", {"drain_timeout_s": self.drain_timeout_s}):
                        paused.append(url)
                except SidecarRefused as err:  # the others paused so far are resumed below
                    raise hold_failed(version, err) from err
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

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Jobs created inside start their sidecar in eval mode (the pods' default overrides)."""
        self.launcher.sidecar_mode = "eval"
        try:
            yield
        finally:
            self.launcher.sidecar_mode = "train"

    def _post(self, url: str, action: str, body: dict[str, Any]) -> bool:
        """False when the pod is gone (its run finished meanwhile); other answers must be 200."""
        try:
            r = self.client.post(f"{url}/control/{action}", json=body)
        except httpx.TransportError:
            return False
        if r.status_code != 200:
            raise SidecarRefused(url, action, r)
        return True

    def stop(self) -> None:
        self.client.close()
