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
    logits_btv = logits_btv[:, :-1].astype(jnp.float32)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_bt = jnp.take_along_axis(logits_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    probs_btv = jnp.exp(logits_btv - lse_bt[..., None])
    entropy_bt = lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)
    pad = jnp.zeros_like(lse_bt[:, :1])
    return (
        jnp.concatenate([pad, target_bt - lse_bt], axis=1),
        jnp.concatenate([pad, entropy_bt], axis=1),
    )


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
