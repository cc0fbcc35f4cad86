"""Weight sync: new learner weights into the serving fleet, between two rollout rounds.

In: an exported HF safetensors folder and a policy version. Out: servers elsewhere that answer with
the new weights: embedded JAX servers, or vLLM, each through its HTTP API. Every replica is pushed
at once (each paused, reloaded and resumed on its own thread), reading the folder from shared
storage or fetching it from the trainer's `ExportServer` (`weight_push=http`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from harnessrl.fleet.export_server import ExportServer
from harnessrl.fleet.replicas import Replicas, server_urls


class WeightSyncError(RuntimeError):
    """A server did not take the new weights; the train loop must not record the new version.

    `updated`: replica URL -> version, for the replicas that did take it (they serve it now).
    """

    def __init__(self, message: str, updated: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.updated = dict(updated or {})


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
            "write one with harnessrl.model.formats.export.export_hf(model, out_dir) first"
        )
    p = Path(path)
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"{str(p)!r} is not an exported HF folder (needs config.json and *.safetensors); "
            "export with harnessrl.model.formats.export.export_hf and pass that folder"
        )
    return p


def _replicas(urls: Replicas | Sequence[str] | str, what: str, api_client: Any) -> Replicas:
    """A fixed URL list, or one `k8s://NAMESPACE/SERVICE:PORT` resolved at every push."""
    if isinstance(urls, Replicas):
        return urls
    items = [urls] if isinstance(urls, str) else list(urls)
    text = ",".join(u.strip() for u in items)
    if text.startswith("k8s://"):
        return Replicas(text, api_client)
    return Replicas(",".join(server_urls(text, f"{what} urls")))


def push_replicas(
    urls: Sequence[str], push_one: Callable[[str], None], version: int, parallel: bool = True
) -> dict[str, float]:
    """`push_one(url)` on every replica, all at once (`parallel`) or in turn; returns the seconds
    each took. Every replica is tried; a failure names each replica that failed."""
    timings: dict[str, float] = {}

    def timed(url: str) -> BaseException | None:
        t0 = time.monotonic()
        try:
            push_one(url)
        except Exception as err:
            return err
        timings[url] = time.monotonic() - t0
        return None

    if parallel and len(urls) > 1:
        with ThreadPoolExecutor(len(urls)) as pool:
            errors = list(pool.map(timed, urls))
    else:
        errors = [timed(url) for url in urls]
    failed = [(u, e) for u, e in zip(urls, errors, strict=True) if e is not None]
    if failed:
        updated = {url: version for url in timings}
        if len(failed) == 1 and isinstance(failed[0][1], WeightSyncError):
            raise WeightSyncError(str(failed[0][1]), updated) from failed[0][1]
        why = "; ".join(f"{u}: {type(e).__name__}: {e}" for u, e in failed)
        raise WeightSyncError(
            f"{len(failed)} of {len(urls)} servers did not take version {version}: {why}", updated
        ) from failed[0][1]
    return timings


class EmbeddedSync:
    """Embedded JAX servers elsewhere: each loads an exported folder on `POST /admin/load_weights`
    (from its path on shared storage, or fetched from the trainer's `source`).

    (In the trainer's own process, `EmbeddedServing` swaps params into the engine directly.)
    """

    def __init__(
        self,
        urls: Replicas | Sequence[str] | str,
        timeout_s: float = 600.0,
        client: httpx.Client | None = None,
        admin_token: str | None = None,  # the servers' admin token (sent as a bearer token)
        source: ExportServer | None = None,  # weight_push=http: servers fetch from the trainer
        parallel: bool = True,  # False: one server after the other (for comparison)
        api_client: Any = None,  # Kubernetes API client for a k8s:// Service
    ) -> None:
        self.replicas = _replicas(urls, "EmbeddedSync", api_client)
        self.source, self.parallel = source, parallel
        self._client = client or httpx.Client(timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.last_push_s: dict[str, float] = {}  # seconds each replica took in the last push

    def push(self, export_dir: Any, version: int) -> None:
        version = _check_version(version)
        path = check_export_dir(export_dir)
        if self.source is not None:
            body = {**self.source.fetch_fields(path), "version": version}
        else:
            body = {"path": str(path.resolve()), "version": version}
        self.last_push_s = push_replicas(
            self.replicas.urls(), lambda url: self._push_one(url, body), version, self.parallel
        )

    def _push_one(self, url: str, body: dict[str, Any]) -> None:
        try:
            r = self._client.post(f"{url}/admin/load_weights", json=body, headers=self._headers)
        except httpx.HTTPError as err:
            raise WeightSyncError(f"{url}: load_weights failed: {err}") from err
        if r.status_code == 401:  # every embedded server has a token, given or made
            raise WeightSyncError(
                f"{url}: load_weights answered 401: give the servers' admin token "
                f"(serve.admin_token; a server given none made its own and wrote it to its "
                f"admin_token_file): {r.text[:300]}"
            )
        if r.status_code != 200 or r.json().get("version") != body["version"]:
            raise WeightSyncError(f"{url}: load_weights answered {r.status_code}: {r.text[:500]}")


@dataclass(frozen=True)
class VLLMSyncConfig:
    """vLLM servers started with VLLM_SERVER_DEV_MODE=1 (that enables the endpoints used here)."""

    urls: tuple[str, ...]  # server roots, or one k8s://NAMESPACE/SERVICE:PORT
    timeout_s: float = 600.0  # one reload; big models on slow shared storage take a while
    pause_mode: str = "wait"  # vLLM's /pause: "wait" drains in-flight requests, "abort" drops them
    # Shared storage mounted elsewhere on the servers: (prefix on the learner, prefix on servers).
    path_map: tuple[str, str] | None = None
    # Sent as a bearer token. vLLM's own --api-key guards only /v1/*, not these endpoints (0.32):
    # it matters behind a proxy that checks it.
    api_key: str | None = None

    def __post_init__(self) -> None:
        urls = _replicas(self.urls, "VLLMSyncConfig", None)
        fixed = (f"k8s://{s.namespace}/{s.name}:{s.port}",) if (s := urls.service) else urls.fixed
        object.__setattr__(self, "urls", fixed)
        if self.pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(
                f"VLLMSyncConfig.pause_mode must be wait|abort|keep, got {self.pause_mode!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"VLLMSyncConfig.timeout_s must be > 0, got {self.timeout_s!r}")


class VLLMSync:
    """Reload weights in place from an exported folder through vLLM's documented HTTP endpoints.

    Per server, all at once: `POST /pause?mode=wait` → `POST /collective_rpc` with
    `reload_weights(weights_path)` on every worker (with a `source`: `reload_weights_from_url`,
    the worker extension in harnessrl/serve/weight_fetch.py) → `POST /reset_prefix_cache` (cached
    KV came from the old weights) → `POST /update_weight_version` → `POST /resume` (always, even
    after a failure).
    """

    def __init__(
        self,
        config: VLLMSyncConfig,
        client: httpx.Client | None = None,
        source: ExportServer | None = None,
        parallel: bool = True,
        api_client: Any = None,
    ) -> None:
        self.config = config
        self.replicas = _replicas(config.urls, "VLLMSyncConfig", api_client)
        self.source, self.parallel = source, parallel
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = client or httpx.Client(timeout=config.timeout_s, headers=headers)
        self.last_push_s: dict[str, float] = {}  # per replica: how long the push held it

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
        path = check_export_dir(export_dir)
        if self.source is not None:
            reload = {"method": "reload_weights_from_url", "kwargs": self.source.fetch_fields(path)}
        else:
            reload = {
                "method": "reload_weights",
                "kwargs": {"weights_path": self.server_path(path)},
            }
        self.last_push_s = push_replicas(
            self.replicas.urls(), lambda url: self._push_one(url, reload, version), version,
            self.parallel,
        )  # fmt: skip

    def _push_one(self, url: str, reload: dict[str, Any], version: int) -> None:
        self._post(url, "/pause", params={"mode": self.config.pause_mode})
        try:
            self._reload(url, reload)
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

    def _reload(self, url: str, reload: dict[str, Any]) -> None:
        body = {**reload, "timeout": self.config.timeout_s}
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
