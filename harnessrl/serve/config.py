"""Serving stage config: one frozen dataclass; the defaults are the embedded CPU run."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

from harnessrl.http.listener import HttpLimits
from harnessrl.traces.schema import policy_version_error


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# Fields that must be integers >= 1 (the per-request and in-flight limits)
POSITIVE: tuple[str, ...] = ("max_n", "max_request_tokens", "max_prompt_chars", "max_body_bytes")
POSITIVE += ("max_buffered_bytes",)


@dataclass(frozen=True)
class ServeConfig:
    """Everything the embedded server needs; validated on construction.

    The engine compiles one prefill step per entry of `prefill_buckets` (a chunk of that many
    prompt tokens), one decode step (`num_slots` rows) per decode length, a first-token sampler
    and a slot copy: these fields fix the compile count.
    """

    model: str = "smollm2"  # smollm2 | HF folder | .gguf path | a random-weights spec (model.registry.RANDOM_SPECS)
    served_model_name: str = ""  # empty: the `model` spec
    host: str = "127.0.0.1"  # interface to bind; off loopback an admin token is required
    port: int = 8000  # 0 picks a free one (embedded server only)
    num_slots: int = 8  # KV-cache rows: requests decoded together
    max_model_len: int = 2048  # longest prompt + completion in tokens
    prefill_buckets: tuple[int, ...] = (16, 64, 128, 256)  # prompt chunk sizes compiled for prefill
    # Cache lengths a decode step attends over (the smallest that covers every live sequence);
    # empty: powers of two from 128, then max_model_len.
    decode_buckets: tuple[int, ...] = ()
    max_waiting: int = 1024  # queued sequences beyond the slots; more get 503 + Retry-After
    max_n: int = 64  # choices per request
    max_request_tokens: int = 65536  # n x max_tokens (unset max_tokens: the room left)
    max_prompt_chars: int = 1 << 20  # prompt or message text, checked before tokenizing
    max_body_bytes: int = 16 << 20  # request body; larger gets 413
    # Request bodies held at once by every request in flight, counted as their bytes arrive;
    # a body that would pass it gets 503 + Retry-After
    max_buffered_bytes: int = 64 << 20
    max_header_bytes: int = 64 << 10  # request line + headers; larger gets 431
    read_timeout_s: float = 30.0  # deadline of a request's headers, longest pause in its body
    body_timeout_s: float = 60.0  # deadline of a whole request body; later gets 408
    # /admin/* bearer token (or HARNESSRL_ADMIN_TOKEN); needed off loopback. Empty: the server
    # makes one and hands it to whoever started it (in-process: the handle's admin_token)
    admin_token: str = field(default="", repr=False)
    # Where a server given no admin_token writes the one it makes (mode 0600); the CLI, when
    # empty, writes it to a new private temporary file and prints that file's path
    admin_token_file: str = ""
    seed: int = 0  # base of the keys of requests without a seed
    policy_version: int = 0  # version reported before the first swap
    # float32: logprobs exactly the learner's. bfloat16: weights rounded to bf16 (arithmetic stays
    # float32), so a decode step reads half the bytes; logprobs then differ by that rounding.
    weight_dtype: str = "float32"
    # Decode steps' matmuls and attention through C++ kernels built on first use (x86-64 CPU,
    # num_slots <= 32, float32 compute, a C++ compiler); elsewhere, or off, XLA's ops. Same float32
    # arithmetic up to summation order.
    cpu_kernels: bool = True
    # A prompt that starts with what a free slot still holds (a finished sequence's prompt and
    # tokens, kept until the slot is reused or the weights change) prefills only the rest: a
    # shared system prompt, or an agent turn that resends its history.
    prefix_caching: bool = True
    # Held tokens a packed prefill can resume after (a shared system prompt): every packed call
    # reads these first indices of every slot, num_slots x prefix_window more keys per token
    # (up to the largest prefill bucket: a held prefix that long or longer resumes whole,
    # through chunks of its own).
    prefix_window: int = 32
    warmup: bool = True  # compile every serving program before accepting requests
    log_level: str = "warning"  # uvicorn log level

    def __post_init__(self) -> None:
        for name in ("port", "num_slots", "max_model_len", "max_waiting", "prefix_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ServeConfig.{name} must be a non-negative integer, got {value!r}"
                )
        for name in POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeConfig.{name} must be a positive integer, got {value!r}")
        try:
            HttpLimits(self.max_header_bytes, self.read_timeout_s)
        except ValueError as err:
            raise ValueError(f"ServeConfig.{err}") from err
        self._check_bodies()
        self._check_admin()
        if self.weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"ServeConfig.weight_dtype must be 'float32' or 'bfloat16', got {self.weight_dtype!r}"
            )
        if self.num_slots < 1 or self.max_model_len < 2:
            raise ValueError(
                f"ServeConfig needs num_slots >= 1 and max_model_len >= 2, got "
                f"num_slots={self.num_slots}, max_model_len={self.max_model_len}"
            )
        for name in ("prefill_buckets", "decode_buckets"):
            self._check_buckets(name, allow_empty=name == "decode_buckets")
        if self.decode_buckets and self.decode_buckets[-1] != self.max_model_len:
            raise ValueError(
                f"ServeConfig.decode_buckets must end at max_model_len={self.max_model_len}, got "
                f"{self.decode_buckets!r}"
            )
        if error := policy_version_error(self.policy_version):
            raise ValueError(f"ServeConfig.policy_version {error}")

    def _check_bodies(self) -> None:
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"ServeConfig.max_buffered_bytes={self.max_buffered_bytes} is below "
                f"max_body_bytes={self.max_body_bytes}: a body at the limit could never be read"
            )
        t = self.body_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"ServeConfig.body_timeout_s must be a finite number > 0, got {t!r}")

    def _check_admin(self) -> None:
        for name in ("admin_token", "admin_token_file"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"ServeConfig.{name} must be a string, got {type(value).__name__}")
        if not self.admin_token and not is_loopback(self.host):
            raise ValueError(
                f"ServeConfig.host={self.host!r} is not loopback: set admin_token (--admin-token "
                "or HARNESSRL_ADMIN_TOKEN) so /admin/load_weights is protected, or bind 127.0.0.1"
            )

    def _check_buckets(self, name: str, allow_empty: bool) -> None:
        buckets = getattr(self, name)
        if allow_empty and buckets == ():
            return
        if (
            not isinstance(buckets, tuple)
            or not buckets
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
        ):
            raise ValueError(
                f"ServeConfig.{name} must be a strictly increasing tuple of positive integers, "
                f"got {buckets!r}"
            )
        if buckets[-1] > self.max_model_len:
            raise ValueError(
                f"ServeConfig.{name}[-1]={buckets[-1]} exceeds max_model_len={self.max_model_len}"
            )

    @property
    def decode_lengths(self) -> tuple[int, ...]:
        if self.decode_buckets:
            return self.decode_buckets
        powers = [1 << p for p in range(7, 30) if (1 << p) < self.max_model_len]
        return (*powers, self.max_model_len)

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_header_bytes=self.max_header_bytes, read_timeout_s=self.read_timeout_s
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
