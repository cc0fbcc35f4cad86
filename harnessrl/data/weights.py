"""Per-token loss weights with the step-wide normalization folded in.

In: every sequence of one optimizer step (with its run id and loss mask). Out: one float32 weight
array per sequence, 0 where the mask is 0, so the learner's loss is a plain weighted sum and
switching modes never changes the compiled program.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from harnessrl.data.merge import MergedSequence


class LossMode(enum.StrEnum):
    TOKEN_MEAN = "token_mean"  # every sampled token of the step weighs the same; sum = 1
    SEQUENCE_MEAN = "sequence_mean"  # every sequence sums to 1/S (token mean inside it); sum = 1
    RUN_MEAN = "run_mean"  # every run sums to 1/R whatever its number of sequences; sum = 1
    CONSTANT = "constant"  # every token weighs 1/C (Dr.GRPO); sum = sampled tokens / C


def token_weights(
    sequences: Sequence[MergedSequence],
    mode: LossMode | str = LossMode.TOKEN_MEAN,
    *,
    constant: float = 1024.0,
) -> list[np.ndarray]:
    """Weights for all sequences of one step; denominators span the whole step.

    `run_mean` averages tokens within a run (its sequences share the run's 1/R by token count), so
    a run that broke into many sequences gets no more say than a run that stayed one sequence.
    """
    try:
        m = LossMode(mode)
    except ValueError as err:
        raise ValueError(
            f"loss mode must be one of {[x.value for x in LossMode]}, got {mode!r}"
        ) from err
    if m == LossMode.CONSTANT and not constant > 0:
        raise ValueError(f"constant normalizer must be > 0, got {constant}")
    masks = [s.loss_mask.astype(np.float32) for s in sequences]
    counts = [float(s.num_sampled) for s in sequences]
    if any(c == 0 for c in counts):
        raise ValueError("token_weights: every sequence needs at least one sampled token")
    if m == LossMode.TOKEN_MEAN:
        total = sum(counts)
        return [mask / np.float32(total) for mask in masks]
    if m == LossMode.SEQUENCE_MEAN:
        n_seq = len(sequences)
        return [mask / np.float32(c * n_seq) for mask, c in zip(masks, counts, strict=True)]
    if m == LossMode.RUN_MEAN:
        run_tokens: dict[str, float] = defaultdict(float)
        for s, c in zip(sequences, counts, strict=True):
            run_tokens[s.rollout_id] += c
        n_runs = len(run_tokens)
        return [
            mask / np.float32(run_tokens[s.rollout_id] * n_runs)
            for mask, s in zip(masks, sequences, strict=True)
        ]
    return [mask / np.float32(constant) for mask in masks]
