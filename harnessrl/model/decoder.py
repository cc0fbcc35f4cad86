"""Model stage: the Flax NNX decoder (Llama / SmolLM2, Qwen2, Qwen3 dense) and its KV cache.

In: token ids, positions and segment ids `[b, t]` (training), or ids and positions plus a
`KVCache` (serving). Out: float32 logits `[b, t, vocab]` (and the updated cache).

Training / scoring:  `logits_btv = model(tokens_bt, positions_bt, segment_ids_bt)`
  Packed rows: a token attends to earlier tokens (in row order) of its own segment only; positions
  restart at 0 per segment and drive RoPE; segment id 0 marks padding (its logits are garbage).

Serving:  `logits_btv, cache = model.decode(tokens_bt, positions_bt, cache)`
  `cache = KVCache.create(cfg, slots=B, max_len=S)`: row b of the cache is serving slot b and
  cache index s holds the keys/values of the token at position s of the sequence in that slot.
  A call writes the K/V of `tokens_bt[b, i]` at index `positions_bt[b, i]` of row b, then each
  query attends to the row's cache entries at indices <= its own position. Rows are independent:
  one call can prefill one slot (t = prompt chunk) while other rows decode or idle. Pad a row, or
  the tail of a chunk, with position -1: nothing is written and its logits are to be ignored.
  Positions of a slot must be written contiguously from 0 before they are attended to; a slot is
  reused without clearing, because a new sequence overwrites every index it reads.

Layers are stacked (`layers` leading axis) and run with `jax.lax.scan`, so compile time does not
grow with depth; call the model under `nnx.jit` (an eager call re-traces the scan every time). Every parameter carries logical axis names; `harnessrl/learner/mesh.py` maps
them onto a mesh. Created under `jax.set_mesh(mesh)` the parameters are sharded eagerly;
created without a mesh they are plain arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd

from harnessrl.learner.mesh import LOGICAL_AXIS_RULES, logical_to_spec
from harnessrl.model import attention as attn
from harnessrl.model.config import ModelConfig

INIT_STDDEV = 0.02  # HF initializer_range for these families


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values of every serving slot: `[layers, slots, max_len, kv_heads, head_dim]`."""

    k_lbske: jax.Array
    v_lbske: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, slots: int, max_len: int) -> KVCache:
        if slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs slots > 0 and max_len > 0, got {slots=}, {max_len=}")
        shape = (cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.compute_jnp_dtype)
        return cls(k_lbske=zeros, v_lbske=zeros)

    @property
    def max_len(self) -> int:
        return self.k_lbske.shape[2]


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """Logical sharding constraint on an activation; a no-op when no mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical)
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def param_sharding() -> Iterator[None]:
    """Shard new params eagerly under a mesh (with the project's rules); plain arrays without."""
    if jax.sharding.get_abstract_mesh().empty:
        with nnx.use_eager_sharding(False):
            yield
    elif core_spmd.get_logical_axis_rules():
        yield
    else:
        with core_spmd.logical_axis_rules(LOGICAL_AXIS_RULES):
            yield


def _param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: object, init: str
) -> nnx.Param:
    initializer = {
        "normal": nnx.initializers.normal(INIT_STDDEV),
        "ones": nnx.initializers.ones,
        "zeros": nnx.initializers.zeros,
    }[init]
    return nnx.Param(nnx.with_partitioning(initializer, axes)(rngs.params(), shape, dtype))


class DecoderLayers(nnx.Module):
    """All transformer blocks, weights stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        n, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        h, k, e, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_jnp_dtype
        self.attn_norm_ld = _param(rngs, (n, d), ("layers", "embed"), dt, "ones")
        self.wq_ldhe = _param(
            rngs, (n, d, h, e), ("layers", "embed", "heads", "head_dim"), dt, "normal"
        )
        self.wk_ldke = _param(
            rngs, (n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), dt, "normal"
        )
        self.wv_ldke = _param(
            rngs, (n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), dt, "normal"
        )
        self.wo_lhed = _param(
            rngs, (n, h, e, d), ("layers", "heads", "head_dim", "embed"), dt, "normal"
        )
        # Family extras exist only when used, so the param tree matches the checkpoint's tensors.
        if cfg.qkv_bias:  # Qwen2
            self.bq_lhe = _param(rngs, (n, h, e), ("layers", "heads", "head_dim"), dt, "zeros")
            self.bk_lke = _param(rngs, (n, k, e), ("layers", "kv_heads", "head_dim"), dt, "zeros")
            self.bv_lke = _param(rngs, (n, k, e), ("layers", "kv_heads", "head_dim"), dt, "zeros")
        if cfg.qk_norm:  # Qwen3
            self.q_norm_le = _param(rngs, (n, e), ("layers", "head_dim"), dt, "ones")
            self.k_norm_le = _param(rngs, (n, e), ("layers", "head_dim"), dt, "ones")
        self.mlp_norm_ld = _param(rngs, (n, d), ("layers", "embed"), dt, "ones")
        self.w_gate_ldf = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, "normal")
        self.w_up_ldf = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, "normal")
        self.w_down_lfd = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), dt, "normal")

    def stacked(self) -> dict[str, jax.Array]:
        """The present weights as plain arrays, ready to be scanned over the layers axis."""
        return {
            name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)
        }


def qkv(
    cfg: ModelConfig,
    w: dict[str, jax.Array],
    x_btd: jax.Array,
    cos_bte: jax.Array,
    sin_bte: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Project one layer's normalized input to RoPE'd queries and keys, and values."""
    ct = cfg.compute_jnp_dtype
    q_bthe = jnp.einsum("btd,dhe->bthe", x_btd, w["wq_ldhe"].astype(ct))
    k_btke = jnp.einsum("btd,dke->btke", x_btd, w["wk_ldke"].astype(ct))
    v_btke = jnp.einsum("btd,dke->btke", x_btd, w["wv_ldke"].astype(ct))
    if cfg.qkv_bias:
        q_bthe = q_bthe + w["bq_lhe"].astype(ct)
        k_btke = k_btke + w["bk_lke"].astype(ct)
        v_btke = v_btke + w["bv_lke"].astype(ct)
    if cfg.qk_norm:
        q_bthe = attn.rms_norm(q_bthe, w["q_norm_le"], cfg.rms_norm_eps).astype(ct)
        k_btke = attn.rms_norm(k_btke, w["k_norm_le"], cfg.rms_norm_eps).astype(ct)
    q_bthe = attn.apply_rope(q_bthe, cos_bte, sin_bte)
    k_btke = attn.apply_rope(k_btke, cos_bte, sin_bte)
    return q_bthe, k_btke, v_btke


def block_tail(
    cfg: ModelConfig, w: dict[str, jax.Array], x_btd: jax.Array, o_bthe: jax.Array
) -> jax.Array:
    """Attention output projection + residual, then the SwiGLU MLP + residual."""
    ct = cfg.compute_jnp_dtype
    x_btd = x_btd + jnp.einsum("bthe,hed->btd", o_bthe, w["wo_lhed"].astype(ct))
    x_btd = constrain(x_btd, ("batch", "length", "embed"))
    h_btd = attn.rms_norm(x_btd, w["mlp_norm_ld"], cfg.rms_norm_eps).astype(ct)
    mlp_btd = attn.swiglu(
        h_btd, w["w_gate_ldf"].astype(ct), w["w_up_ldf"].astype(ct), w["w_down_lfd"].astype(ct)
    )
    return constrain(x_btd + mlp_btd, ("batch", "length", "embed"))


class Decoder(nnx.Module):
    """Token embedding → N × (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU) → RMSNorm → logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        v, d, dt = cfg.vocab_size, cfg.hidden_size, cfg.param_jnp_dtype
        with param_sharding():
            self.embed_vd = _param(rngs, (v, d), ("vocab", "embed"), dt, "normal")
            self.layers = DecoderLayers(cfg, rngs)
            self.final_norm_d = _param(rngs, (d,), ("embed",), dt, "ones")
            head = None
            if not cfg.tie_word_embeddings:
                head = _param(rngs, (d, v), ("embed", "vocab"), dt, "normal")
            self.lm_head_dv = nnx.data(head)

    def __call__(
        self, tokens_bt: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array | None = None
    ) -> jax.Array:
        cfg = self.cfg
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        mask_btt = attn.segment_causal_mask(segment_ids_bt)
        cos_bte, sin_bte = attn.rope_tables(positions_bt, attn.rope_inv_freq(cfg))

        def layer(x_btd: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            h_btd = attn.rms_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke = qkv(cfg, w, h_btd, cos_bte, sin_bte)
            return block_tail(cfg, w, x_btd, attn.attend(q_bthe, k_btke, v_btke, mask_btt)), None

        if cfg.remat:
            layer = jax.checkpoint(layer)
        x_btd, _ = jax.lax.scan(layer, self.embed(tokens_bt), self.layers.stacked())
        return self.logits(x_btd)

    def decode(
        self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Serving step over cache slots; see the module docstring for the exact contract."""
        cfg = self.cfg
        b, t = tokens_bt.shape
        if cache.k_lbske.shape[1] != b:
            raise ValueError(
                f"tokens have {b} rows but the cache has {cache.k_lbske.shape[1]} slots"
            )
        cos_bte, sin_bte = attn.rope_tables(positions_bt, attn.rope_inv_freq(cfg))
        mask_bts = attn.cache_mask(positions_bt, cache.max_len)
        # Position -1 (padding) becomes an out-of-range index, which the scatter drops.
        write_bt = jnp.where(positions_bt >= 0, positions_bt, cache.max_len)
        rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))

        def layer(x_btd: jax.Array, xs: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            w, k_bske, v_bske = xs
            h_btd = attn.rms_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke = qkv(cfg, w, h_btd, cos_bte, sin_bte)
            k_bske = k_bske.at[rows_bt, write_bt].set(k_btke.astype(k_bske.dtype), mode="drop")
            v_bske = v_bske.at[rows_bt, write_bt].set(v_btke.astype(v_bske.dtype), mode="drop")
            o_bthe = attn.attend(
                q_bthe, k_bske.astype(x_btd.dtype), v_bske.astype(x_btd.dtype), mask_bts
            )
            return block_tail(cfg, w, x_btd, o_bthe), (k_bske, v_bske)

        xs = (self.layers.stacked(), cache.k_lbske, cache.v_lbske)
        x_btd, (k_lbske, v_lbske) = jax.lax.scan(layer, self.embed(tokens_bt), xs)
        return self.logits(x_btd), KVCache(k_lbske=k_lbske, v_lbske=v_lbske)

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(self.cfg.compute_jnp_dtype)
        return constrain(x_btd, ("batch", "length", "embed"))

    def logits(self, x_btd: jax.Array) -> jax.Array:
        cfg = self.cfg
        h_btd = attn.rms_norm(x_btd, self.final_norm_d[...], cfg.rms_norm_eps).astype(
            cfg.compute_jnp_dtype
        )
        head_dv = self.embed_vd[...].T if self.lm_head_dv is None else self.lm_head_dv[...]
        logits_btv = jnp.einsum(
            "btd,dv->btv",
            h_btd,
            head_dv.astype(cfg.compute_jnp_dtype),
            preferred_element_type=jnp.promote_types(h_btd.dtype, jnp.float32),
        )
        return constrain(logits_btv, ("batch", "length", "vocab"))
