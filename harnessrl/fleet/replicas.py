"""Which inference servers a weight push must reach: a fixed URL list, or a Kubernetes Service.

In: `rollout.servers`: `http://a:8000,http://b:8000`, or `k8s://NAMESPACE/SERVICE:PORT`. Out: the
replica URLs now, `http://POD_IP:PORT` for each ready endpoint of the Service (its EndpointSlices),
looked up again at every push, so a replica that came up since the last push is updated too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy_sidecar.discovery.service import Service, is_service, parse_service

SERVICE_LABEL = "kubernetes.io/service-name"  # set by Kubernetes on a Service's EndpointSlices


def server_urls(urls: Sequence[str] | str, what: str) -> tuple[str, ...]:
    """http(s) server roots from a list or a comma-separated string, normalized."""
    items = tuple(
        u.strip().rstrip("/").removesuffix("/v1")
        for u in (urls.split(",") if isinstance(urls, str) else urls)
        if u.strip()
    )
    if not items or not all(u.startswith(("http://", "https://")) for u in items):
        raise ValueError(
            f"{what} must be http(s) server roots or k8s://NAMESPACE/SERVICE:PORT, got {urls!r}"
        )
    return items


def ready_addresses(slices: list[dict[str, Any]]) -> list[str]:
    """Addresses of the endpoints that may serve, one per endpoint: Kubernetes says a missing
    `ready` condition means ready; terminating endpoints are not ready."""
    found = set()
    for piece in slices:
        if piece.get("addressType") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no pod
        for endpoint in piece.get("endpoints") or []:
            ready = (endpoint.get("conditions") or {}).get("ready")
            addresses = endpoint.get("addresses") or []
            if ready is not False and addresses:
                found.add(str(addresses[0]))  # the others are the same pod's
    return sorted(found)


class Replicas:
    """The servers of `rollout.servers`, resolved again on every `urls()` call."""

    def __init__(
        self, servers: str, api_client: Any = None, request_timeout_s: float = 30.0
    ) -> None:
        text = servers.strip()
        self.service: Service | None = parse_service(text) if is_service(text) else None
        self.fixed = () if self.service else server_urls(text, "rollout.servers")
        self._api_client = api_client
        self.request_timeout_s = request_timeout_s

    def urls(self) -> tuple[str, ...]:
        """Every replica now; a Service without a ready endpoint is an error (nothing to push to,
        and no server to answer the next round's calls)."""
        if self.service is None:
            return self.fixed
        addresses = ready_addresses(self._slices(self.service))
        if not addresses:
            raise RuntimeError(
                f"Service {self.service.namespace}/{self.service.name} has no ready endpoint: "
                f"`kubectl -n {self.service.namespace} get endpointslices -l "
                f"{SERVICE_LABEL}={self.service.name}` shows its replicas and their readiness"
            )
        return tuple(self.service.url(a) for a in addresses)

    def _slices(self, service: Service) -> list[dict[str, Any]]:
        from kubernetes import client

        from harnessrl.pods.k8s_api import default_api_client, with_retries

        if self._api_client is None:
            self._api_client = default_api_client()
        api: Any = client.DiscoveryV1Api(self._api_client)
        resp = with_retries(
            lambda: api.list_namespaced_endpoint_slice(
                service.namespace,
                label_selector=f"{SERVICE_LABEL}={service.name}",
                _preload_content=False,  # raw JSON: no model objects for a few addresses
                _request_timeout=self.request_timeout_s,
            )
        )
        return list(json.loads(resp.data).get("items") or [])
