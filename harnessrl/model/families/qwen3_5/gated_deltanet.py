"""Model stage: the Gated DeltaNet token mixer's math (causal conv, the gated delta rule).

In: one layer's projected activations `[b, t, ...]` and the run ids of packed rows. Out: mixed
activations. No parameters live here (`decoder.py` owns them). Letters: b batch, t length,
n chunk, c position in a chunk (i query, j key), h value heads, k key_dim, v value_dim, w the
conv kernel, f conv channels.

Packing: `run_ids` numbers the maximal runs of equal segment ids in a row; every function here
lets information flow only within a run, so a packed row equals each sequence run alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harnessrl.model.attention import PRECISION


def run_ids(segment_ids_bt: jax.Array) -> jax.Array:
    """[b, t] int32: 0 for the first run of equal segment ids in a row, +1 at every change."""
    change_bt = segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]
    return jnp.concatenate(
        [jnp.zeros_like(segment_ids_bt[:, :1]), jnp.cumsum(change_bt, axis=1)], axis=1
    ).astype(jnp.int32)


def causal_conv(x_btf: jax.Array, w_wf: jax.Array, run_bt: jax.Array) -> jax.Array:
    """SiLU(depthwise causal conv1d): `out_t = sum_s w[W-1-s] * x_{t-s}` over s within t's run."""
    width = w_wf.shape[0]
    out_btf = x_btf * w_wf[width - 1]
    for s in range(1, width):  # the kernel is 4 wide: a few shifted adds beat a general conv
        shifted_btf = jnp.pad(x_btf, ((0, 0), (s, 0), (0, 0)))[:, : x_btf.shape[1]]
        shifted_run_bt = jnp.pad(run_bt, ((0, 0), (s, 0)), constant_values=-1)[:, : run_bt.shape[1]]
        same_bt1 = (shifted_run_bt == run_bt)[..., None]
        out_btf = out_btf + jnp.where(same_bt1, shifted_btf, 0) * w_wf[width - 1 - s]
    return jax.nn.silu(out_btf)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x * rsqrt(sum x^2 + eps)` over the last axis, in float32 (as the FLA kernels do)."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def unit_lower_inverse(a_xcc: jax.Array) -> jax.Array:
    """`(I + A)^-1` for strictly lower-triangular `A [..., c, c]`, by blocked doubling.

    Diagonal blocks of size s are inverted from those of size s/2:
    `[[X1, 0], [L21, X2']]^-1 = [[X1^-1, 0], [-X2^-1 L21 X1^-1, X2^-1]]`, log2(c) rounds of
    batched matmuls (c padded to a power of two with identity rows). Not LAPACK's triangular
    solve: on XLA:CPU that custom call fans its batch out onto the intra-op thread pool and blocks
    the thread it runs on, so two devices' programs solving at once on a 2-thread pool deadlock.
    The explicit inverse is also what the FLA kernels compute (`solve_tril`).
    """
    *lead, c, _ = a_xcc.shape
    size = 1 << max(0, (c - 1).bit_length())
    m_xcc = jnp.pad(a_xcc, [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)])
    m_xcc = m_xcc + jnp.eye(size, dtype=a_xcc.dtype)
    inv = jnp.ones((*lead, size, 1, 1), a_xcc.dtype)  # [..., blocks, s, s], s = 1: unit diagonal
    s = 1
    while s < size:
        blocks = size // (2 * s)
        # The diagonal blocks of size 2s of I + A; their lower-left quarter couples the halves.
        m_xbrbr = m_xcc.reshape(*lead, blocks, 2 * s, blocks, 2 * s)
        diag_xb22 = jnp.diagonal(m_xbrbr, axis1=-4, axis2=-2)  # [..., 2s, 2s, blocks]
        low_xbss = jnp.moveaxis(diag_xb22, -1, -3)[..., s:, :s]
        pair = inv.reshape(*lead, blocks, 2, s, s)
        x1, x2 = pair[..., 0, :, :], pair[..., 1, :, :]
        off = -jnp.einsum("...ij,...jk,...kl->...il", x2, low_xbss, x1, precision=PRECISION)
        top = jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([off, x2], axis=-1)], axis=-2)
        s *= 2
    return inv.reshape(*lead, size, size)[..., :c, :c]


def chunked_gated_delta_rule(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    run_bt: jax.Array,
    chunk: int,
    state_bhkv: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over whole rows, `chunk` tokens at a time (static shapes); → (o, S).

    Per head, with state S [k, v]: `S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'^T k_t))^T`
    where `S' = exp(g_t) S_{t-1}`, and `o_t = S_t^T q_t`; S restarts at 0 where the run changes.
    Within a chunk the t updates are folded into one unit-lower-triangular solve (the WY/UT form
    of the DeltaNet paper); a scan carries S from chunk to chunk. q and k arrive normalized and
    q already scaled; heads of q/k are already repeated to the value heads. All in float32.

    A row's first run continues `state_bhkv` (zeros when None: training rows start afresh); the
    returned S is each row's state after its last token, of its last run. A token with g = 0 and
    beta = 0 neither decays nor writes S, which is how the server's padding keeps a slot's state.
    """
    b, t, h, dk = q_bthk.shape
    dv = v_bthv.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t
    f32 = jnp.float32

    def chunks(x: jax.Array) -> jax.Array:  # [b, t, h, ...] -> [b, h, n, c, ...]
        x = jnp.pad(x.astype(f32), ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v = chunks(q_bthk), chunks(k_bthk), chunks(v_bthv)
    g_bhnc, beta_bhnc = chunks(g_bth), chunks(beta_bth)
    # Padding up to whole chunks continues the last run with g = beta = k = 0: it comes after
    # every real token, so it reaches none of them, and it leaves the final state as it was.
    run_bnc = jnp.pad(run_bt, ((0, 0), (0, pad)), mode="edge").reshape(b, n, chunk)
    run_b1nc = run_bnc[:, None]
    same_b1ncc = run_b1nc[..., :, None] == run_b1nc[..., None, :]  # [.., i, j]
    causal_cc = jnp.tril(jnp.ones((chunk, chunk), bool))
    seen_b1ncc = same_b1ncc & causal_cc
    # Log-decay accumulated from the run's first token in this chunk up to i (a segmented cumsum).
    cum_bhnc = jnp.einsum(
        "bnij,bhnj->bhni", seen_b1ncc[:, 0].astype(f32), g_bhnc, precision=PRECISION
    )
    diff = cum_bhnc[..., :, None] - cum_bhnc[..., None, :]
    decay_bhncc = jnp.exp(jnp.where(seen_b1ncc, diff, -jnp.inf))  # exp(sum g_{j+1..i}), j <= i
    # Whether token i continues the run that the state entering this chunk belongs to (the
    # first chunk's entering state belongs to run 0, a row's first).
    entering_b1n = jnp.concatenate(
        [jnp.zeros((b, 1, 1), run_bnc.dtype), run_b1nc[:, :, :-1, -1]], axis=2
    )
    carried_b1nc = (run_b1nc == entering_b1n[..., None]).astype(f32)
    from_start_bhnc = jnp.exp(cum_bhnc) * carried_b1nc
    last_b1nc1 = run_b1nc == run_b1nc[..., -1:]
    to_end_bhnc = jnp.where(last_b1nc1, jnp.exp(cum_bhnc[..., -1:] - cum_bhnc), 0.0)
    chunk_decay_bhn = from_start_bhnc[..., -1]

    kb = k * beta_bhnc[..., None]
    vb = v * beta_bhnc[..., None]
    strict_cc = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    a_bhncc = jnp.einsum("bhnik,bhnjk->bhnij", kb, k, precision=PRECISION) * decay_bhncc * strict_cc
    # (I + A) u = beta v and (I + A) w = beta k decayed from the chunk start: the delta rule's
    # corrections within the chunk, resolved at once.
    inv_bhncc = unit_lower_inverse(a_bhncc)
    u = jnp.einsum("bhnij,bhnjv->bhniv", inv_bhncc, vb, precision=PRECISION)
    w = jnp.einsum(
        "bhnij,bhnjk->bhnik", inv_bhncc, kb * from_start_bhnc[..., None], precision=PRECISION
    )
    intra_bhncc = jnp.einsum("bhnik,bhnjk->bhnij", q, k, precision=PRECISION) * decay_bhncc
    q_read = q * from_start_bhnc[..., None]
    k_write = k * to_end_bhnc[..., None]

    def step(s_bhkv: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u_c, w_c, q_c, k_c, intra_c, decay_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s_bhkv, precision=PRECISION)
        o_c = jnp.einsum("bhck,bhkv->bhcv", q_c, s_bhkv, precision=PRECISION) + jnp.einsum(
            "bhij,bhjv->bhiv", intra_c, v_new, precision=PRECISION
        )
        s_bhkv = s_bhkv * decay_c[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", k_c, v_new, precision=PRECISION
        )
        return s_bhkv, o_c

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_read, k_write, intra_bhncc, chunk_decay_bhn))
    if state_bhkv is None:
        state_bhkv = jnp.zeros((b, h, dk, dv), f32)
    s_bhkv, o_nbhcv = jax.lax.scan(step, state_bhkv.astype(f32), xs)
    o_bthv = jnp.moveaxis(o_nbhcv, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(o_bthv, 1, 2), s_bhkv


def recurrent_gated_delta_rule(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    s_bhkv: jax.Array,
    keep_bt: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The same rule one token at a time from state `s_bhkv`, for decoding; returns (o, state).

    `keep_bt` is 1 where a token continues the sequence the state holds and 0 where one starts
    a new sequence (the state is dropped before that token).
    """
    f32 = jnp.float32

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, beta_t, keep_t = xs
        s = s * (jnp.exp(g_t) * keep_t[:, None])[..., None, None]
        read_bhv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=PRECISION)
        delta_bhv = (v_t - read_bhv) * beta_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta_bhv, precision=PRECISION)
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=PRECISION)

    xs = tuple(
        jnp.moveaxis(x.astype(f32), 1, 0)
        for x in (q_bthk, k_bthk, v_bthv, g_bth, beta_bth, keep_bt)
    )
    s_bhkv, o_tbhv = jax.lax.scan(step, s_bhkv.astype(f32), xs)
    return jnp.moveaxis(o_tbhv, 0, 1), s_bhkv


def conv_step(
    x_btf: jax.Array, w_wf: jax.Array, conv_bwf: jax.Array, positions_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`causal_conv` continuing from each row's cached last `w - 1` inputs; → (out, new cache).

    A row's real tokens come first, padding (position -1) after them. A row whose first position
    is 0 starts afresh (its cached inputs read as the zeros before a sequence); an all-padding
    row keeps its cache.
    """
    keep = w_wf.shape[0] - 1
    ext_btf = jnp.concatenate([conv_bwf.astype(x_btf.dtype), x_btf], axis=1)
    cached_run_b = jnp.where(positions_bt[:, 0] != 0, 0, -1)
    ext_run_bt = jnp.concatenate(
        [
            jnp.broadcast_to(cached_run_b[:, None], (x_btf.shape[0], keep)),
            jnp.where(positions_bt >= 0, 0, 1),
        ],
        axis=1,
    )
    out_btf = causal_conv(ext_btf, w_wf, ext_run_bt)[:, keep:]
    live_btf = jnp.where((ext_run_bt == 0)[..., None], ext_btf, 0)
    real_b = jnp.sum(positions_bt >= 0, axis=1)
    new_bwf = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, keep, axis=0))(
        live_btf, real_b
    )
    return out_btf, new_bwf
