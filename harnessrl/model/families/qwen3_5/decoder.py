"""Model stage: the Qwen3.5 hybrid decoder in Flax NNX (Gated DeltaNet and gated attention).

In: token ids, positions and segment ids `[b, t]`. Out: float32 logits `[b, t, vocab]`.
`logits_btv = model(tokens_bt, positions_bt, segment_ids_bt)`, the contract of
`harnessrl.model.families.dense.decoder.Decoder`: positions restart at 0 per segment and drive RoPE, segment id
0 marks padding. The layers run as `num_groups` repeats of (interval - 1) DeltaNet layers and one
attention layer: each kind is stacked on a leading `layers` axis and a `lax.scan` runs the groups,
so compile time does not grow with depth. Shape letters as in `attention.py`, plus r the DeltaNet
key heads, w the conv kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harnessrl.model import attention as attn
from harnessrl.model.cache import KVCache
from harnessrl.model.families.qwen3_5 import gated_deltanet as gdn
from harnessrl.model.families.qwen3_5.cache import HybridCache
from harnessrl.model.families.qwen3_5.config import Qwen35Config
from harnessrl.model.sharding import constrain, param_sharding

INIT_STDDEV = 0.02
Weights = dict[str, jax.Array]
DELTANET_PROJ = ("wq_ldrk", "wk_ldrk", "wv_ldhv")  # the conv runs over these channels, in order
DELTANET_CONV = ("conv_q_lwrk", "conv_k_lwrk", "conv_v_lwhv")


def _param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: object, init: str
) -> nnx.Param:
    initializer = {
        "normal": nnx.initializers.normal(INIT_STDDEV),
        "ones": nnx.initializers.ones,
        "zeros": nnx.initializers.zeros,
    }[init]
    return nnx.Param(nnx.with_partitioning(initializer, axes)(rngs.params(), shape, dtype))


class _Stacked(nnx.Module):
    def stacked(self) -> Weights:
        """The weights as plain arrays, ready to be scanned over the layers axis."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    def add_mlp(self, cfg: Qwen35Config, n: int, rngs: nnx.Rngs) -> None:
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.param_jnp_dtype
        # Zero-centred RMSNorm weights: the norm multiplies by (1 + w).
        self.attn_norm_ld = _param(rngs, (n, d), ("layers", "embed"), dt, "zeros")
        self.mlp_norm_ld = _param(rngs, (n, d), ("layers", "embed"), dt, "zeros")
        self.w_gate_ldf = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, "normal")
        self.w_up_ldf = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dt, "normal")
        self.w_down_lfd = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), dt, "normal")


class DeltaNetLayers(_Stacked):
    """The Gated DeltaNet layers, `[num_linear_layers, ...]`."""

    def __init__(self, cfg: Qwen35Config, rngs: nnx.Rngs) -> None:
        n, d, dt = cfg.num_linear_layers, cfg.hidden_size, cfg.param_jnp_dtype
        r, k = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        h, v, w = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.add_mlp(cfg, n, rngs)
        qk_axes = ("layers", "embed", "kv_heads", "head_dim")
        v_axes = ("layers", "embed", "heads", "head_dim")
        self.wq_ldrk = _param(rngs, (n, d, r, k), qk_axes, dt, "normal")
        self.wk_ldrk = _param(rngs, (n, d, r, k), qk_axes, dt, "normal")
        self.wv_ldhv = _param(rngs, (n, d, h, v), v_axes, dt, "normal")
        self.wz_ldhv = _param(rngs, (n, d, h, v), v_axes, dt, "normal")
        # The depthwise conv over the q, k, v channels; its short kernel axis stays replicated.
        self.conv_q_lwrk = _param(
            rngs, (n, w, r, k), ("layers", None, "kv_heads", "head_dim"), dt, "normal"
        )
        self.conv_k_lwrk = _param(
            rngs, (n, w, r, k), ("layers", None, "kv_heads", "head_dim"), dt, "normal"
        )
        self.conv_v_lwhv = _param(
            rngs, (n, w, h, v), ("layers", None, "heads", "head_dim"), dt, "normal"
        )
        self.wb_ldh = _param(rngs, (n, d, h), ("layers", "embed", "heads"), dt, "normal")
        self.wa_ldh = _param(rngs, (n, d, h), ("layers", "embed", "heads"), dt, "normal")
        self.dt_bias_lh = _param(rngs, (n, h), ("layers", "heads"), dt, "ones")
        self.a_log_lh = _param(rngs, (n, h), ("layers", "heads"), dt, "zeros")  # A = exp(0) = 1
        self.out_norm_lv = _param(rngs, (n, v), ("layers", "head_dim"), dt, "ones")  # plain RMSNorm
        self.wo_lhvd = _param(
            rngs, (n, h, v, d), ("layers", "heads", "head_dim", "embed"), dt, "normal"
        )


class AttentionLayers(_Stacked):
    """The gated softmax-attention layers, `[num_groups, ...]`."""

    def __init__(self, cfg: Qwen35Config, rngs: nnx.Rngs) -> None:
        n, d, dt = cfg.num_groups, cfg.hidden_size, cfg.param_jnp_dtype
        h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.add_mlp(cfg, n, rngs)
        self.wq_ldhe = _param(
            rngs, (n, d, h, e), ("layers", "embed", "heads", "head_dim"), dt, "normal"
        )
        self.wg_ldhe = _param(
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
        self.q_norm_le = _param(rngs, (n, e), ("layers", "head_dim"), dt, "zeros")
        self.k_norm_le = _param(rngs, (n, e), ("layers", "head_dim"), dt, "zeros")


def zc_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: `rms(x) * (1 + w)`, in float32."""
    return attn.rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


def rope_inv_freq(cfg: Qwen35Config) -> np.ndarray:
    """Inverse frequencies [rotary_dim / 2], rounded as transformers' float32 computation is."""
    dim = cfg.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    power = (np.float64(cfg.rope_theta) ** exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


def mlp_tail(cfg: Qwen35Config, w: Weights, x_btd: jax.Array, mixed_btd: jax.Array) -> jax.Array:
    """Residual add of the token mixer's output, then the SwiGLU MLP and its residual."""
    ct = cfg.compute_jnp_dtype
    x_btd = constrain(x_btd + mixed_btd, ("batch", "length", "embed"))
    h_btd = zc_norm(x_btd, w["mlp_norm_ld"], cfg.rms_norm_eps).astype(ct)
    mlp_btd = attn.swiglu(
        h_btd, w["w_gate_ldf"].astype(ct), w["w_up_ldf"].astype(ct), w["w_down_lfd"].astype(ct)
    )
    return constrain(x_btd + mlp_btd, ("batch", "length", "embed"))


def deltanet_inputs(
    cfg: Qwen35Config, w: Weights, h_btd: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The conv's input channels [q | k | v] and kernel, the output gate z, beta and log-decay g."""
    ct, (b, t, _) = cfg.compute_jnp_dtype, h_btd.shape
    x_btf = jnp.concatenate(
        [attn.dense(h_btd, w[p].astype(ct)).reshape(b, t, -1) for p in DELTANET_PROJ], -1
    )
    width = cfg.linear_conv_kernel_dim
    conv_wf = jnp.concatenate([w[c].astype(ct).reshape(width, -1) for c in DELTANET_CONV], -1)
    z_bthv = attn.dense(h_btd, w["wz_ldhv"].astype(ct))
    beta_bth = jax.nn.sigmoid(attn.dense(h_btd, w["wb_ldh"].astype(ct)).astype(jnp.float32))
    a_bth = attn.dense(h_btd, w["wa_ldh"].astype(ct)).astype(jnp.float32)
    g_bth = -jnp.exp(w["a_log_lh"].astype(jnp.float32)) * jax.nn.softplus(
        a_bth + w["dt_bias_lh"].astype(jnp.float32)
    )
    return x_btf, conv_wf, z_bthv, beta_bth, g_bth


def deltanet_heads(cfg: Qwen35Config, xc_btf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split the conv output into normalized queries (scaled) and keys per value head, values."""
    (b, t, _), r, k = xc_btf.shape, cfg.linear_num_key_heads, cfg.linear_key_head_dim
    q_btrk = xc_btf[..., : r * k].reshape(b, t, r, k)
    k_btrk = xc_btf[..., r * k : 2 * r * k].reshape(b, t, r, k)
    v_bthv = xc_btf[..., 2 * r * k :].reshape(b, t, cfg.linear_num_value_heads, -1)
    # Value head i reads key head i // (value heads per key head), transformers' repeat_interleave.
    group = cfg.linear_num_value_heads // r
    q_bthk = jnp.repeat(gdn.l2_normalize(q_btrk), group, axis=2) * k**-0.5
    return q_bthk, jnp.repeat(gdn.l2_normalize(k_btrk), group, axis=2), v_bthv


def deltanet_out(cfg: Qwen35Config, w: Weights, o_bthv: jax.Array, z_bthv: jax.Array) -> jax.Array:
    """Gated RMSNorm of each head's output (a plain, not zero-centred, weight), then out_proj."""
    ct = cfg.compute_jnp_dtype
    o_bthv = attn.rms_norm(o_bthv, w["out_norm_lv"], cfg.rms_norm_eps) * jax.nn.silu(
        z_bthv.astype(jnp.float32)
    )
    return jnp.einsum(
        "bthv,hvd->btd", o_bthv.astype(ct), w["wo_lhvd"].astype(ct), precision=attn.PRECISION
    )


def deltanet_layer(cfg: Qwen35Config, w: Weights, x_btd: jax.Array, run_bt: jax.Array) -> jax.Array:
    """One Gated DeltaNet layer (token mixer and MLP) over whole packed rows, chunked."""
    h_btd = zc_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(cfg.compute_jnp_dtype)
    x_btf, conv_wf, z_bthv, beta_bth, g_bth = deltanet_inputs(cfg, w, h_btd)
    q_bthk, k_bthk, v_bthv = deltanet_heads(cfg, gdn.causal_conv(x_btf, conv_wf, run_bt))
    o_bthv, _ = gdn.chunked_gated_delta_rule(
        q_bthk, k_bthk, v_bthv, g_bth, beta_bth, run_bt, cfg.chunk_size
    )
    return mlp_tail(cfg, w, x_btd, deltanet_out(cfg, w, o_bthv, z_bthv))


def attention_qkv(
    cfg: Qwen35Config, w: Weights, h_btd: jax.Array, cos_bte: jax.Array, sin_bte: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries and keys (normed, partially RoPE'd), values, and the output gate of one layer."""
    ct, eps, rd = cfg.compute_jnp_dtype, cfg.rms_norm_eps, cfg.rotary_dim
    q_bthe = zc_norm(attn.dense(h_btd, w["wq_ldhe"].astype(ct)), w["q_norm_le"], eps).astype(ct)
    k_btke = zc_norm(attn.dense(h_btd, w["wk_ldke"].astype(ct)), w["k_norm_le"], eps).astype(ct)
    v_btke = attn.dense(h_btd, w["wv_ldke"].astype(ct))
    gate_bthe = attn.dense(h_btd, w["wg_ldhe"].astype(ct))

    def rope(x: jax.Array) -> jax.Array:  # only the first rotary_dim dims rotate
        return jnp.concatenate([attn.apply_rope(x[..., :rd], cos_bte, sin_bte), x[..., rd:]], -1)

    return rope(q_bthe), rope(k_btke), v_btke, gate_bthe


def attention_out(
    cfg: Qwen35Config, w: Weights, o_bthe: jax.Array, gate_bthe: jax.Array
) -> jax.Array:
    ct = cfg.compute_jnp_dtype
    o_bthe = o_bthe * jax.nn.sigmoid(gate_bthe.astype(jnp.float32)).astype(ct)
    return jnp.einsum("bthe,hed->btd", o_bthe, w["wo_lhed"].astype(ct), precision=attn.PRECISION)


class Qwen35Decoder(nnx.Module):
    """Embedding → groups of (DeltaNet layers, one gated attention layer) → RMSNorm → logits."""

    def __init__(self, cfg: Qwen35Config, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        v, d, dt = cfg.vocab_size, cfg.hidden_size, cfg.param_jnp_dtype
        with param_sharding():
            self.embed_vd = _param(rngs, (v, d), ("vocab", "embed"), dt, "normal")
            self.linear = DeltaNetLayers(cfg, rngs)
            self.full = AttentionLayers(cfg, rngs)
            self.final_norm_d = _param(rngs, (d,), ("embed",), dt, "zeros")
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
        run_bt = gdn.run_ids(segment_ids_bt)
        cos_bte, sin_bte = attn.rope_tables(positions_bt, rope_inv_freq(cfg))
        blocks = attn.causal_query_blocks(tokens_bt.shape[1])

        def linear(x_btd: jax.Array, w: Weights) -> tuple[jax.Array, None]:
            return deltanet_layer(cfg, w, x_btd, run_bt), None

        def full(x_btd: jax.Array, w: Weights) -> jax.Array:
            h_btd = zc_norm(x_btd, w["attn_norm_ld"], cfg.rms_norm_eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke, gate_bthe = attention_qkv(cfg, w, h_btd, cos_bte, sin_bte)
            o_bthe = attn.attend(q_bthe, k_btke, v_btke, mask_btt, causal_blocks=blocks)
            return mlp_tail(cfg, w, x_btd, attention_out(cfg, w, o_bthe, gate_bthe))

        if cfg.remat:
            linear, full = jax.checkpoint(linear), jax.checkpoint(full)

        per_group = cfg.full_attention_interval - 1
        # scan_unroll counts layers: the inner scan unrolls up to a group's DeltaNet layers, the
        # outer one the groups that many layers span.
        inner = max(1, min(cfg.scan_unroll, per_group))
        outer = max(1, min(cfg.scan_unroll // cfg.full_attention_interval, cfg.num_groups))

        def group(x_btd: jax.Array, ws: tuple[Weights, Weights]) -> tuple[jax.Array, None]:
            x_btd, _ = jax.lax.scan(linear, x_btd, ws[0], unroll=inner)
            return full(x_btd, ws[1]), None

        linear_w = jax.tree.map(
            lambda a: a.reshape(cfg.num_groups, per_group, *a.shape[1:]), self.linear.stacked()
        )
        x_btd, _ = jax.lax.scan(
            group, self.embed(tokens_bt), (linear_w, self.full.stacked()), unroll=outer
        )
        return self.logits(x_btd)

    def decode(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        cache: HybridCache,
        *,
        slot: int | jax.Array | None = None,
        length: int | None = None,
        last: int | jax.Array | None = None,
    ) -> tuple[jax.Array, HybridCache]:
        """Serving step over cache slots: `Decoder.decode`'s contract, with `HybridCache`.

        The DeltaNet layers continue each slot's state: a decode step (one token a row) by the
        recurrence, a prompt chunk by the chunked form the learner trains with, `chunk_size`
        tokens per sequential step instead of one. A row's real tokens come first and its
        padding (position -1) after them.
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        length = cache.max_len if length is None else length
        cache.check_step(b, slot, length)
        cos_bte, sin_bte = attn.rope_tables(positions_bt, rope_inv_freq(cfg))
        mask_bts = attn.cache_mask(positions_bt, length)
        write_bt = jnp.where(positions_bt >= 0, positions_bt, cache.max_len)  # -1: dropped
        first = 0 if slot is None else slot
        slots_b = first + jnp.arange(b)
        slots_bt = jnp.broadcast_to(slots_b[:, None], (b, t))
        real_bt1 = (positions_bt >= 0)[..., None]
        keep_bt = (positions_bt != 0).astype(jnp.float32)  # position 0 drops the old state
        window = (1, b, length, cfg.num_kv_heads, cfg.head_dim)
        eps = cfg.rms_norm_eps

        LinearCarry = tuple[jax.Array, jax.Array, jax.Array]

        def linear(carry: LinearCarry, xs: tuple[Weights, jax.Array]) -> tuple[LinearCarry, None]:
            x_btd, conv_lbwf, state_lbhkv = carry
            w, j = xs
            h_btd = zc_norm(x_btd, w["attn_norm_ld"], eps).astype(x_btd.dtype)
            x_btf, conv_wf, z_bthv, beta_bth, g_bth = deltanet_inputs(cfg, w, h_btd)
            xc_btf, conv_bwf = gdn.conv_step(x_btf, conv_wf, conv_lbwf[j, slots_b], positions_bt)
            q_bthk, k_bthk, v_bthv = deltanet_heads(cfg, xc_btf)
            # Padding neither decays nor writes the state.
            g_bth, beta_bth = jnp.where(real_bt1, g_bth, 0.0), jnp.where(real_bt1, beta_bth, 0.0)
            if t == 1:
                o_bthv, s_bhkv = gdn.recurrent_gated_delta_rule(
                    q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_lbhkv[j, slots_b], keep_bt
                )
            else:  # real tokens first: only a row's first token can be position 0
                s_bhkv = state_lbhkv[j, slots_b] * keep_bt[:, 0, None, None, None]
                one_run_bt = jnp.zeros_like(positions_bt)  # a chunk's tokens, padding too
                o_bthv, s_bhkv = gdn.chunked_gated_delta_rule(
                    q_bthk, k_bthk, v_bthv, g_bth, beta_bth, one_run_bt, cfg.chunk_size, s_bhkv
                )
            conv_lbwf = conv_lbwf.at[j, slots_b].set(conv_bwf.astype(conv_lbwf.dtype))
            state_lbhkv = state_lbhkv.at[j, slots_b].set(s_bhkv)
            x_btd = mlp_tail(cfg, w, x_btd, deltanet_out(cfg, w, o_bthv, z_bthv))
            return (x_btd, conv_lbwf, state_lbhkv), None

        def full(
            x_btd: jax.Array, kv: KVCache, w: Weights, i: jax.Array
        ) -> tuple[jax.Array, KVCache]:
            h_btd = zc_norm(x_btd, w["attn_norm_ld"], eps).astype(x_btd.dtype)
            q_bthe, k_btke, v_btke, gate_bthe = attention_qkv(cfg, w, h_btd, cos_bte, sin_bte)
            at = (jnp.full_like(slots_bt, i), slots_bt, write_bt)
            k_lbske = kv.k_lbske.at[at].set(k_btke.astype(kv.k_lbske.dtype), mode="drop")
            v_lbske = kv.v_lbske.at[at].set(v_btke.astype(kv.v_lbske.dtype), mode="drop")
            k_bske, v_bske = (
                jax.lax.dynamic_slice(c, (i, first, 0, 0, 0), window)[0].astype(x_btd.dtype)
                for c in (k_lbske, v_lbske)
            )
            o_bthe = attn.attend(q_bthe, k_bske, v_bske, mask_bts)
            x_btd = mlp_tail(cfg, w, x_btd, attention_out(cfg, w, o_bthe, gate_bthe))
            return x_btd, KVCache(k_lbske=k_lbske, v_lbske=v_lbske)

        per_group = cfg.full_attention_interval - 1

        def group(
            carry: tuple[jax.Array, HybridCache], xs: tuple[Weights, Weights, jax.Array]
        ) -> tuple[tuple[jax.Array, HybridCache], None]:
            # The whole cache is the carry, so each layer's scatter updates it in place.
            x_btd, c = carry
            linear_w, full_w, i = xs
            layer_ids = i * per_group + jnp.arange(per_group)
            (x_btd, conv, state), _ = jax.lax.scan(
                linear, (x_btd, c.conv_lbwf, c.state_lbhkv), (linear_w, layer_ids)
            )
            x_btd, kv = full(x_btd, c.kv, full_w, i)
            return (x_btd, HybridCache(kv=kv, conv_lbwf=conv, state_lbhkv=state)), None

        linear_w = jax.tree.map(
            lambda a: a.reshape(cfg.num_groups, per_group, *a.shape[1:]), self.linear.stacked()
        )
        xs = (linear_w, self.full.stacked(), jnp.arange(cfg.num_groups))
        (x_btd, cache), _ = jax.lax.scan(group, (self.embed(tokens_bt), cache), xs)
        if last is not None:  # the vocab projection only where a token is sampled
            x_btd = jax.lax.dynamic_slice_in_dim(x_btd, last, 1, axis=1)
        return self.logits(x_btd), cache

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(self.cfg.compute_jnp_dtype)
        return constrain(x_btd, ("batch", "length", "embed"))

    def logits(self, x_btd: jax.Array) -> jax.Array:
        cfg = self.cfg
        h_btd = zc_norm(x_btd, self.final_norm_d[...], cfg.rms_norm_eps).astype(
            cfg.compute_jnp_dtype
        )
        out_dtype = jnp.promote_types(h_btd.dtype, jnp.float32)
        if self.lm_head_dv is None:
            embed_vd = self.embed_vd[...].astype(cfg.compute_jnp_dtype)
            logits_btv = attn.tied_head_logits(h_btd, embed_vd, out_dtype)
        else:
            head_dv = self.lm_head_dv[...].astype(cfg.compute_jnp_dtype)
            logits_btv = attn.dense(h_btd, head_dv, out_dtype=out_dtype)
        return constrain(logits_btv, ("batch", "length", "vocab"))
