"""Serving stage config: one frozen dataclass; the defaults are the embedded CPU run."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServeConfig:
    """Everything the embedded server needs; validated on construction.

    The engine compiles one prefill step per entry of `prefill_buckets` (a chunk of that many
    prompt tokens), one decode step (`num_slots` rows) per decode length, a first-token sampler
    and a slot copy: these fields fix the compile count.
    """

    model: str = "smollm2"
    served_model_name: str = ""  # empty: the `model` spec
    host: str = "127.0.0.1"
    port: int = 8000
    num_slots: int = 8
    max_model_len: int = 2048
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    # Cache lengths a decode step attends over (the smallest that covers every live sequence);
    # empty: powers of two from 128, then max_model_len.
    decode_buckets: tuple[int, ...] = ()
    max_waiting: int = 1024  # queued requests beyond the slots; more get 503
    seed: int = 0  # base of the keys of requests without a seed
    policy_version: int = 0
    warmup: bool = True
    log_level: str = "warning"

    def __post_init__(self) -> None:
        for name in ("port", "num_slots", "max_model_len", "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ServeConfig.{name} must be a non-negative integer, got {value!r}"
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
        if not isinstance(self.policy_version, int) or isinstance(self.policy_version, bool):
            raise ValueError(
                f"ServeConfig.policy_version must be an integer, got {self.policy_version!r}"
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
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
