"""Weight sync: new learner weights into the serving fleet, between two rollout rounds.

In: an exported HF safetensors folder and a policy version. Out: servers elsewhere that answer with
the new weights: embedded JAX servers, or vLLM, each through its HTTP API.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx


class WeightSyncError(RuntimeError):
    """A server did not take the new weights; the train loop must not record the new version."""


class WeightSync(Protocol):
    def push(self, export_dir: Any, version: int) -> None:
        """Make every server serve the exported folder's weights as `version`; returns once they do."""
        ...


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    return version


def check_export_dir(path: Any) -> Path:
    """An exported HF folder: config.json plus safetensors. Checked before any server sees it."""
    if not isinstance(path, str | Path):
        raise TypeError(
            f"expected the path of an exported HF folder, got {type(path).__name__}; "
            "write one with harnessrl.model.export.export_hf(model, out_dir) first"
        )
    p = Path(path)
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"{str(p)!r} is not an exported HF folder (needs config.json and *.safetensors); "
            "export with harnessrl.model.export.export_hf and pass that folder"
        )
    return p


def _urls(urls: Sequence[str] | str, what: str) -> tuple[str, ...]:
    items = tuple(
        u.strip().rstrip("/") for u in (urls.split(",") if isinstance(urls, str) else urls)
    )
    if not items or not all(u.startswith(("http://", "https://")) for u in items):
        raise ValueError(f"{what} urls must be http(s) server roots, got {urls!r}")
    return items


class EmbeddedSync:
    """Embedded JAX servers elsewhere: each loads an exported folder on `POST /admin/load_weights`.

    (In the trainer's own process, `EmbeddedServing` swaps params into the engine directly.)
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        timeout_s: float = 600.0,
        client: httpx.Client | None = None,
        admin_token: str | None = None,  # the servers' --admin-token (sent as a bearer token)
    ) -> None:
        self.urls = _urls(urls, "EmbeddedSync")
        self._client = client or httpx.Client(timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def push(self, export_dir: Any, version: int) -> None:
        version = _check_version(version)
        path = check_export_dir(export_dir)
        for url in self.urls:
            try:
                r = self._client.post(
                    f"{url}/admin/load_weights",
                    json={"path": str(path.resolve()), "version": version},
                    headers=self._headers,
                )
            except httpx.HTTPError as err:
                raise WeightSyncError(f"{url}: load_weights failed: {err}") from err
            if r.status_code != 200 or r.json().get("version") != version:
                raise WeightSyncError(
                    f"{url}: load_weights answered {r.status_code}: {r.text[:500]}"
                )


@dataclass(frozen=True)
class VLLMSyncConfig:
    """vLLM servers started with VLLM_SERVER_DEV_MODE=1 (that enables the endpoints used here)."""

    urls: tuple[str, ...]
    timeout_s: float = 600.0  # one reload; big models on slow shared storage take a while
    pause_mode: str = "wait"  # vLLM's /pause: "wait" drains in-flight requests, "abort" drops them
    # Shared storage mounted elsewhere on the servers: (prefix on the learner, prefix on servers).
    path_map: tuple[str, str] | None = None
    # Sent as a bearer token. vLLM's own --api-key guards only /v1/*, not these endpoints (0.32):
    # it matters behind a proxy that checks it.
    api_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", _urls(self.urls, "VLLMSyncConfig"))
        if self.pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(
                f"VLLMSyncConfig.pause_mode must be wait|abort|keep, got {self.pause_mode!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"VLLMSyncConfig.timeout_s must be > 0, got {self.timeout_s!r}")


class VLLMSync:
    """Reload weights in place from an exported folder through vLLM's documented HTTP endpoints.

    Per server: `POST /pause?mode=wait` → `POST /collective_rpc` with `reload_weights(weights_path)`
    on every worker → `POST /reset_prefix_cache` (cached KV came from the old weights) →
    `POST /update_weight_version` → `POST /resume` (always, even after a failure).
    """

    def __init__(self, config: VLLMSyncConfig, client: httpx.Client | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = client or httpx.Client(timeout=config.timeout_s, headers=headers)
        self.last_push_s = 0.0  # how long the last push held one server (pause to resume)

    def server_path(self, path: Path) -> str:
        text = str(path.resolve())
        if self.config.path_map is not None:
            src, dst = self.config.path_map
            if not text.startswith(src):
                raise ValueError(f"export dir {text!r} is not under path_map source {src!r}")
            text = dst + text[len(src) :]
        return text

    def push(self, export_dir: Any, version: int) -> None:
        version = _check_version(version)
        # Checked here because a bad path makes vLLM's worker raise, which kills its engine.
        weights_path = self.server_path(check_export_dir(export_dir))
        for url in self.config.urls:
            self._push_one(url, weights_path, version)

    def _push_one(self, url: str, weights_path: str, version: int) -> None:
        t0 = time.monotonic()
        self._post(url, "/pause", params={"mode": self.config.pause_mode})
        try:
            self._reload(url, weights_path)
            r = self._post(url, "/reset_prefix_cache")
            # vLLM answers {"success": false} while KV blocks are still held; serving on would
            # reuse prefixes computed with the old weights.
            if r.content and r.json().get("success") is False:
                raise WeightSyncError(f"{url}/reset_prefix_cache answered {r.text[:200]}")
            self._post(url, "/update_weight_version", json={"new_version": str(version)})
        except BaseException as err:
            try:
                self._post(url, "/resume")  # always, also after a failure
            except WeightSyncError as resume_err:
                # A failed reload stops vLLM, so /resume fails too: report the cause first.
                raise WeightSyncError(f"{err}; then {resume_err}") from err
            raise
        self._post(url, "/resume")
        self.last_push_s = time.monotonic() - t0

    def _reload(self, url: str, weights_path: str) -> None:
        body = {
            "method": "reload_weights",
            "kwargs": {"weights_path": weights_path},
            "timeout": self.config.timeout_s,
        }
        try:
            r = self._post(url, "/collective_rpc", json=body)
        except WeightSyncError as err:
            raise WeightSyncError(
                f"{err}; vLLM stops serving after a failed reload_weights: restart it, and push "
                "only folders with the served model's architecture and tensor shapes, at a path "
                "the server can read (see path_map)"
            ) from err
        results = r.json().get("results") if r.content else None
        if results is not None and any(x is not None for x in results):
            raise WeightSyncError(f"{url}: reload_weights returned {results!r}")

    def _post(self, url: str, path: str, **kw: Any) -> httpx.Response:
        try:
            try:
                r = self._client.post(url + path, **kw)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                # After a 500 whose handler raised (a failed reload), vLLM's uvicorn closes the
                # connection; a request already sent on it is reset unread. Once more, anew.
                r = self._client.post(url + path, **kw)
        except httpx.HTTPError as err:
            raise WeightSyncError(f"{url}{path} failed: {err}") from err
        if r.status_code == 404:
            raise WeightSyncError(
                f"{url}{path} is not served: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                "(it enables the weight-reload endpoints)"
            )
        if r.status_code != 200:
            raise WeightSyncError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        return r
