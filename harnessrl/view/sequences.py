"""A rollout's calls as the learner sees them: merged sequences, break diagnoses, advantage, weight.

In: one rollout's `CallRecord`s, the records of its group and the run's `DataConfig`. Out:
`MergedView` with each sequence's tokens as ready HTML (loss-mask classes, a logprob heat class
per sampled token), the merge breaks with their cause and the diverging ids side by side.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from markupsafe import Markup

from harnessrl.data.advantages import compute_advantages
from harnessrl.data.merge import MergedSequence, MergeStats, merge_calls
from harnessrl.data.pipeline import DataConfig
from harnessrl.data.weights import token_weights
from harnessrl.traces.schema import CallRecord, RolloutRecord

# Upper logprob edges of the heat classes h0 (sure) .. h7 (unlikely) of sampled tokens.
HEAT_EDGES = np.array([-8.0, -4.0, -2.0, -1.0, -0.5, -0.25, -0.05])
HEAT_CLASSES = len(HEAT_EDGES) + 1


@dataclass(frozen=True)
class SequenceView:
    index: int
    call_seqs: tuple[int, ...]
    length: int
    sampled: int
    policy_version: int | None
    weight: float  # per trained token, normalized over this run alone
    mean_logprob: float | None
    html: Markup


@dataclass(frozen=True)
class BreakView:
    call_seq: int
    position: int
    cause: str
    detail: str
    pairs: list[tuple[str, str, bool]]  # (previous id, new id, differ) from the break on


@dataclass(frozen=True)
class MergedView:
    sequences: list[SequenceView]
    breaks: list[BreakView]
    stats: MergeStats
    advantage: float | None
    excluded: str | None  # why the run trains with no advantage this step
    loss_mode: str


def heat_class(logprobs: np.ndarray) -> np.ndarray:
    """0 for logprobs near 0 up to 7 for the least likely sampled tokens."""
    found: np.ndarray = HEAT_CLASSES - 1 - np.digitize(logprobs, HEAT_EDGES, right=True)
    return found


def tokens_html(seq: MergedSequence, decode: Callable[[int], str] | None = None) -> Markup:
    """Context tokens as runs of class `c`, each sampled token as class `s` with its heat class.

    Without `decode` the ids are shown, space-separated; with it, the token texts run together
    (the page keeps their whitespace). Ids are ints and text is escaped: never markup.
    """
    ids = seq.tokens.tolist()
    mask = seq.loss_mask.tolist()
    heat = heat_class(seq.logprobs).tolist()
    lps = seq.logprobs.tolist()
    sep = " " if decode is None else ""

    def shown(i: int) -> str:
        return str(ids[i]) if decode is None else html.escape(decode(ids[i]))

    parts: list[str] = []
    run: list[str] = []
    for i, trained in enumerate(mask):
        if not trained:
            run.append(shown(i))
            continue
        if run:
            parts.append(f'<span class="c">{sep.join(run)}</span>')
            run = []
        tip = f"id {ids[i]} lp {lps[i]:.3f}"
        parts.append(f'<span class="s h{heat[i]}" title="{tip}">{shown(i)}</span>')
    if run:
        parts.append(f'<span class="c">{sep.join(run)}</span>')
    return Markup(sep.join(parts))


def merged_view(
    rollout: RolloutRecord,
    calls: Sequence[CallRecord],
    group: Sequence[RolloutRecord],
    cfg: DataConfig,
    decode: Callable[[int], str] | None = None,
) -> MergedView:
    result = merge_calls(calls)
    adv = compute_advantages(
        group,
        estimator=cfg.estimator,
        std_normalize=cfg.std_normalize,
        eps=cfg.adv_eps,
        drop_zero_variance=cfg.drop_zero_variance,
        include_failed=cfg.include_failed,
        failed_reward=cfg.failed_reward,
    )
    seqs = result.sequences
    weights = token_weights(seqs, cfg.loss_mode, constant=cfg.constant_normalizer) if seqs else []
    views = []
    for i, (s, w) in enumerate(zip(seqs, weights, strict=True)):
        sampled = s.logprobs[s.loss_mask]
        views.append(
            SequenceView(
                i,
                s.call_seqs,
                len(s.tokens),
                s.num_sampled,
                s.policy_version,
                float(w[s.loss_mask][0]),
                float(sampled.mean()) if sampled.size else None,
                tokens_html(s, decode),
            )
        )
    breaks = [
        BreakView(
            b.call_seq,
            b.position,
            str(b.cause),
            b.detail,
            _pairs(b.previous_ids, b.new_ids),
        )
        for b in result.breaks
    ]
    rid = rollout.rollout_id
    return MergedView(
        views,
        breaks,
        result.stats,
        adv.advantages.get(rid),
        adv.excluded.get(rid),
        str(cfg.loss_mode),
    )


def _pairs(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[str, str, bool]]:
    n = max(len(old), len(new))
    out = []
    for i in range(n):
        a = str(old[i]) if i < len(old) else ""
        b = str(new[i]) if i < len(new) else ""
        out.append((a, b, a != b))
    return out
