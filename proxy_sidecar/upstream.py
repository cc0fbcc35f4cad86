"""Upstream model servers: sticky routing, ejection, and the one long-lived HTTP client.

In: a rollout id and an encoded request. Out: an `UpstreamResponse` from the first upstream that
answers. A rollout sticks to one server (rendezvous hash of its id) so its growing prompt hits that
server's prefix cache; a server that fails is ejected for `eject_s` and tried again afterwards.
Retries happen only here, i.e. before the first byte is sent to the client.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.discovery.service import ServiceUpstreams, is_service, parse_service
from proxy_sidecar.errors import BadRequest, NoUpstream, UpstreamTimeout

RETRY_STATUSES = frozenset({502, 503, 504})


class UpstreamFailure(Exception):
    """Transport failure talking to one upstream (connect, reset, timeout)."""

    def __init__(self, message: str, *, timeout: bool = False, stale: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.stale = stale  # a pooled keep-alive connection the server had already closed


def _is_stale(err: BaseException) -> bool:
    """A reused connection died under the request: the server closed it while idle (its
    keep-alive ran out). Not a sign of an unhealthy server; a fresh connection will do."""
    if isinstance(err, aiohttp.ClientConnectorError):
        return False  # could not connect at all
    return isinstance(
        err,
        aiohttp.ServerDisconnectedError
        | aiohttp.ClientOSError
        | httpx.RemoteProtocolError
        | httpx.WriteError
        | httpx.ReadError,
    )


def _is_timeout(err: BaseException) -> bool:
    """The upstream went silent for longer than the read (or connect) timeout."""
    return isinstance(err, TimeoutError | httpx.TimeoutException)


@dataclass
class Upstream:
    url: str
    ejected_until: float = 0.0
    failures: int = 0

    def healthy(self, now: float) -> bool:
        return self.ejected_until <= now


class UpstreamResponse:
    """Status, raw headers and body of one upstream response (either client library)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], raw: Any) -> None:
        self.status = status
        self.headers = headers
        self._raw = raw

    async def read(self) -> bytes:
        try:
            if isinstance(self._raw, aiohttp.ClientResponse):
                return await self._raw.read()
            return bytes(await self._raw.aread())
        except (TimeoutError, aiohttp.ClientError, httpx.TransportError) as err:
            raise UpstreamFailure(
                f"reading body: {type(err).__name__}: {err}", timeout=_is_timeout(err)
            ) from err
        finally:
            await self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if isinstance(self._raw, aiohttp.ClientResponse):
                async for chunk in self._raw.content.iter_any():
                    yield chunk
            else:
                async for chunk in self._raw.aiter_raw():
                    yield chunk
        except (TimeoutError, aiohttp.ClientError, httpx.TransportError) as err:
            raise UpstreamFailure(
                f"mid-stream: {type(err).__name__}: {err}", timeout=_is_timeout(err)
            ) from err

    def abort(self) -> None:
        """Drop the upstream connection now (the client went away)."""
        if isinstance(self._raw, aiohttp.ClientResponse):
            self._raw.close()
        else:
            self._closing = asyncio.ensure_future(self._raw.aclose())

    async def close(self) -> None:
        if isinstance(self._raw, aiohttp.ClientResponse):
            self._raw.close()
        else:
            await self._raw.aclose()


class UpstreamPool:
    """The upstream servers of this sidecar and the client that talks to them."""

    def __init__(self, config: SidecarConfig) -> None:
        """Its upstreams, client kind, timeouts, retries and ejection time come from `config`."""
        self.config = config
        fixed = [u.removesuffix("/v1") for u in config.upstreams if not is_service(u)]
        self.upstreams, self._fixed = [Upstream(u) for u in fixed], fixed
        self.services = ServiceUpstreams(
            [parse_service(u) for u in config.upstreams if is_service(u)]
        )
        self._client: Any = None
        self._fresh: Any = None
        self.stale_retries = 0
        # The server's key replaces the harness's own: only this process holds it (k8s/base).
        key = config.upstream_api_key
        self._auth = [("authorization", f"Bearer {key}")] if key else []

    async def start(self) -> None:
        self._client = self._make_client(pooled=True)
        # Used only to retry a request whose pooled connection turned out to be dead: when many
        # pooled connections went stale together, the pool could hand out another dead one.
        self._fresh = self._make_client(pooled=False)
        await self.refresh()

    async def refresh(self) -> None:
        """The Services' replicas as DNS lists them now; known ones keep their ejection state."""
        known = {u.url: u for u in self.upstreams}
        urls = [*self._fixed, *await self.services.urls()]
        if urls:  # a failed lookup keeps the last list rather than leave nothing to call
            self.upstreams = [known.get(u) or Upstream(u) for u in urls]

    def _make_client(self, *, pooled: bool) -> Any:
        cfg = self.config
        if cfg.client == "aiohttp":
            return aiohttp.ClientSession(
                # Idle connections are dropped before common servers' 5 s keep-alive (uvicorn,
                # so vLLM) closes them, which keeps stale-connection races rare.
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
                if pooled
                else aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        return httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s, read=cfg.read_timeout_s, write=60, pool=None
            ),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=1024 if pooled else 0,
                keepalive_expiry=4,
            ),
        )

    async def close(self) -> None:
        for client in (self._client, self._fresh):
            if isinstance(client, aiohttp.ClientSession):
                await client.close()
            elif client is not None:
                await client.aclose()
        self._client = self._fresh = None

    def candidates(self, rollout_id: str) -> list[Upstream]:
        """Upstreams in the order this rollout tries them: healthy first, each by its hash."""
        if len(self.upstreams) == 1:
            return self.upstreams
        key = rollout_id.encode()
        ranked = sorted(self.upstreams, key=lambda u: zlib.crc32(u.url.encode(), zlib.crc32(key)))
        ranked.reverse()
        now = time.monotonic()
        # Ejected ones stay as a last resort: better to try a doubtful server than to fail.
        return [u for u in ranked if u.healthy(now)] + [u for u in ranked if not u.healthy(now)]

    def eject(self, upstream: Upstream) -> None:
        upstream.failures += 1
        upstream.ejected_until = time.monotonic() + self.config.eject_s

    async def request(
        self,
        rollout_id: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
    ) -> tuple[Upstream, UpstreamResponse]:
        """Send to the rollout's upstream, falling over to others; nothing is sent to the client."""
        if self._auth:
            headers = [h for h in headers if h[0].lower() != "authorization"] + self._auth
        if self.services.due():
            await self.refresh()
        last = ""
        timed_out = False
        tries = self.candidates(rollout_id)[: self.config.retries + 1]
        for i, upstream in enumerate(tries):
            try:
                try:
                    resp = await self._send(upstream.url + path, method, headers, body)
                except UpstreamFailure as err:
                    if not err.stale:
                        raise
                    self.stale_retries += 1
                    resp = await self._send(
                        upstream.url + path, method, headers, body, client=self._fresh
                    )
            except UpstreamFailure as err:
                self.eject(upstream)
                last, timed_out = f"{upstream.url}: {err}", err.timeout
                continue
            if resp.status in RETRY_STATUSES and i < len(tries) - 1:
                self.eject(upstream)
                last = f"{upstream.url}: HTTP {resp.status}"
                await resp.close()
                continue
            upstream.failures = 0
            return upstream, resp
        if timed_out:
            raise UpstreamTimeout(f"upstream timed out ({last})")
        raise NoUpstream(f"no upstream answered ({last})")

    async def _send(
        self,
        url: str,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        client: Any = None,
    ) -> UpstreamResponse:
        client = client or self._client
        if client is None:
            raise UpstreamFailure("client not started")
        try:
            if isinstance(client, aiohttp.ClientSession):
                raw = await client.request(method, url, data=body, headers=headers)
                return UpstreamResponse(raw.status, list(raw.raw_headers), raw)
            req = client.build_request(method, url, content=body, headers=headers)
            resp = await client.send(req, stream=True)
            return UpstreamResponse(resp.status_code, list(resp.headers.raw), resp)
        except (ValueError, TypeError, UnicodeError) as err:
            # The client libraries refuse some header values that HTTP servers accept.
            raise BadRequest(f"request cannot be forwarded: {err}") from err
        except (TimeoutError, aiohttp.ClientError, httpx.TransportError, OSError) as err:
            raise UpstreamFailure(
                f"{type(err).__name__}: {err}", timeout=_is_timeout(err), stale=_is_stale(err)
            ) from err
