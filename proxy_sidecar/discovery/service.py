"""A Service's replicas as explicit upstream URLs, so each call knows which replica served it.

In: `k8s://NAMESPACE/SERVICE:PORT` (a headless Service: its DNS name has one A record per ready
pod). Out: `http://POD_IP:PORT` for each, looked up again every `refresh_s` while the pool runs.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

SCHEME = "k8s://"
FORM = "k8s://NAMESPACE/SERVICE:PORT (e.g. k8s://harnessrl/vllm:8000)"
# (host, port) -> the addresses DNS gives for it; injectable so tests need no cluster DNS.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    port: int

    @property
    def dns_name(self) -> str:
        """The Service's in-cluster name; for a headless Service it lists every ready pod."""
        return f"{self.name}.{self.namespace}.svc"

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address  # IPv6 pod addresses
        return f"http://{host}:{self.port}"


def is_service(text: str) -> bool:
    return text.strip().startswith(SCHEME)


def parse_service(text: str) -> Service:
    """`k8s://NAMESPACE/SERVICE:PORT` → Service; ValueError naming the expected form."""
    rest = text.strip().removeprefix(SCHEME).rstrip("/")
    namespace, _, name_port = rest.partition("/")
    name, _, port = name_port.partition(":")
    if not (is_service(text) and namespace and name and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"a Kubernetes Service upstream must read {FORM}, got {text!r}")
    return Service(namespace, name, int(port))


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of `host` (an unknown name: none, the Service has no ready pod yet)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos})


class ServiceUpstreams:
    """The replica URLs of `services`, looked up at most every `refresh_s` seconds."""

    def __init__(
        self, services: list[Service], refresh_s: float = 10.0, resolve: Resolver = resolve_dns
    ) -> None:
        self.services = services
        self.refresh_s = refresh_s
        self._resolve = resolve
        self._due = 0.0  # loop time of the next lookup

    def due(self) -> bool:
        return bool(self.services) and asyncio.get_running_loop().time() >= self._due

    async def urls(self) -> list[str]:
        """The replicas now (a Service that has none adds none), in a stable order."""
        self._due = asyncio.get_running_loop().time() + self.refresh_s
        found = await asyncio.gather(*(self._resolve(s.dns_name, s.port) for s in self.services))
        pairs = zip(self.services, found, strict=True)
        return sorted({s.url(a) for s, addresses in pairs for a in addresses})
