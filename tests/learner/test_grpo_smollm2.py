from __future__ import annotations

import os

import numpy as np
import pytest
from tinylearn import policy_logprobs

from harnessrl.data.pack import PackItem, pack_items
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.step import Learner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("HARNESSRL_SLOW") != "1",
        reason="one GRPO step on SmolLM2-135M takes ~1-2 min on 2 CPU cores; set HARNESSRL_SLOW=1",
    ),
]

PROMPT = "What is 7 + 5? Answer with just the number."
GOOD = ["12", "The answer is 12."]
BAD = ["13", "I am not sure, maybe 75."]


def _group(tokenizer):
    """A fixed GRPO group: two correct answers (advantage +1) and two wrong ones (-1)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    items, signs = [], []
    for text, adv in [(t, 1.0) for t in GOOD] + [(t, -1.0) for t in BAD]:
        completion = [*tokenizer.encode(text), tokenizer.eos_token_ids[0]]
        tokens = np.asarray(prompt + completion, np.int32)
        mask = np.zeros(len(tokens), bool)
        mask[len(prompt) :] = True
        items.append(
            PackItem(
                tokens,
                mask,
                np.zeros(len(tokens), np.float32),
                np.ones(len(tokens), np.float32),
                adv,
            )
        )
        signs.append(adv)
    total = sum(int(it.loss_mask.sum()) for it in items)
    items = [
        PackItem(it.tokens, it.loss_mask, it.logprobs, it.weights / total, it.advantage)
        for it in items
    ]
    return items, np.asarray(signs)


def _sequence_loglik(learner, batch, placements):
    logp = policy_logprobs(learner, batch)
    return np.array(
        [
            float(np.sum((logp[r] * batch.loss_mask[r])[off : off + n]))
            for _, r, off, n in placements
        ]
    )


def test_one_grpo_step_moves_likelihood_with_the_advantage_sign():
    from harnessrl.model.formats.load import load_model

    loaded = load_model("smollm2")
    learner = Learner(loaded.model, LearnerConfig(learning_rate=1e-5))
    items, signs = _group(loaded.tokenizer)
    longest = max(len(it.tokens) for it in items)
    bucket = (4, int(np.ceil(longest / 16) * 16))
    packed = pack_items(items, [bucket], max_segments=1)
    (batch,) = packed.batches
    before = _sequence_loglik(learner, batch, packed.placements)
    # On-policy: the behavior logprobs are the model's own, as a server running it would report.
    batch = type(batch)(**{**batch.as_dict(), "behavior_logprobs": policy_logprobs(learner, batch)})
    metrics = learner.train_step([batch])
    after = _sequence_loglik(learner, batch, packed.placements)
    assert metrics["clip_frac"] == 0.0 and np.isfinite(metrics["loss"])
    delta = after - before
    assert (delta[signs > 0] > 0).all(), delta
    assert (delta[signs < 0] < 0).all(), delta
