from __future__ import annotations

import numpy as np
import pytest

from harnessrl.data.merge import MergedSequence
from harnessrl.data.weights import token_weights


def _seq(rollout_id: str, sampled: int, context: int = 2) -> MergedSequence:
    mask = np.array([False] * context + [True] * sampled)
    n = mask.size
    return MergedSequence(
        rollout_id, np.arange(n, dtype=np.int32), mask, np.zeros(n, np.float32), (0,)
    )


SEQS = [_seq("a", 4), _seq("a", 2), _seq("a", 6), _seq("b", 3)]


def _per_run(weights):
    out: dict[str, float] = {}
    for s, w in zip(SEQS, weights, strict=True):
        out[s.rollout_id] = out.get(s.rollout_id, 0.0) + float(w.sum())
    return out


def test_token_mean_gives_every_sampled_token_the_same_weight():
    w = token_weights(SEQS, "token_mean")
    assert np.concatenate(w)[np.concatenate([s.loss_mask for s in SEQS])] == pytest.approx(1 / 15)
    assert sum(x.sum() for x in w) == pytest.approx(1.0)


def test_sequence_mean_gives_every_sequence_the_same_total():
    w = token_weights(SEQS, "sequence_mean")
    assert [x.sum() for x in w] == pytest.approx([0.25] * 4)


def test_run_mean_gives_every_run_the_same_total_whatever_its_sequence_count():
    w = token_weights(SEQS, "run_mean")
    assert _per_run(w) == pytest.approx({"a": 0.5, "b": 0.5})
    assert w[0][2] == w[1][2]  # tokens inside a run are averaged evenly


def test_constant_divides_by_the_fixed_normalizer():
    w = token_weights(SEQS, "constant", constant=100.0)
    sampled = sum(s.num_sampled for s in SEQS)  # `constant`: sampled tokens / C
    assert sum(x.sum() for x in w) == pytest.approx(sampled / 100.0) == 0.15


def test_weights_are_zero_off_the_mask_and_float32():
    for mode in ("token_mean", "sequence_mean", "run_mean", "constant"):
        for s, w in zip(SEQS, token_weights(SEQS, mode), strict=True):
            assert w.dtype == np.float32 and not w[~s.loss_mask].any()


def test_bad_mode_constant_and_empty_sequences_raise():
    with pytest.raises(ValueError, match="loss mode"):
        token_weights(SEQS, "mean")
    with pytest.raises(ValueError, match="constant"):
        token_weights(SEQS, "constant", constant=0.0)
    with pytest.raises(ValueError, match="sampled token"):
        token_weights([_seq("a", 0)], "token_mean")
    assert token_weights([], "token_mean") == []
