"""Merge a rollout's model calls into training sequences by token-id prefix.

In: one rollout's `CallRecord`s ordered by `seq`. Out: `MergedSequence`s (tokens, loss mask,
behavior logprobs) plus a `BreakDiagnosis` for every place where a prompt did not extend the ids
already seen, and counters for everything that was skipped.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from harnessrl.data.diagnose import BreakDiagnosis, Decoder, diagnose_break
from harnessrl.traces.schema import CallRecord


class LengthPolicy(enum.StrEnum):
    SPLIT = "split"  # cut into overlapping chunks that fit; every sampled token is kept once
    TRUNCATE = "truncate"  # keep the head; sampled tokens past the limit are dropped and counted


@dataclass(frozen=True)
class MergedSequence:
    """One training sequence: a chain of calls whose ids extend each other.

    Arrays are aligned to the target token: `logprobs[t]` is the serving logprob of `tokens[t]`
    and `loss_mask[t]` says whether `tokens[t]` was sampled by the policy (True) or came from the
    harness, a tool or the template (False). The first token is never sampled-and-trainable.
    """

    rollout_id: str
    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]
    logprobs: np.ndarray  # float32 [n], 0 where loss_mask is False
    call_seqs: tuple[int, ...]  # the calls merged into this sequence, in order
    policy_version: int | None = None  # oldest policy version that sampled any of its tokens

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class MergeStats:
    calls: int = 0
    failed_calls: int = 0  # errors, non-2xx, no choices: excluded
    calls_without_logprobs: int = 0  # sampled ids without their logprobs cannot be trained
    retries_deduped: int = 0  # same prompt as the previous attempt: the earlier answer is dropped
    breaks: int = 0
    sequences: int = 0
    empty_sequences: int = 0  # sequences with no trainable token, dropped
    sampled_tokens: int = 0
    truncated_sequences: int = 0
    truncated_sampled_tokens: int = 0
    unscorable_first_tokens: int = 0  # a sampled token at position 0 has no context to score it

    def add(self, other: MergeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class MergeResult:
    sequences: list[MergedSequence]
    breaks: list[BreakDiagnosis]
    stats: MergeStats = field(default_factory=MergeStats)


@dataclass(eq=False)  # identity: branches are removed from lists by object
class _Branch:
    """A sequence under construction. Its ids are always the latest call's prompt (`head`) plus
    its completion (`tail`), both tuples as recorded, so checking whether the next prompt
    extends it is two C-level comparisons and nothing is concatenated."""

    head: tuple[int, ...]
    tail: tuple[int, ...]
    token_parts: list[np.ndarray]  # the same ids as int64 pieces, each id converted only once
    mask_parts: list[np.ndarray]
    logprob_parts: list[np.ndarray]
    call_seqs: list[int]
    versions: list[int | None]  # aligned with call_seqs
    last_parts: int  # index of the latest completion's part
    version: int = 0  # bumped on every change, keys the cached id array

    @property
    def size(self) -> int:
        return len(self.head) + len(self.tail)

    def is_prefix_of(self, prompt: tuple[int, ...]) -> bool:
        h, n = len(self.head), self.size
        if n > len(prompt) or (n and prompt[n - 1] != (self.tail or self.head)[-1]):
            return False  # cheap reject before the full comparisons
        return prompt[:h] == self.head and prompt[h:n] == self.tail

    def array(self) -> np.ndarray:
        """The ids as one int64 array, built once per version of the branch."""
        cached = self.__dict__.get("_cache")
        if cached is None or cached[0] != self.version:
            parts = self.token_parts
            cached = (self.version, np.concatenate(parts) if parts else np.zeros(0, np.int64))
            self.__dict__["_cache"] = cached
        return cached[1]

    def sampled_mask(self) -> np.ndarray:
        return np.concatenate(self.mask_parts) if self.mask_parts else np.zeros(0, bool)


def _choice_arrays(call: CallRecord, index: int) -> tuple[tuple[int, ...], np.ndarray] | None:
    choice = call.choices[index]
    if len(choice.logprobs) != len(choice.token_ids):
        return None
    return tuple(choice.token_ids), np.asarray(choice.logprobs, dtype=np.float32)


def _extend(
    branch: _Branch, call: CallRecord, completion: tuple[int, ...], lps: np.ndarray
) -> None:
    start = branch.size
    prompt = call.prompt_token_ids
    delta = len(prompt) - start
    if delta:
        branch.token_parts.append(np.array(prompt[start:], dtype=np.int64))
        branch.mask_parts.append(np.zeros(delta, bool))
        branch.logprob_parts.append(np.zeros(delta, np.float32))
    branch.last_parts = len(branch.mask_parts)  # a retry removes the parts from here on
    branch.token_parts.append(np.array(completion, dtype=np.int64))
    branch.mask_parts.append(np.ones(len(completion), bool))
    branch.logprob_parts.append(lps)
    branch.head, branch.tail = tuple(prompt), completion
    branch.version += 1
    branch.call_seqs.append(call.seq)
    branch.versions.append(call.policy_version)


def _fork(branch: _Branch) -> _Branch:
    """Copy of a branch for choice k>0 of an n>1 call: the shared history is context (mask 0),
    so every sampled token stays trainable in exactly one sequence."""
    n = branch.size
    lps = np.zeros(n, np.float32)
    calls, versions = list(branch.call_seqs), list(branch.versions)
    ids = [branch.array()]
    return _Branch(branch.head, branch.tail, ids, [np.zeros(n, bool)], [lps], calls, versions, 0)


def _retry(branches: list[_Branch], prompt: tuple[int, ...]) -> _Branch | None:
    """If `prompt` repeats the prompt of the latest call on some branch, that call was retried:
    drop its answers (every choice) and return the branch of its choice 0 to extend instead."""
    n = len(prompt)
    hits = [b for b in branches if b.tail and len(b.head) == n and b.head == prompt]
    if not hits:
        return None
    latest = max(b.call_seqs[-1] for b in hits)
    hits = [b for b in hits if b.call_seqs[-1] == latest]
    for b in hits:
        _rewind(b)
    for fork in hits[1:]:  # forks of an n>1 call hold only shared context once rewound
        branches.remove(fork)
    return hits[0]


def _rewind(branch: _Branch) -> None:
    """Drop the latest completion of a branch (it was superseded by a retry)."""
    del branch.token_parts[branch.last_parts :]
    del branch.mask_parts[branch.last_parts :]
    del branch.logprob_parts[branch.last_parts :]
    branch.tail = ()  # what is left is exactly the retried call's prompt, `head`
    branch.version += 1
    branch.call_seqs.pop()
    branch.versions.pop()


def _find_extension(branches: list[_Branch], prompt: tuple[int, ...]) -> _Branch | None:
    best: _Branch | None = None
    for branch in branches:
        if branch.is_prefix_of(prompt) and (best is None or branch.size > best.size):
            best = branch
    return best


def _closest(branches: list[_Branch], new: np.ndarray) -> _Branch:
    def shared(branch: _Branch) -> int:
        k = min(branch.size, len(new))
        diff = np.flatnonzero(branch.array()[:k] != new[:k])
        return int(diff[0]) if diff.size else k

    return max(reversed(branches), key=shared)


def merge_calls(
    calls: Sequence[CallRecord],
    *,
    decode: Decoder | None = None,
) -> MergeResult:
    """Turn one rollout's calls (ordered by `seq`) into sequences.

    A call extends the open sequence whose ids its prompt starts with (the longest one); its new
    prompt ids get mask 0 and its completion mask 1. Otherwise the call starts a new sequence and
    the break is diagnosed against the closest open sequence. `decode` (token ids -> text), when
    given, lets the diagnosis confirm re-tokenization by comparing text.
    """
    stats = MergeStats()
    breaks: list[BreakDiagnosis] = []
    branches: list[_Branch] = []
    rollout_ids = {c.rollout_id for c in calls}
    if len(rollout_ids) > 1:
        raise ValueError(
            f"merge_calls: calls must belong to one rollout, got {sorted(rollout_ids)}"
        )
    seqs = [c.seq for c in calls]
    if seqs != sorted(seqs):
        raise ValueError(f"merge_calls: calls must be ordered by seq, got {seqs}")
    for call in calls:
        stats.calls += 1
        if not call.ok:
            stats.failed_calls += 1
            continue
        chosen = [_choice_arrays(call, k) for k in range(len(call.choices))]
        if any(c is None for c in chosen):
            stats.calls_without_logprobs += 1
            continue
        prompt = tuple(call.prompt_token_ids)
        retried = _retry(branches, prompt)
        if retried is not None:
            stats.retries_deduped += 1
        base = retried or _find_extension(branches, prompt)
        if base is None:
            if branches:
                new = np.asarray(prompt, dtype=np.int64)
                closest = _closest(branches, new)
                diag = diagnose_break(closest.array(), new, closest.sampled_mask(), decode)
                breaks.append(BreakDiagnosis(call.rollout_id, call.seq, *diag))
                stats.breaks += 1
            base = _Branch((), (), [], [], [], [], [], 0)
            branches.append(base)
        targets = [base] + [_fork(base) for _ in chosen[1:]]
        branches.extend(targets[1:])
        for target, arrays in zip(targets, chosen, strict=True):
            assert arrays is not None
            _extend(target, call, *arrays)
    sequences = [s for s in (_finish(b, calls[0].rollout_id, stats) for b in branches) if s]
    stats.sequences = len(sequences)
    stats.sampled_tokens = sum(s.num_sampled for s in sequences)
    return MergeResult(sequences, breaks, stats)


def _finish(branch: _Branch, rollout_id: str, stats: MergeStats) -> MergedSequence | None:
    mask = branch.sampled_mask()
    if mask.size and mask[0]:
        # Nothing precedes the first token, so it has no prediction to train.
        mask[0] = False
        stats.unscorable_first_tokens += 1
    if not mask.any():
        stats.empty_sequences += 1
        return None
    logprobs = np.concatenate(branch.logprob_parts)
    logprobs[~mask] = 0.0
    versions = [v for v in branch.versions if v is not None]
    return MergedSequence(
        rollout_id=rollout_id,
        tokens=branch.array().astype(np.int32),
        loss_mask=mask,
        logprobs=logprobs,
        call_seqs=tuple(branch.call_seqs),
        policy_version=min(versions) if versions else None,
    )


def truncate_sequences(
    sequences: list[MergedSequence], max_len: int, stats: MergeStats
) -> list[MergedSequence]:
    """Keep the first `max_len` tokens of longer sequences; count what was cut."""
    if max_len < 2:
        raise ValueError(f"truncate_sequences: max_len must be >= 2, got {max_len}")
    out = []
    for seq in sequences:
        if len(seq.tokens) <= max_len:
            out.append(seq)
            continue
        stats.truncated_sequences += 1
        stats.truncated_sampled_tokens += int(seq.loss_mask[max_len:].sum())
        if not seq.loss_mask[:max_len].any():
            stats.empty_sequences += 1
            continue
        out.append(
            MergedSequence(
                seq.rollout_id,
                seq.tokens[:max_len],
                seq.loss_mask[:max_len],
                seq.logprobs[:max_len],
                seq.call_seqs,
                seq.policy_version,
            )
        )
    return out
