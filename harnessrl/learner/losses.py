"""Learner stage: policy-gradient losses over packed micro-batches.

In: float32 logits `[b, t, v]` from the decoder and the training arrays of one micro-batch (aligned
to the TARGET token, see `harnessrl.data.pack`). Out: the weighted loss sum
`sum(token_weights * per_token_loss)` and metric sums that add up across micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

# Metric sums a micro-step returns; `finalize_metrics` turns them into step-level means.
METRIC_KEYS: tuple[str, ...] = (
    "loss",  # sum(token_weights * per_token_loss): the step loss once summed over micro-batches
    "tokens",  # trained tokens (loss_mask sum)
    "logprob",  # learner log-likelihood of the trained tokens
    "entropy",  # learner entropy at the trained positions
    "clip_frac",  # tokens whose PPO clip branch is active
    "tis_frac",  # tokens whose importance ratio hit the truncation cap
    "ratio",  # importance ratio pi_learner / pi_behavior
    "behavior_kl",  # k3 estimate of KL(behavior || learner): server/learner mismatch and staleness
    "ref_kl",  # k3 estimate of KL(learner || reference); 0 when no reference is used
)
# Largest |log ratio| fed to exp: keeps a wild behavior logprob from producing inf * 0 = nan.
MAX_LOG_RATIO = 20.0

Batch = Mapping[str, jax.Array]
TokenLossFn = Callable[[jax.Array, Batch, jax.Array | None], tuple[jax.Array, dict[str, jax.Array]]]


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token log p(token t | tokens < t) and entropy of that distribution, target-aligned.

    The logits at position t-1 predict token t, so column 0 (a segment start, loss_mask 0 by
    contract) gets 0. Packed rows need nothing special: a segment's first token is never trained.
    """
    # Row t scores token t+1; the last row's wrapped-around target is dropped below. Shifting the
    # [b, t] ids and results instead of slicing the logits avoids copying a [b, t, vocab] array.
    next_bt = jnp.roll(tokens_bt, -1, axis=1)
    logp_bt, entropy_bt = _next_token_stats(logits_btv.astype(jnp.float32), next_bt)
    pad = jnp.zeros_like(logp_bt[:, :1])
    return (
        jnp.concatenate([pad, logp_bt[:, :-1]], axis=1),
        jnp.concatenate([pad, entropy_bt[:, :-1]], axis=1),
    )


@jax.custom_vjp
def _next_token_stats(logits_btv: jax.Array, next_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log p(next) and the entropy at every position, from one exp over the vocabulary.

    Written with its own VJP because autodiff of logsumexp plus the entropy recomputes the
    exponentials for every reduction and again for the gradient; on XLA's CPU backend that made
    the loss over a 49k vocabulary cost as much as 5 transformer layers. Here the forward pass
    keeps `exp(logits - max)` and the backward pass is one elementwise sweep.
    """
    return _stats_fwd(logits_btv, next_bt)[0]


def _stats_fwd(logits_btv: jax.Array, next_bt: jax.Array) -> tuple[tuple, tuple]:
    max_bt1 = jnp.max(logits_btv, axis=-1, keepdims=True)
    exp_btv = jnp.exp(logits_btv - max_bt1)
    sum_bt = jnp.sum(exp_btv, axis=-1)
    lse_bt = max_bt1[..., 0] + jnp.log(sum_bt)
    mean_logit_bt = jnp.sum(exp_btv * logits_btv, axis=-1) / sum_bt  # E_p[logit]
    entropy_bt = lse_bt - mean_logit_bt
    target_bt = jnp.take_along_axis(logits_btv, next_bt[..., None], axis=-1)[..., 0]
    residuals = (logits_btv, exp_btv, sum_bt, mean_logit_bt, next_bt)
    return (target_bt - lse_bt, entropy_bt), residuals


def _stats_bwd(residuals: tuple, grads: tuple) -> tuple[jax.Array, None]:
    logits_btv, exp_btv, sum_bt, mean_logit_bt, next_bt = residuals
    g_logp_bt, g_entropy_bt = grads
    probs_btv = exp_btv / sum_bt[..., None]
    # d logp / d logit_i = onehot_i - p_i;  d entropy / d logit_i = -p_i (logit_i - E_p[logit]).
    d_btv = -probs_btv * (
        g_logp_bt[..., None] + g_entropy_bt[..., None] * (logits_btv - mean_logit_bt[..., None])
    )
    onehot_btv = jnp.arange(logits_btv.shape[-1]) == next_bt[..., None]
    return d_btv + jnp.where(onehot_btv, g_logp_bt[..., None], 0.0), None


_next_token_stats.defvjp(_stats_fwd, _stats_bwd)


def k3_kl(logp_bt: jax.Array, other_bt: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(p || other) from samples of p: exp(d) - d - 1, d = other - p."""
    delta_bt = jnp.clip(other_bt - logp_bt, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(delta_bt) - delta_bt - 1.0


def ppo_clip_tis(
    logp_bt: jax.Array,
    behavior_bt: jax.Array,
    adv_bt: jax.Array,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """PPO clipped surrogate against the behavior policy, with truncated importance sampling.

    ratio r = pi/mu (mu: the server that sampled). Surrogate max(-A r, -A clip(r, 1-eps_low,
    1+eps_high)), scaled by the detached factor min(1, cap / r): the gradient's importance weight
    never exceeds `cap`, which bounds negative-advantage tokens that the clip leaves open (mu far
    below pi from a stale or numerically different server). Returns (loss, clipped, truncated, r).
    """
    log_ratio_bt = jnp.clip(logp_bt - behavior_bt, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_bt = jnp.exp(log_ratio_bt)
    unclipped_bt = -adv_bt * ratio_bt
    clipped_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - eps_low, 1.0 + eps_high)
    surrogate_bt = jnp.maximum(unclipped_bt, clipped_bt)
    ratio_sg_bt = jax.lax.stop_gradient(ratio_bt)
    truncation_bt = jnp.minimum(1.0, tis_cap / ratio_sg_bt)
    return (
        surrogate_bt * truncation_bt,
        (clipped_bt > unclipped_bt).astype(jnp.float32),
        (ratio_sg_bt > tis_cap).astype(jnp.float32),
        ratio_sg_bt,
    )


def make_token_loss(
    eps_low: float, eps_high: float, tis_cap: float, kl_coef: float, entropy_coef: float
) -> TokenLossFn:
    """Build `loss(logits, batch, ref_logits) -> (loss_sum, metric_sums)` for fixed coefficients.

    Terms with a zero coefficient are left out of the traced program (chosen here, outside jit),
    so a disabled KL or entropy bonus costs neither a reference forward nor a backward pass.
    """
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low=}, {eps_high=}")
    if not tis_cap > 1.0 + eps_high:
        raise ValueError(
            f"tis_cap={tis_cap} must exceed 1 + eps_high={1.0 + eps_high} (use inf to disable), "
            "or truncation would cut inside the PPO trust region"
        )
    if kl_coef < 0.0 or entropy_coef < 0.0:
        raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef=}, {entropy_coef=}")

    def loss_fn(
        logits_btv: jax.Array, batch: Batch, ref_logits_btv: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        mask_bt = batch["loss_mask"]
        logp_bt, entropy_bt = token_logprobs(logits_btv, batch["tokens"])
        behavior_bt = batch["behavior_logprobs"]
        # Untrained positions (padding, prompts) may carry any behavior value; pin them to logp.
        behavior_bt = jnp.where(mask_bt > 0, behavior_bt, jax.lax.stop_gradient(logp_bt))
        pg_bt, clipped_bt, truncated_bt, ratio_bt = ppo_clip_tis(
            logp_bt, behavior_bt, batch["advantages"], eps_low, eps_high, tis_cap
        )
        per_token_bt = pg_bt
        ref_kl_bt = jnp.zeros_like(logp_bt)
        if ref_logits_btv is not None:
            ref_logp_bt, _ = token_logprobs(ref_logits_btv, batch["tokens"])
            ref_kl_bt = k3_kl(logp_bt, jax.lax.stop_gradient(ref_logp_bt))
            per_token_bt = per_token_bt + kl_coef * ref_kl_bt
        if entropy_coef:
            per_token_bt = per_token_bt - entropy_coef * entropy_bt
        loss = jnp.sum(batch["token_weights"] * per_token_bt)
        sg = jax.lax.stop_gradient
        metrics = {
            "loss": sg(loss),
            "tokens": jnp.sum(mask_bt),
            "logprob": jnp.sum(mask_bt * sg(logp_bt)),
            "entropy": jnp.sum(mask_bt * sg(entropy_bt)),
            "clip_frac": jnp.sum(mask_bt * clipped_bt),
            "tis_frac": jnp.sum(mask_bt * truncated_bt),
            "ratio": jnp.sum(mask_bt * ratio_bt),
            "behavior_kl": jnp.sum(mask_bt * k3_kl(behavior_bt, sg(logp_bt))),
            "ref_kl": jnp.sum(mask_bt * sg(ref_kl_bt)),
        }
        return loss, metrics

    return loss_fn


def zero_metrics() -> dict[str, jax.Array]:
    return {key: jnp.zeros((), jnp.float32) for key in METRIC_KEYS}


def finalize_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Step-level figures: `loss` and `tokens` as sums, the rest as means over trained tokens."""
    tokens = float(sums["tokens"])
    out = {"loss": float(sums["loss"]), "tokens": tokens}
    for key in METRIC_KEYS:
        if key not in out:
            out[key] = float(sums[key]) / tokens if tokens else 0.0
    return out
