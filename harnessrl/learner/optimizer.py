"""Learner stage: the optimizer (optax AdamW with global-norm clipping and an LR schedule).

In: a `LearnerConfig`. Out: an `optax.GradientTransformation` and the schedule it follows, plus
the shardings of its state laid out like the params it updates.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harnessrl.learner.config import LearnerConfig


def make_schedule(cfg: LearnerConfig) -> optax.Schedule:
    """Linear warmup from 0, then constant or cosine decay to `min_lr_ratio * learning_rate`."""
    peak = cfg.learning_rate
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.total_steps,
            end_value=peak * cfg.min_lr_ratio,
        )
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, cfg.warmup_steps), optax.constant_schedule(peak)],
        boundaries=[cfg.warmup_steps],
    )


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        weight_decay=cfg.weight_decay,
        mu_dtype="float32",  # keep the first moment precise when params are bf16
    )
    if math.isinf(cfg.grad_clip_norm):
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)


def opt_state_shardings(
    optimizer: optax.GradientTransformation, abstract_params: Any, param_shardings: Any, mesh: Mesh
) -> Any:
    """Moments shard exactly like their params; counters and other scalars are replicated."""
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
