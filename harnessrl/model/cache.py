"""Model stage, shared: the serving KV cache every attention layer writes, slot by slot.

In: a config's layer count, KV heads and head width, a slot count and a length. Out: `KVCache`,
which a family's `decode` reads and returns updated (the contract is in
`harnessrl.model.families.dense.decoder`'s docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp


class AttentionShape(Protocol):
    """What a KV cache reads of a config."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def compute_jnp_dtype(self) -> Any: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values of every serving slot: `[layers, slots, max_len, kv_heads, head_dim]`."""

    k_lbske: jax.Array
    v_lbske: jax.Array

    @classmethod
    def create(cls, cfg: AttentionShape, slots: int, max_len: int) -> KVCache:
        if slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs slots > 0 and max_len > 0, got {slots=}, {max_len=}")
        shape = (cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        # Two buffers, not one shared: a donated cache may not donate the same buffer twice.
        return cls(
            k_lbske=jnp.zeros(shape, cfg.compute_jnp_dtype),
            v_lbske=jnp.zeros(shape, cfg.compute_jnp_dtype),
        )

    @property
    def max_len(self) -> int:
        return self.k_lbske.shape[2]

    @property
    def slots(self) -> int:
        return self.k_lbske.shape[1]

    def check_step(self, rows: int, slot: object, length: int) -> None:
        """Reject a `Decoder.decode` call whose batch, slot or length does not fit this cache."""
        if slot is None and rows != self.slots:
            raise ValueError(
                f"tokens have {rows} rows but the cache has {self.slots} slots; pass rows == "
                "slots, or one row with slot=<its cache slot>"
            )
        if slot is not None and rows != 1:
            raise ValueError(f"decode with slot={slot!r} takes one row, got {rows} rows")
        if not isinstance(length, int) or not 0 < length <= self.max_len:
            raise ValueError(
                f"decode length={length!r} must be a static int in 1..{self.max_len} "
                "(the cache's max_len)"
            )
