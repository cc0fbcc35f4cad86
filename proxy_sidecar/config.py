"""Sidecar configuration: one frozen dataclass, from the command line or the train config.

In: `python -m proxy_sidecar` arguments (the control token may also come from
HARNESSRL_CONTROL_TOKEN, the default rollout from HARNESSRL_ROLLOUT_ID), or the train config's
`sidecar` section. Out: `SidecarConfig`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from harnessrl.cli import command_line, fail
from harnessrl.traces.schema import policy_version_error

MODES = ("train", "eval")
CLIENTS = ("aiohttp", "httpx")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
TOKEN_IN_CHAT = "--token-in-chat needs --tokenizer: the model spec the server loads, e.g. smollm2"


@dataclass(frozen=True)
class SidecarConfig:
    """The capture sidecar: where calls go and are recorded, its limits and timeouts."""

    upstreams: tuple[str, ...] = ("http://127.0.0.1:8000",)  # model server URL(s), comma-separated
    store: str = "sqlite:///runs/traces.db"  # trace store: sqlite:///PATH or postgresql://...
    host: str = "127.0.0.1"  # interface to bind; off loopback a control token is required
    port: int = 8100  # 0: a free port
    # Bearer token of the control and rollout API (or HARNESSRL_CONTROL_TOKEN)
    control_token: str | None = field(default=None, repr=False)
    default_rollout: str = "default"  # rollout id of plain /v1/... calls (or HARNESSRL_ROLLOUT_ID)
    # Bearer key sent upstream in place of the harness's own (or HARNESSRL_UPSTREAM_API_KEY)
    upstream_api_key: str | None = field(default=None, repr=False)
    mode: str = "train"  # train | eval: which sampling overrides apply
    model: str | None = None  # rewrite the request's model name (the served alias); none: keep it
    # token-in mode's tokenizer and chat template: tiny, smollm2, an HF folder or a .gguf
    # (docs/dialects.md); none: /v1/responses and /v1/messages are off
    tokenizer: str | None = None
    token_in_chat: bool = False  # /v1/chat/completions in token-in mode too (needs tokenizer)
    train_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {"temperature": 1.0}
    # The held-out eval's overrides: greedy by default, so two evals of the same weights agree
    eval_overrides: dict[str, Any] = field(default_factory=lambda: {"temperature": 0})
    policy_version: int | None = None  # recorded on every call until /control sets another
    max_body_bytes: int = 16 * 1024 * 1024  # largest request body; larger gets 413
    # All request bodies in flight together; past it, 503. The parsed copies weigh more than the
    # bytes: at 32 MiB the peak RSS measured 226 MiB (long texts) to 554 MiB (many short messages)
    max_buffered_bytes: int = 32 * 1024 * 1024
    # The longest a whole request body may take to arrive; past it, 408 (its bytes are let go)
    body_timeout_s: float = 60.0
    pause_timeout_s: float = 600.0  # how long a new call waits while paused before a 503
    connect_timeout_s: float = 5.0  # to reach an upstream
    read_timeout_s: float = 600.0  # longest silence from an upstream inside one response
    retries: int = 2  # extra upstreams tried before the first byte reaches the client
    eject_s: float = 10.0  # an upstream that failed is skipped this long, then retried
    client: str = "aiohttp"  # aiohttp | httpx upstream client
    fsync: bool = False  # SQLite synchronous=FULL: survive power loss, not only process death
    batch_max: int = 256  # most calls per store commit
    # One log line per call (the train loop's own sidecar turns it off); refused calls log anyway
    log_calls: bool = True

    def __post_init__(self) -> None:
        # Frozen, so normalized in place once: `http://a:1/, http://b:2` → two bare URLs.
        urls = tuple(u.strip().rstrip("/") for u in self.upstreams if u.strip())
        object.__setattr__(self, "upstreams", urls)
        if not self.upstreams:
            raise ValueError("upstreams must name at least one URL, e.g. http://127.0.0.1:8000")
        for url in self.upstreams:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https", "k8s") or not parts.netloc:
                raise ValueError(f"upstream {url!r}: http(s)://HOST:PORT, or k8s://NS/SERVICE:PORT")
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
        timeouts = ("body_timeout_s", "pause_timeout_s", "connect_timeout_s", "read_timeout_s")
        for name in (*timeouts, "eject_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        error = None if self.policy_version is None else policy_version_error(self.policy_version)
        if error:
            raise ValueError(f"policy_version {error}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.host not in LOOPBACK_HOSTS and not self.control_token:
            raise ValueError(
                f"host {self.host!r} is not loopback: set --control-token (or "
                "HARNESSRL_CONTROL_TOKEN) so control and reward endpoints are protected"
            )

    def overrides(self, mode: str) -> dict[str, Any]:
        return self.train_overrides if mode == "train" else self.eval_overrides


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> SidecarConfig:
    """`--upstream URL[,URL]` and any other field as `--field value`; exits on a bad one."""
    config: SidecarConfig = command_line(
        SidecarConfig(),
        sys.argv[1:] if argv is None else argv,
        prog="python -m proxy_sidecar",
        doc=SidecarConfig.__doc__ or "",
        aliases={"upstream": ("upstreams",)},
        env=os.environ if env is None else env,
        env_keys={
            "control_token": "HARNESSRL_CONTROL_TOKEN",
            "default_rollout": "HARNESSRL_ROLLOUT_ID",
            "upstream_api_key": "HARNESSRL_UPSTREAM_API_KEY",
        },
        required=("upstreams",),
    )
    if config.token_in_chat and config.tokenizer is None:
        fail("python -m proxy_sidecar", TOKEN_IN_CHAT)
    return config
