"""Sidecar configuration: one frozen dataclass, built from the command line.

In: `python -m proxy_sidecar` arguments (the control token may also come from
HARNESSRL_CONTROL_TOKEN, the default rollout from HARNESSRL_ROLLOUT_ID). Out: `SidecarConfig`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from harnessrl.traces.schema import MAX_POLICY_VERSION

MODES = ("train", "eval")
CLIENTS = ("aiohttp", "httpx")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class SidecarConfig:
    upstreams: tuple[str, ...] = ("http://127.0.0.1:8000",)
    store: str = "sqlite:///runs/traces.db"
    host: str = "127.0.0.1"
    port: int = 8100
    control_token: str | None = None
    default_rollout: str = "default"
    mode: str = "train"  # selects which sampling overrides apply
    model: str | None = None  # rewrite the request's model name (the served alias)
    train_overrides: dict[str, Any] = field(default_factory=dict)
    eval_overrides: dict[str, Any] = field(default_factory=dict)
    policy_version: int | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    # All request bodies in flight together; peak memory is about 3.5x this (parsed and encoded
    # copies) on top of ~50 MB, within the 256Mi of an injected sidecar.
    max_buffered_bytes: int = 32 * 1024 * 1024
    pause_timeout_s: float = 600.0  # how long a new call waits while paused before a 503
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence from an upstream inside one response
    retries: int = 2  # extra upstreams tried before the first byte reaches the client
    eject_s: float = 10.0  # an upstream that failed is skipped this long, then retried
    client: str = "aiohttp"
    fsync: bool = False  # SQLite synchronous=FULL: survive power loss, not only process death
    batch_max: int = 256  # most calls per store commit
    log_calls: bool = True

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("upstreams must name at least one URL, e.g. http://127.0.0.1:8000")
        for url in self.upstreams:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"upstream {url!r} must be an http(s)://HOST:PORT URL")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {CLIENTS}, got {self.client!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {self.port!r}")
        if not self.default_rollout or "/" in self.default_rollout:
            raise ValueError(
                f"default_rollout must be a non-empty id without '/', got {self.default_rollout!r}"
            )
        for name in ("max_body_bytes", "max_buffered_bytes", "batch_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}), or a request of the allowed size could never be served"
            )
        for name in ("pause_timeout_s", "connect_timeout_s", "read_timeout_s", "eject_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.policy_version is not None and policy_version_error(self.policy_version):
            raise ValueError(f"policy_version {policy_version_error(self.policy_version)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.host not in LOOPBACK_HOSTS and not self.control_token:
            raise ValueError(
                f"host {self.host!r} is not loopback: set --control-token (or "
                "HARNESSRL_CONTROL_TOKEN) so control and reward endpoints are protected"
            )

    def overrides(self, mode: str) -> dict[str, Any]:
        return self.train_overrides if mode == "train" else self.eval_overrides


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def policy_version_error(value: object) -> str | None:
    """Why `value` cannot be a policy version, or None if it can.

    The trace stores keep versions as 64-bit integers: a larger one could not be recorded, and
    every call stamped with it would fail to store.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, got {value!r}"
    if not 0 <= value <= MAX_POLICY_VERSION:
        return f"must be in [0, 2**63 - 1], got {value}"
    return None


def _policy_version(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from err
    error = policy_version_error(value)
    if error:
        raise argparse.ArgumentTypeError(error)
    return value


def build_parser() -> argparse.ArgumentParser:
    d = SidecarConfig()
    p = argparse.ArgumentParser(prog="python -m proxy_sidecar", description=__doc__)
    p.add_argument("--upstream", required=True, help="model server URL(s), comma-separated")
    p.add_argument("--store", default=d.store, help="sqlite:///PATH or postgresql://...")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--control-token", default=None, help="bearer token for control/rollout API")
    p.add_argument("--default-rollout", default=None, help="rollout id of plain /v1/... calls")
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--model", default=None, help="model name sent upstream")
    p.add_argument(
        "--train-overrides", type=_json_object, default={}, help='JSON, e.g. {"temperature": 1.0}'
    )
    p.add_argument(
        "--eval-overrides", type=_json_object, default={}, help='JSON, e.g. {"temperature": 0}'
    )
    p.add_argument("--policy-version", type=_policy_version, default=None)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=d.max_buffered_bytes,
        help="request body bytes all calls in flight may hold together; past it, 503",
    )
    p.add_argument("--pause-timeout-s", type=float, default=d.pause_timeout_s)
    p.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s)
    p.add_argument("--retries", type=int, default=d.retries)
    p.add_argument("--eject-s", type=float, default=d.eject_s)
    p.add_argument("--client", choices=CLIENTS, default=d.client)
    p.add_argument("--fsync", action="store_true", help="fsync every SQLite commit")
    p.add_argument("--batch-max", type=int, default=d.batch_max)
    p.add_argument("--no-call-log", action="store_true", help="no per-call log line")
    return p


def parse_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> SidecarConfig:
    env = dict(os.environ) if env is None else env
    a = build_parser().parse_args(argv)
    return SidecarConfig(
        upstreams=tuple(u.strip().rstrip("/") for u in a.upstream.split(",") if u.strip()),
        store=a.store,
        host=a.host,
        port=a.port,
        control_token=a.control_token or env.get("HARNESSRL_CONTROL_TOKEN") or None,
        default_rollout=a.default_rollout or env.get("HARNESSRL_ROLLOUT_ID") or "default",
        mode=a.mode,
        model=a.model,
        train_overrides=a.train_overrides,
        eval_overrides=a.eval_overrides,
        policy_version=a.policy_version,
        max_body_bytes=a.max_body_bytes,
        max_buffered_bytes=a.max_buffered_bytes,
        pause_timeout_s=a.pause_timeout_s,
        connect_timeout_s=a.connect_timeout_s,
        read_timeout_s=a.read_timeout_s,
        retries=a.retries,
        eject_s=a.eject_s,
        client=a.client,
        fsync=a.fsync,
        batch_max=a.batch_max,
        log_calls=not a.no_call_log,
    )
