"""Model stage: the Qwen3.5 serving cache, a KV cache for the attention layers beside a per-slot
recurrent state (the conv window and the delta-rule state) for the Gated DeltaNet layers.

In: the config, slot count and length. Out: `HybridCache`, which `Qwen35Decoder.decode` reads and
returns updated, under the contract of `harnessrl.model.cache.KVCache` (slot s is row s of
every array; position -1 pads). A DeltaNet layer's state is that of the last position written to
the slot: a call continues it, position 0 starts it afresh, padding leaves it unchanged. Unlike
KV entries it cannot be rewound, so a slot's positions must arrive in order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from harnessrl.model.cache import KVCache
from harnessrl.model.families.qwen3_5.config import Qwen35Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """`kv` over the attention layers; per DeltaNet layer and slot, the last `conv_width - 1`
    conv inputs `[layers, slots, w - 1, channels]` and the state `[layers, slots, h, k, v]`."""

    kv: KVCache
    conv_lbwf: jax.Array
    state_lbhkv: jax.Array

    @classmethod
    def create(cls, cfg: Qwen35Config, slots: int, max_len: int) -> HybridCache:
        if slots <= 0 or max_len <= 0:
            raise ValueError(f"cache needs slots > 0 and max_len > 0, got {slots=}, {max_len=}")
        kv_shape = (cfg.num_groups, slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        n, ct = cfg.num_linear_layers, cfg.compute_jnp_dtype
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )
        return cls(
            kv=KVCache(k_lbske=jnp.zeros(kv_shape, ct), v_lbske=jnp.zeros(kv_shape, ct)),
            conv_lbwf=jnp.zeros((n, slots, cfg.linear_conv_kernel_dim - 1, channels), ct),
            # The delta-rule state stays float32 whatever the compute dtype: it sums every token.
            state_lbhkv=jnp.zeros(
                (
                    n,
                    slots,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                ),
                jnp.float32,
            ),
        )

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def slots(self) -> int:
        return self.kv.slots

    def check_step(self, rows: int, slot: object, length: int) -> None:
        self.kv.check_step(rows, slot, length)
