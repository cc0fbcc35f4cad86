"""Model stage: the Flax NNX decoder (Llama / SmolLM2, Qwen2, Qwen3 dense) and its KV cache.

In: token ids, positions and segment ids `[b, t]` (training), or ids and positions plus a
`KVCache` (serving). Out: float32 logits `[b, t, vocab]` (and the updated cache).

Training / scoring:  `logits_btv = model(tokens_bt, positions_bt, segment_ids_bt)`
  Packed rows: a token attends to earlier tokens (in row order) of its own segment only; positions
  restart at 0 per segment and drive RoPE; segment id 0 marks padding (its logits are garbage).

Serving:  `logits_btv, cache = model.decode(tokens_bt, positions_bt, cache, *, slot, length, last)`
  `cache = KVCache.create(cfg, slots=S, max_len=M)`: row s of the cache is serving slot s and
  cache index m holds the keys/values of the token at position m of the sequence in that slot.
  A call writes the K/V of `tokens_bt[b, i]` at index `positions_bt[b, i]` of its slot, then each
  query attends to the slot's cache entries at indices <= its own position. Pad a row, or the tail
  of a chunk, with position -1: nothing is written and its logits are to be ignored. Positions of
  a slot must be written contiguously from 0 before they are attended to; a slot is reused
  without clearing, because a new sequence overwrites every index it reads.
  - `slot=None` (default): batch row b is slot b (b == S). Rows are independent: one call can
    prefill one slot (t = prompt chunk) while other rows decode or idle.
    `slot=j` (int or traced int32 scalar): the batch is one row (b == 1), written to slot j.
  - `length` (static int, default M): attend over cache indices < length only, so a step costs
    what its longest sequence needs; every position in the call must be < length.
  - `last` (traced int, default None): logits only at index `last` of each row: `[b, 1, vocab]`.
  `model.prefill_packed(...)` writes the first chunks of several prompts, packed in one row
  with segment ids as in training, into their slots in one call; a prompt may start after a
  prefix its slot already holds, within a window of the slot's first indices (see its docstring).
  The cache is carried through the layer loop and written by a scatter: under `jax.jit` with the
  cache donated, XLA updates it in place instead of copying every layer's cache each step.

Layers are stacked (`layers` leading axis) and run with `jax.lax.scan`, so compile time does not
grow with depth; call the model under `nnx.jit` (an eager call re-traces the scan every time).
Parameters and activations carry logical axis names only (`sharding.py`); the runtime that owns
the mesh maps them. Created under a mesh and that runtime's `nnx.logical_axis_rules`, the
parameters are sharded eagerly; created without a mesh they are plain arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from harnessrl.model import attention as attn
from harnessrl.model.bf16_bits import is_bits, widen
from harnessrl.model.cache import KVCache
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.hooks import DecodeKernels, MatVec, SegmentAttention, masked_attention
from harnessrl.model.sharding import constrain, param_sharding

INIT_STDDEV = 0.02  # HF initializer_range for these families


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


# `project(x, name)`: x contracted with the layer's weight `name` over its input axes.
Project = Callable[[jax.Array, str], jax.Array]
PROJECTIONS = ("wq_ldhe", "wk_ldke", "wv_ldke", "wo_lhed", "w_gate_ldf", "w_up_ldf", "w_down_lfd")
IN_AXES = {"wo_lhed": 2}  # weights whose input is more than one axis (heads, head_dim)


def dense_project(cfg: ModelConfig, w: dict[str, jax.Array]) -> Project:
    """Projections as XLA dots of this layer's weights `w`."""
    ct = cfg.compute_jnp_dtype

    def project(x: jax.Array, name: str) -> jax.Array:
        if name == "wo_lhed":
            # An einsum rather than `dense`: its (h, e) accumulation order keeps SmolLM2's float32
            # logits within 1e-4 of transformers', and its backward pass measured no slower.
            return jnp.einsum("bthe,hed->btd", x, w[name].astype(ct), precision=attn.PRECISION)
        return attn.dense(x, w[name].astype(ct))

    return project


def matvec_project(matvec: MatVec, stacked: dict[str, jax.Array], layer: jax.Array) -> Project:
    """Projections through `matvec`, reading layer `layer` of the stacked weights in place."""

    def project(x: jax.Array, name: str) -> jax.Array:
        w = stacked[name]
        contract = IN_AXES.get(name, 1)
        k, out = math.prod(w.shape[1 : 1 + contract]), w.shape[1 + contract :]
        y_rn = matvec(x.reshape(-1, k), w.reshape(w.shape[0], k, -1), layer, False)
        return y_rn.reshape(*x.shape[: x.ndim - contract], *out)

    return project


def qkv(
    cfg: ModelConfig,
    w: dict[str, jax.Array],
    x_btd: jax.Array,
    cos_bte: jax.Array,
    sin_bte: jax.Array,
    project: Project | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Project one layer's normalized input to RoPE'd queries and keys, and values."""
    ct = cfg.compute_jnp_dtype
    project = project or dense_project(cfg, w)
    q_bthe = project(x_btd, "wq_ldhe")
    k_btke = project(x_btd, "wk_ldke")
    v_btke = project(x_btd, "wv_ldke")
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
    cfg: ModelConfig,
    w: dict[str, jax.Array],
    x_btd: jax.Array,
    o_bthe: jax.Array,
    project: Project | None = None,
) -> jax.Array:
    """Attention output projection + residual, then the SwiGLU MLP + residual."""
    ct = cfg.compute_jnp_dtype
    project = project or dense_project(cfg, w)
    x_btd = x_btd + project(o_bthe, "wo_lhed")
    x_btd = constrain(x_btd, ("batch", "length", "embed"))
    h_btd = attn.rms_norm(x_btd, w["mlp_norm_ld"], cfg.rms_norm_eps).astype(ct)
    gate_btf, up_btf = project(h_btd, "w_gate_ldf"), project(h_btd, "w_up_ldf")
    mlp_btd = project(jax.nn.silu(gate_btf) * up_btf, "w_down_lfd")
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
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        segment_ids_bt: jax.Array | None = None,
        *,
        attention: SegmentAttention | None = None,
    ) -> jax.Array:
        """Logits `[b, t, vocab]`. `attention`, where a runtime has a faster equal of it, replaces
        `attention.attend` over the causal mask within segments (see `SegmentAttention`)."""
        cfg = self.cfg
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        cos_bte, sin_bte = attn.rope_tables(positions_bt, attn.rope_inv_freq(cfg))
        attend = attention or masked_attention(segment_ids_bt)

        def layer(x_btd: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            h_btd = attn.rms_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke = qkv(cfg, w, h_btd, cos_bte, sin_bte)
            o_bthe = attend(q_bthe, k_btke, v_btke, segment_ids_bt).astype(x_btd.dtype)
            return block_tail(cfg, w, x_btd, o_bthe), None

        if cfg.remat:
            layer = jax.checkpoint(layer)
        x_btd, _ = jax.lax.scan(
            layer,
            self.embed(tokens_bt),
            self.layers.stacked(),
            unroll=min(cfg.scan_unroll, cfg.num_layers),
        )
        return self.logits(x_btd)

    def decode(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache,
        *,
        slot: int | jax.Array | None = None,
        length: int | None = None,
        last: int | jax.Array | None = None,
        kernels: DecodeKernels | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Serving step over cache slots; see the module docstring for the exact contract.

        `kernels`, for a decode step (one token per slot, `slot=None`, float32 cache), computes
        the projections, the head and the attention.
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        length = cache.max_len if length is None else length
        cache.check_step(b, slot, length)
        cos_bte, sin_bte = attn.rope_tables(positions_bt, attn.rope_inv_freq(cfg))
        mask_bts = attn.cache_mask(positions_bt, length)
        # Position -1 (padding) becomes an out-of-range index, which the scatter drops.
        write_bt = jnp.where(positions_bt >= 0, positions_bt, cache.max_len)
        first = 0 if slot is None else slot
        slots_bt = jnp.broadcast_to(first + jnp.arange(b)[:, None], (b, t))
        x_btd, cache = self._serve_layers(
            self.embed(tokens_bt),
            cache,
            (cos_bte, sin_bte),
            (slots_bt, write_bt),
            mask_bts,
            window=(first, b, length),
            kernels=kernels,
            positions_b=positions_bt[:, -1],
        )
        if last is not None:  # the vocab projection only where a token is sampled
            x_btd = jax.lax.dynamic_slice_in_dim(x_btd, last, 1, axis=1)
        return self.logits(x_btd, None if kernels is None else kernels.matvec), cache

    def prefill_packed(
        self,
        tokens_1t: jax.Array,
        positions_1t: jax.Array,
        segment_ids_1t: jax.Array,
        slots_1t: jax.Array,
        cache: KVCache,
        *,
        last_n: jax.Array,
        held_n: jax.Array | None = None,
        window: int = 0,
    ) -> tuple[jax.Array, KVCache]:
        """Chunks of several prompts packed in one row → logits at `last_n`, and the cache.

        Token i of the row belongs to segment `segment_ids_1t[0, i]` (0: padding, not written)
        and is written at index `positions_1t[0, i]` of cache slot `slots_1t[0, i]`. Each token
        attends to the earlier tokens of its own segment in the row, as in training's packed rows,
        and, when segment n+1 resumes a prefix its slot holds (`held_n[n]` > 0, positions starting
        there), to that slot's cache indices `< held_n[n]`. `window` (static) bounds those: the
        call reads cache indices `< window` of every slot, masked to each token's own, so the
        extra scores cost `slots x window` per token. Returns `[1, n, vocab]` logits at row
        indices `last_n` (`[n]`).
        """
        cfg = self.cfg
        mask_btt = attn.segment_causal_mask(segment_ids_1t)
        if window:
            if held_n is None:
                raise ValueError("prefill_packed with a window needs held_n")
            # Key (slot s, index j) of the window is visible to a token of slot s whose segment
            # resumes after more than j held tokens; keys are the row's, then the window's.
            held_1t = jnp.where(segment_ids_1t > 0, held_n[jnp.maximum(segment_ids_1t - 1, 0)], 0)
            mine_1ts = slots_1t[..., None] == jnp.arange(cache.slots)
            before_1tj = jnp.arange(window) < held_1t[..., None]
            held_1tsj = mine_1ts[..., None] & before_1tj[..., None, :]
            mask_btt = jnp.concatenate([mask_btt, held_1tsj.reshape(*mask_btt.shape[:2], -1)], -1)
        cos_bte, sin_bte = attn.rope_tables(positions_1t, attn.rope_inv_freq(cfg))
        write_1t = jnp.where(segment_ids_1t > 0, positions_1t, cache.max_len)  # dropped
        slots_1t = jnp.where(segment_ids_1t > 0, slots_1t, 0)

        x_btd, cache = self._serve_layers(
            self.embed(tokens_1t),
            cache,
            (cos_bte, sin_bte),
            (slots_1t, write_1t),
            mask_btt,
            window=None,
            held_window=window,
        )
        x_bnd = jnp.take(x_btd, last_n, axis=1)  # the vocab projection only where one is sampled
        return self.logits(x_bnd), cache

    def _serve_layers(
        self,
        x_btd: jax.Array,
        cache: KVCache,
        rope: tuple[jax.Array, jax.Array],
        writes: tuple[jax.Array, jax.Array],
        mask_bts: jax.Array,
        *,
        window: tuple[int | jax.Array, int, int] | None,
        held_window: int = 0,
        kernels: DecodeKernels | None = None,
        positions_b: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """The layer scan of a serving call: each layer writes the call's keys and values at
        `writes` (cache slot, index per token; an out-of-range index is dropped), then attends over
        `window` (first slot, rows, length) of its cache, or, when None, over the call's own
        followed by the first `held_window` indices of every slot (a one-row call).

        The whole cache is the scan's carry, so each layer's scatter updates it in place. With
        `kernels` (a decode step: one token per slot, `positions_b` its positions), the projection
        weights stay out of the scan's slices and the attention reads the cache in place.
        """
        cfg = self.cfg
        slots_bt, write_bt = writes
        Carry = tuple[jax.Array, jax.Array, jax.Array]
        stacked = self.layers.stacked()
        sliced = stacked
        if kernels is not None:
            b, t = x_btd.shape[:2]
            if window is None or t != 1 or b != cache.slots or positions_b is None:
                raise ValueError("decode kernels take a decode step: one token per cache slot")
            sliced = {name: value for name, value in stacked.items() if name not in PROJECTIONS}

        def layer(carry: Carry, xs: tuple[dict[str, jax.Array], jax.Array]) -> tuple[Carry, None]:
            x_btd, k_lbske, v_lbske = carry
            w, i = xs
            w = {name: widen(value) for name, value in w.items()}  # a serving engine's bf16 bits
            project = None if kernels is None else matvec_project(kernels.matvec, stacked, i)
            h_btd = attn.rms_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke = qkv(cfg, w, h_btd, *rope, project)
            at = (jnp.full_like(slots_bt, i), slots_bt, write_bt)
            k_lbske = k_lbske.at[at].set(k_btke.astype(k_lbske.dtype), mode="drop")
            v_lbske = v_lbske.at[at].set(v_btke.astype(v_lbske.dtype), mode="drop")
            if kernels is not None:
                o_bhe = kernels.attention(q_bthe[:, 0], k_lbske, v_lbske, i, positions_b)
                x_btd = block_tail(cfg, w, x_btd, o_bhe[:, None], project)
                return (x_btd, k_lbske, v_lbske), None
            if window is not None:
                first, rows, length = window
                shape = (1, rows, length, cfg.num_kv_heads, cfg.head_dim)
                k_btke, v_btke = (
                    jax.lax.dynamic_slice(c, (i, first, 0, 0, 0), shape)[0].astype(x_btd.dtype)
                    for c in (k_lbske, v_lbske)
                )
            elif held_window:  # the row's keys, then each slot's first indices
                shape = (1, cache.slots, held_window, cfg.num_kv_heads, cfg.head_dim)
                held_k, held_v = (
                    jax.lax.dynamic_slice(c, (i, 0, 0, 0, 0), shape)
                    .reshape(1, -1, cfg.num_kv_heads, cfg.head_dim)
                    .astype(x_btd.dtype)
                    for c in (k_lbske, v_lbske)
                )
                k_btke = jnp.concatenate([k_btke, held_k], axis=1)
                v_btke = jnp.concatenate([v_btke, held_v], axis=1)
            o_bthe = attn.attend(q_bthe, k_btke, v_btke, mask_bts)
            return (block_tail(cfg, w, x_btd, o_bthe, project), k_lbske, v_lbske), None

        xs = (sliced, jnp.arange(cfg.num_layers))
        (x_btd, k_lbske, v_lbske), _ = jax.lax.scan(
            layer, (x_btd, cache.k_lbske, cache.v_lbske), xs
        )
        return x_btd, KVCache(k_lbske=k_lbske, v_lbske=v_lbske)

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        rows_btd = widen(jnp.take(self.embed_vd[...], tokens_bt, axis=0))
        x_btd = rows_btd.astype(self.cfg.compute_jnp_dtype)
        return constrain(x_btd, ("batch", "length", "embed"))

    def logits(self, x_btd: jax.Array, matvec: MatVec | None = None) -> jax.Array:
        cfg = self.cfg
        h_btd = attn.rms_norm(x_btd, widen(self.final_norm_d[...]), cfg.rms_norm_eps).astype(
            cfg.compute_jnp_dtype
        )
        tied = self.lm_head_dv is None
        head = self.embed_vd[...] if self.lm_head_dv is None else self.lm_head_dv[...]
        if matvec is not None:  # the head as one more "layer": [1, vocab, embed] if tied
            b, t, d = h_btd.shape
            logits_rv = matvec(h_btd.reshape(b * t, d), head[None], jnp.int32(0), tied)
            return constrain(logits_rv.reshape(b, t, -1), ("batch", "length", "vocab"))
        if is_bits(head):  # a serving engine's bf16 bits
            logits_btv = bits_head_logits(h_btd, head, tied=tied)
            return constrain(logits_btv, ("batch", "length", "vocab"))
        out_dtype = jnp.promote_types(h_btd.dtype, jnp.float32)
        head = head.astype(cfg.compute_jnp_dtype)
        if tied:
            logits_btv = attn.tied_head_logits(h_btd, head, out_dtype)
        else:
            logits_btv = attn.dense(h_btd, head, out_dtype=out_dtype)
        return constrain(logits_btv, ("batch", "length", "vocab"))


HEAD_CHUNK = 2048  # vocab rows widened at a time: a float32 chunk of them stays in cache


def bits_head_logits(h_btd: jax.Array, head_bits: jax.Array, *, tied: bool) -> jax.Array:
    """Logits from a head held as bf16 bits (`[vocab, embed]` if `tied`, else `[embed, vocab]`),
    widened a vocabulary chunk at a time in a scan.

    Widening the whole table at once would write and reread a float32 copy of it each step, more
    traffic than the float32 weights themselves; chunk by chunk, it never leaves the cache. Rows
    past the last whole chunk take one more, static, product.
    """
    axis, spec = (0, "btd,cd->btc") if tied else (1, "btd,dc->btc")
    v = head_bits.shape[axis]
    whole = v // HEAD_CHUNK * HEAD_CHUNK

    def chunk(_: None, start: jax.Array) -> tuple[None, jax.Array]:
        rows = jax.lax.dynamic_slice_in_dim(head_bits, start, HEAD_CHUNK, axis=axis)
        return None, jnp.einsum(spec, h_btd, widen(rows), precision=attn.PRECISION)

    parts = []
    if whole:
        _, logits_nbtc = jax.lax.scan(chunk, None, jnp.arange(0, whole, HEAD_CHUNK))
        b, t, _ = h_btd.shape
        parts.append(jnp.moveaxis(logits_nbtc, 0, 2).reshape(b, t, whole))
    if whole < v:
        tail = jax.lax.slice_in_dim(head_bits, whole, v, axis=axis)
        parts.append(jnp.einsum(spec, h_btd, widen(tail), precision=attn.PRECISION))
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
