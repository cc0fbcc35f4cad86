from __future__ import annotations

import numpy as np
import pytest
from trace_factory import make_call

from harnessrl.data.diagnose import BreakCause
from harnessrl.data.merge import MergeStats, merge_calls, truncate_sequences


def test_extending_calls_merge_into_one_sequence_with_masks_and_logprobs():
    c0 = make_call("r", 0, [1, 2, 3], [[4, 5]], logprobs=[[-0.5, -0.25]])
    c1 = make_call("r", 1, [1, 2, 3, 4, 5, 6, 7], [[8]], logprobs=[[-0.125]], version=3)
    result = merge_calls([c0, c1])
    assert result.breaks == []
    (seq,) = result.sequences
    assert seq.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seq.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seq.logprobs.tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, -0.125]
    assert seq.call_seqs == (0, 1)
    assert seq.policy_version == 0
    assert result.stats.sampled_tokens == 3


def test_prompt_that_does_not_extend_starts_a_new_sequence_and_is_diagnosed():
    c0 = make_call("r", 0, [1, 2, 3], [[4, 5, 6, 7, 8, 9]])
    # The history is re-rendered with id 4 replaced by two ids (e.g. "\n\n" -> "\n", "\n").
    c1 = make_call("r", 1, [1, 2, 3, 40, 41, 5, 6, 7, 8, 9, 10], [[11]])
    result = merge_calls([c0, c1])
    assert [s.tokens.tolist() for s in result.sequences] == [
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1, 2, 3, 40, 41, 5, 6, 7, 8, 9, 10, 11],
    ]
    # Earlier sampled tokens are context in the new sequence: each trained once.
    assert result.sequences[1].loss_mask.sum() == 1
    (brk,) = result.breaks
    assert (brk.call_seq, brk.position, brk.cause) == (1, 3, BreakCause.BPE_REMERGE)
    assert brk.previous_ids[:2] == (4, 5) and brk.new_ids[:3] == (40, 41, 5)


def test_failed_calls_are_excluded_and_counted():
    c0 = make_call("r", 0, [1, 2], [], status=500, error="boom")
    c1 = make_call("r", 1, [1, 2], [[3]])
    result = merge_calls([c0, c1])
    assert result.stats.failed_calls == 1
    assert [s.tokens.tolist() for s in result.sequences] == [[1, 2, 3]]


def test_retried_identical_prompt_keeps_only_the_last_attempt():
    c0 = make_call("r", 0, [1, 2], [[3, 4]])
    c1 = make_call("r", 1, [1, 2], [[5, 6]])  # the harness retried the same request
    c2 = make_call("r", 2, [1, 2, 5, 6, 7], [[8]])
    result = merge_calls([c0, c1, c2])
    assert result.stats.retries_deduped == 1
    assert result.breaks == []
    (seq,) = result.sequences
    assert seq.tokens.tolist() == [1, 2, 5, 6, 7, 8]
    assert seq.call_seqs == (1, 2)
    assert seq.logprobs[2:4].tolist() == list(c1.choices[0].logprobs)


def test_each_choice_of_an_n2_call_is_its_own_branch_and_trained_once():
    c0 = make_call("r", 0, [1, 2], [[3]])
    c1 = make_call("r", 1, [1, 2, 3, 4], [[5, 6], [7]])
    c2 = make_call("r", 2, [1, 2, 3, 4, 7, 9], [[10]])  # the harness went on with choice 1
    result = merge_calls([c0, c1, c2])
    assert result.breaks == []
    by_tokens = {tuple(s.tokens.tolist()): s for s in result.sequences}
    assert set(by_tokens) == {(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 7, 9, 10)}
    fork = by_tokens[(1, 2, 3, 4, 7, 9, 10)]
    assert fork.loss_mask.tolist() == [0, 0, 0, 0, 1, 0, 1]  # shared history is context here
    assert sum(s.num_sampled for s in result.sequences) == 1 + 2 + 1 + 1


def test_calls_without_logprobs_are_skipped_and_the_chain_continues_as_context():
    c0 = make_call("r", 0, [1, 2], [[3, 4]], logprobs=[[]])
    c1 = make_call("r", 1, [1, 2, 3, 4, 5], [[6]])
    result = merge_calls([c0, c1])
    assert result.stats.calls_without_logprobs == 1
    (seq,) = result.sequences
    assert seq.loss_mask.tolist() == [0, 0, 0, 0, 0, 1]


def test_sampled_token_at_position_zero_is_not_trainable():
    result = merge_calls([make_call("r", 0, [], [[7, 8]])])
    assert result.sequences[0].loss_mask.tolist() == [0, 1]
    assert result.stats.unscorable_first_tokens == 1
    empty = merge_calls([make_call("r", 0, [], [[7]])])
    assert empty.sequences == [] and empty.stats.empty_sequences == 1


def test_merge_rejects_mixed_rollouts_and_unordered_calls():
    with pytest.raises(ValueError, match="one rollout"):
        merge_calls([make_call("a", 0, [1], [[2]]), make_call("b", 1, [1], [[2]])])
    with pytest.raises(ValueError, match="ordered by seq"):
        merge_calls([make_call("a", 1, [1], [[2]]), make_call("a", 0, [1], [[2]])])


def test_truncate_keeps_the_head_and_counts_dropped_sampled_tokens():
    result = merge_calls([make_call("r", 0, [1, 2, 3], [[4, 5, 6, 7]])])
    stats = MergeStats()
    (seq,) = truncate_sequences(result.sequences, 5, stats)
    assert seq.tokens.tolist() == [1, 2, 3, 4, 5]
    assert (stats.truncated_sequences, stats.truncated_sampled_tokens) == (1, 2)
    assert truncate_sequences(result.sequences, 3, MergeStats()) == []
    with pytest.raises(ValueError, match="max_len"):
        truncate_sequences(result.sequences, 1, stats)


def test_merged_arrays_have_training_dtypes():
    (seq,) = merge_calls([make_call("r", 0, [1], [[2]])]).sequences
    assert seq.tokens.dtype == np.int32 and seq.logprobs.dtype == np.float32
    assert seq.loss_mask.dtype == np.bool_


def test_retry_of_an_n2_call_drops_every_choice_of_the_superseded_call():
    c0 = make_call("r", 0, [1, 2], [[3, 4], [5]])
    c1 = make_call("r", 1, [1, 2], [[6]])  # same request again
    result = merge_calls([c0, c1])
    assert result.stats.retries_deduped == 1
    assert [s.tokens.tolist() for s in result.sequences] == [[1, 2, 6]]


def test_retry_of_an_n2_call_after_an_earlier_sequence():
    c0 = make_call("r", 0, [1, 2], [[3]])
    c1 = make_call("r", 1, [9, 8], [[7, 6], [5]])  # a new context, sampled twice
    c2 = make_call("r", 2, [9, 8], [[4]])  # retried
    result = merge_calls([c0, c1, c2])
    assert [s.tokens.tolist() for s in result.sequences] == [[1, 2, 3], [9, 8, 4]]
    assert result.stats.retries_deduped == 1
