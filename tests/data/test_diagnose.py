from __future__ import annotations

import numpy as np

from harnessrl.data.diagnose import BreakCause, diagnose_break

VOCAB = {
    1: "<s>",
    2: "user",
    3: " hi",
    4: "\n\n",
    5: "\n",
    6: "ok",
    7: "<think>",
    8: "hm",
    9: "</think>",
}
VOCAB |= {
    10: " the",
    11: " answer",
    12: " is",
    13: " 4",
    14: "<e>",
    15: " bye",
    16: " yo",
    20: "  ",
}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def _diag(old, sampled_from, new, dec=decode):
    old_a = np.array(old)
    sampled = np.arange(len(old)) >= sampled_from
    return diagnose_break(old_a, np.array(new), sampled, dec)


def test_bpe_remerge_same_text_other_boundaries():
    # "\n\n" sampled as one id, re-rendered as two.
    pos, prev, new, cause, detail = _diag(
        [1, 2, 3, 6, 4, 10, 11, 12, 13], 3, [1, 2, 3, 6, 5, 5, 10, 11, 12, 13, 14]
    )
    assert (pos, cause) == (4, BreakCause.BPE_REMERGE)
    assert prev[:2] == (4, 10) and new[:3] == (5, 5, 10)
    assert "same text" in detail


def test_bpe_remerge_at_the_very_end_of_the_completion():
    # The completion ends in "\n\n"; the template re-renders it as "\n", "\n" then its end id.
    _, _, _, cause, detail = _diag([1, 2, 3, 6, 4], 3, [1, 2, 3, 6, 5, 5, 14, 2, 15])
    assert cause == BreakCause.BPE_REMERGE and "end" in detail


def test_whitespace_only_change_counts_as_remerge():
    _, _, _, cause, detail = _diag(
        [1, 2, 3, 6, 20, 10, 11, 12, 13], 3, [1, 2, 3, 6, 10, 11, 12, 13, 14]
    )
    assert cause == BreakCause.BPE_REMERGE and "whitespace" in detail


def test_template_dropping_reasoning_is_template_altered():
    old = [1, 2, 3, 7, 8, 8, 8, 8, 9, 10, 11, 12, 13]
    new = [1, 2, 3, 10, 11, 12, 13, 14, 2, 15]
    _, _, _, cause, detail = _diag(old, 3, new)
    assert cause == BreakCause.TEMPLATE_ALTERED and "6 sampled" in detail


def test_harness_editing_earlier_context_is_history_rewritten():
    old = [1, 2, 3, 15, 16, 10, 11, 12, 13, 6]
    new = [1, 2, 3, 16, 16, 16, 10, 11, 12, 6, 14]
    _, _, _, cause, _ = _diag(old, 9, new)
    assert cause == BreakCause.HISTORY_REWRITTEN


def test_harness_dropping_a_context_message_is_history_rewritten():
    old = [1, 2, 3, 15, 15, 15, 15, 10, 11, 12, 13, 6]
    new = [1, 2, 3, 10, 11, 12, 13, 6, 14]
    _, _, _, cause, detail = _diag(old, 11, new)
    assert cause == BreakCause.HISTORY_REWRITTEN and "removed" in detail


def test_truncated_prompt_is_history_rewritten():
    _, _, _, cause, detail = _diag([1, 2, 3, 6, 6], 3, [1, 2, 3])
    assert cause == BreakCause.HISTORY_REWRITTEN and "truncated" in detail


def test_no_shared_prefix_is_other():
    pos, _, _, cause, _ = _diag([1, 2, 3, 6], 3, [2, 2, 3, 6, 6])
    assert (pos, cause) == (0, BreakCause.OTHER)


def test_without_decoder_a_short_count_changing_edit_is_still_a_remerge():
    _, _, _, cause, detail = _diag(
        [1, 2, 3, 6, 4, 10, 11, 12, 13], 3, [1, 2, 3, 6, 5, 5, 10, 11, 12, 13], None
    )
    assert cause == BreakCause.BPE_REMERGE and "not checked" in detail


def test_unknown_ids_fall_back_to_id_evidence():
    def partial(ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids if i != 4) if 4 not in ids else VOCAB[99]

    _, _, _, cause, _ = _diag(
        [1, 2, 3, 6, 4, 10, 11, 12, 13], 3, [1, 2, 3, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], partial
    )
    assert cause == BreakCause.TEMPLATE_ALTERED
