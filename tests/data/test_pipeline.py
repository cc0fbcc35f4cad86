from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_factory import GeneratedRun, agent_step, make_call, make_run
from unpacking import unpack_items

from harnessrl.data.merge import merge_calls
from harnessrl.data.pack import PackItem, pack_items
from harnessrl.data.pipeline import DataConfig, StepTraces, build_step, read_traces
from harnessrl.data.plan import Bucket
from harnessrl.data.weights import token_weights
from harnessrl.traces.schema import RolloutState

SMALL = ((4, 16), (2, 32))  # forces splitting of the longer generated sequences


def _traces(runs: list[GeneratedRun]) -> StepTraces:
    return StepTraces([g.run for g in runs], {g.run.rollout_id: g.calls for g in runs})


def _trained(batches) -> tuple[np.ndarray, np.ndarray]:
    """(logprobs, weights) at every mask-1 slot of every micro-batch."""
    lps = [b.behavior_logprobs[b.loss_mask > 0] for b in batches]
    ws = [b.token_weights[b.loss_mask > 0] for b in batches]
    return np.concatenate(lps or [np.zeros(0)]), np.concatenate(ws or [np.zeros(0)])


@settings(max_examples=40, deadline=None)
@given(agent_step(), st.sampled_from(["token_mean", "sequence_mean", "run_mean", "constant"]))
def test_every_sampled_token_is_trained_exactly_once_and_weights_sum_as_defined(runs, mode):
    cfg = DataConfig(
        buckets=SMALL,
        split_overlap=4,
        loss_mode=mode,
        drop_zero_variance=False,
        constant_normalizer=50.0,
    )
    batch = build_step(0, _traces(runs), cfg)
    assert {b.shape for b in batch.micro_batches} <= set(SMALL)
    expected = {lp: rid for g in runs for lp, rid in g.sampled.items()}
    lps, ws = _trained(batch.micro_batches)
    assert sorted(lps.tolist()) == sorted(expected)  # each exactly once, nothing else
    total = {"constant": len(expected) / 50.0}.get(mode, 1.0 if expected else 0.0)
    # Each weight is one float32 division of 1 by an exact integer (<= eps/2 relative) and the
    # packer only copies it, so a float64 sum is within eps/2 of the definition; rel = 2 eps.
    rel = 2 * float(np.finfo(np.float32).eps)
    assert float(ws.sum(dtype=np.float64)) == pytest.approx(total, rel=rel)
    if mode == "run_mean" and expected:
        per_run: dict[str, float] = defaultdict(float)
        for lp, w in zip(lps.tolist(), ws.tolist(), strict=True):
            per_run[expected[lp]] += w
        assert list(per_run.values()) == pytest.approx([1.0 / len(per_run)] * len(per_run), rel=rel)
    advantages = np.concatenate(
        [b.advantages[b.segment_ids > 0] for b in batch.micro_batches] or [np.zeros(0)]
    )
    assert np.isfinite(advantages).all()


@settings(max_examples=20, deadline=None)
@given(agent_step(), st.integers(2, 4))
def test_data_parallel_shards_run_the_same_micro_steps(runs, count):
    cfg = DataConfig(buckets=SMALL, split_overlap=4, drop_zero_variance=False)
    whole = build_step(0, _traces(runs), cfg)
    shards = [
        build_step(0, _traces(runs), cfg, process_index=i, process_count=count)
        for i in range(count)
    ]
    assert len({tuple(b.shape for b in s.micro_batches) for s in shards}) == 1
    lps = np.concatenate([_trained(s.micro_batches)[0] for s in shards])
    assert sorted(lps.tolist()) == sorted(_trained(whole.micro_batches)[0].tolist())
    n_real = sum(s.stats.micro_batches - s.stats.padding_micro_batches for s in shards)
    assert n_real == whole.stats.micro_batches


def test_run_mean_equalizes_a_run_that_broke_into_many_sequences():
    many = [make_call("many", i, [100 + i, 1, 2], [[3, 4, 5, 6]]) for i in range(5)]  # 5 contexts
    one = [make_call("one", 0, [1, 2], [[3]])]
    traces = StepTraces(
        [make_run("many", "g", 1.0), make_run("one", "g", 0.0)], {"many": many, "one": one}
    )
    batch = build_step(0, traces, DataConfig(loss_mode="run_mean"))
    assert batch.stats.merge.sequences == 6 and batch.stats.break_causes == {"other": 4}
    (mb,) = batch.micro_batches
    adv = mb.advantages[mb.loss_mask > 0]
    w = mb.token_weights[mb.loss_mask > 0]
    assert w[adv > 0].sum() == pytest.approx(0.5) and w[adv < 0].sum() == pytest.approx(0.5)


def test_failed_runs_excluded_and_budget_drops_whole_runs():
    calls = {f"r{i}": [make_call(f"r{i}", 0, [1, 2, 3], [[4] * 10])] for i in range(4)}
    runs = [make_run("r0", "g", 1.0), make_run("r1", "g", 0.0), make_run("r2", "g", 0.5)]
    runs.append(make_run("r3", "g", None, RolloutState.FAILED))
    batch = build_step(0, StepTraces(runs, calls), DataConfig(step_token_budget=30))
    assert batch.stats.excluded == {"failed": 1}
    assert batch.stats.over_budget_runs == 1 and batch.stats.runs_trained == 2
    assert sum(b.num_tokens for b in batch.micro_batches) == 26  # two whole runs of 13


def test_truncate_policy_counts_what_it_cuts():
    calls = {
        "a": [make_call("a", 0, [1] * 20, [[2] * 30])],
        "b": [make_call("b", 0, [1, 2], [[3]])],
    }
    runs = [make_run("a", "g", 1.0), make_run("b", "g", 0.0)]
    batch = build_step(
        0, StepTraces(runs, calls), DataConfig(buckets=((2, 32),), length_policy="truncate")
    )
    assert (
        batch.stats.merge.truncated_sequences == 1
        and batch.stats.merge.truncated_sampled_tokens == 18
    )
    assert batch.stats.split_sequences == 0


def _step_traces(step: int) -> StepTraces:
    rewards = [1.0, 0.0, float(step % 2)]
    runs = [make_run(f"s{step}-{k}", f"s{step}", r) for k, r in enumerate(rewards)]
    calls = {
        r.rollout_id: [make_call(r.rollout_id, 0, [7, step + 1], [[3] * (k + 2)])]
        for k, r in enumerate(runs)
    }
    return StepTraces(runs, calls)


def test_a_step_is_sharded_by_process():
    traces = _step_traces(0)
    shards = [
        build_step(
            0,
            traces,
            DataConfig(buckets=((1, 8),), split_overlap=4),
            process_index=i,
            process_count=2,
        )
        for i in range(2)
    ]
    assert [len(s.micro_batches) for s in shards] == [2, 2]
    assert shards[1].stats.padding_micro_batches == 1
    with pytest.raises(ValueError, match="process_index"):
        build_step(0, traces, DataConfig(), process_index=2, process_count=2)


def test_sqlite_store_feeds_the_step(tmp_path):
    from harnessrl.traces.sqlite import SQLiteTraceStore

    traces = _step_traces(3)
    store = SQLiteTraceStore(tmp_path / "traces.db")
    try:
        for run in traces.rollouts:
            store.create_rollout(make_run(run.rollout_id, run.group_id, None, RolloutState.QUEUED))
            store.transition(run.rollout_id, RolloutState.RUNNING)
            for call in traces.calls[run.rollout_id]:
                store.add_call(call)
            store.transition(run.rollout_id, RolloutState.SUCCEEDED)
            store.set_reward(run.rollout_id, run.reward)
        from_store = build_step(3, read_traces(store, ["s3"]), DataConfig())
    finally:
        store.close()
    direct = build_step(3, traces, DataConfig())
    assert from_store.stats.runs_trained == 3
    for a, b in zip(from_store.micro_batches, direct.micro_batches, strict=True):
        assert all(
            np.array_equal(x, y)
            for x, y in zip(a.as_dict().values(), b.as_dict().values(), strict=True)
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buckets": ((0, 8),)}, "rows >= 1"),
        ({"length_policy": "drop"}, "length_policy"),
        ({"estimator": "ppo"}, "estimator"),
        ({"loss_mode": "mean"}, "loss_mode"),
        ({"max_segments_per_row": 0}, "max_segments_per_row"),
        ({"split_overlap": 1024}, "split_overlap"),
        ({"step_token_budget": 0}, "step_token_budget"),
        ({"constant_normalizer": -1.0}, "constant_normalizer"),
        ({"adv_eps": 0.0}, "adv_eps"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


@settings(max_examples=25, deadline=None)
@given(agent_step())
def test_unpacking_returns_the_merged_sequences_of_generated_rollouts(runs):
    seqs = [s for g in runs for s in merge_calls(g.calls).sequences]
    weights = token_weights(seqs, "run_mean")
    items = [
        PackItem(s.tokens, s.loss_mask, s.logprobs, w, 0.25)
        for s, w in zip(seqs, weights, strict=True)
    ]
    packed = pack_items(items, [Bucket(4, 128), Bucket(2, 512)], 16)
    for seq, w, back in zip(
        seqs, weights, unpack_items(packed.batches, packed.placements), strict=True
    ):
        assert np.array_equal(back["tokens"], seq.tokens)
        assert np.array_equal(back["loss_mask"] > 0, seq.loss_mask)
        assert np.array_equal(back["behavior_logprobs"], seq.logprobs)
        assert np.array_equal(back["token_weights"], w)
