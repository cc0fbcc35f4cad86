"""Shared builders for the learner tests: a tiny decoder and random packed steps.

Imported by the tests and by the subprocess scripts beside them (multi-device, multi-process,
kill-and-resume), so every process builds bit-identical models and batches from a seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from harnessrl.data.pack import PackedBatch, PackItem, pack_items
from harnessrl.learner import losses
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.params import gather_to_host
from harnessrl.learner.step import Learner
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder

# Rows are multiples of 8 so every 8-device mesh can split them over (data, fsdp).
BUCKETS: tuple[tuple[int, int], ...] = ((8, 32), (8, 64), (8, 128))
MAX_SEGMENTS = 16
VOCAB = 128
EPS32 = float(np.finfo(np.float32).eps)
# A learner whose optimizer state, after a step, holds that step's gradient (`step_gradient`).
GRADIENT_PROBE = LearnerConfig(b1=0.0, grad_clip_norm=math.inf)


def tiny_model(seed: int = 0) -> Decoder:
    # Every sharded dimension divides 8 (fsdp) and 2 (tensor), so no rule falls back to replication.
    cfg = ModelConfig.tiny(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def random_items(rng: np.random.Generator, count: int, max_len: int = 120) -> list[PackItem]:
    """`count` sequences: a prompt (mask 0) then sampled tokens with behavior logprobs."""
    items = []
    for _ in range(count):
        n = int(rng.integers(2, max_len + 1))
        prompt = int(rng.integers(1, n))
        mask = np.zeros(n, bool)
        mask[prompt:] = True
        items.append(
            PackItem(
                tokens=rng.integers(0, VOCAB, n).astype(np.int32),
                loss_mask=mask,
                logprobs=(np.log(1.0 / VOCAB) + rng.normal(0, 0.3, n)).astype(np.float32),
                weights=np.ones(n, np.float32),
                advantage=float(rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5)),
            )
        )
    # Token-mean normalization over the whole step, as the data layer does.
    total = sum(int(it.loss_mask.sum()) for it in items)
    return [
        PackItem(it.tokens, it.loss_mask, it.logprobs, it.weights / total, it.advantage)
        for it in items
    ]


def random_step(seed: int, count: int, buckets=BUCKETS) -> list[PackedBatch]:
    rng = np.random.default_rng(seed)
    max_len = min(120, max(length for _, length in buckets))
    return pack_items(random_items(rng, count, max_len), buckets, MAX_SEGMENTS).batches


def rows_of(batch: PackedBatch, index: int, count: int) -> PackedBatch:
    """Process `index` of `count`: its contiguous block of rows of a global micro-batch."""
    rows = batch.tokens.shape[0] // count
    return PackedBatch(
        **{k: v[index * rows : (index + 1) * rows] for k, v in batch.as_dict().items()}
    )


def step_gradient(learner: Learner, batches: Sequence[PackedBatch]) -> tuple[dict, Any]:
    """One `train_step`, then the float32 gradient it applied, read back from the optimizer.

    AdamW's first moment after a step is `(1 - b1) * g + b1 * mu`: with b1 = 0 and no clipping
    (`GRADIENT_PROBE`) it is exactly the accumulated gradient the step fed the optimizer.
    """
    if learner.cfg.b1 != 0.0 or math.isfinite(learner.cfg.grad_clip_norm):
        raise ValueError("step_gradient needs a learner built with b1=0 and grad_clip_norm=inf")
    metrics = learner.train_step(batches)
    return metrics, gather_to_host(optax.tree.get(learner.opt_state, "mu"))


def policy_logprobs(learner: Learner, batch: PackedBatch) -> np.ndarray:
    """Per-token logprobs of the learner's current policy on `batch`, as its loss computes them
    (the training forward of its own model graph, then `losses.token_logprobs`)."""

    def logprobs(params: Any, arrays: dict[str, jax.Array]) -> jax.Array:
        model = learner.parts.merge(params)
        logits = model(arrays["tokens"], arrays["positions"], arrays["segment_ids"])
        return losses.token_logprobs(logits, arrays["tokens"])[0]

    return np.asarray(jax.jit(logprobs)(learner.params, batch.as_dict()))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def reorder_tolerance(scale: float, batches: Sequence[PackedBatch], layers: int = 2) -> float:
    """Largest gap between two float32 evaluations of one step that differ only in sum order.

    Micro-batch splits, sharded all-reduces, a scanned vs an unrolled layer loop and a second
    process all reorder the same float32 sums. Random-walk model: an n-term sum errs by
    ~sqrt(n)*eps relative to its terms' scale; a weight gradient (and the loss) sums over every
    token slot of the step, n = sum of rows x length; each of the `layers` layers adds its error;
    two evaluations differ by at most both errors (x2), and the model is typical-case (x2):
    4*L*sqrt(n)*eps*scale. A real bug (a dropped micro-batch or shard, a missing all-reduce,
    a wrong weight) moves results by a sizeable fraction of `scale`, not by ulps.
    """
    terms = sum(int(np.asarray(b.tokens).size) for b in batches)
    return 4.0 * layers * math.sqrt(terms) * EPS32 * scale


def loss_scale(batches: Sequence[PackedBatch], cfg: LearnerConfig) -> float:
    """An upper bound on sum |per-token loss|, the scale the loss's rounding is relative to.

    The step loss is a signed sum (advantages of both signs cancel), so its own magnitude is no
    yardstick. Each PPO-TIS term is -A*r*min(1, cap/r) or -A*clip(r)*min(1, cap/r), at most
    |w*A|*max(tis_cap, 1 + eps_high) in size (valid with kl_coef = entropy_coef = 0).
    """
    if cfg.kl_coef or cfg.entropy_coef or math.isinf(cfg.tis_cap):
        raise ValueError("loss_scale needs kl_coef=0, entropy_coef=0 and a finite tis_cap")
    weight = sum(float(np.sum(np.abs(b.token_weights * b.advantages))) for b in batches)
    return weight * max(cfg.tis_cap, 1.0 + cfg.eps_high)
