"""From a step's traces to this process's packed micro-batches.

In: `StepTraces` (finished rollouts and their calls), e.g. `read_traces` from a `TraceStore`.
Out: one `StepBatch` per optimizer step: the micro-batches for this data-parallel shard plus
counters and break diagnoses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from harnessrl.data.advantages import Estimator, compute_advantages
from harnessrl.data.diagnose import BreakDiagnosis, Decoder
from harnessrl.data.merge import (
    LengthPolicy,
    MergedSequence,
    MergeStats,
    merge_calls,
    truncate_sequences,
)
from harnessrl.data.pack import PackedBatch, PackItem, pack_items, shard_batches, split_items
from harnessrl.data.plan import Bucket, validate_buckets
from harnessrl.data.weights import LossMode, token_weights
from harnessrl.traces.schema import CallRecord, RolloutRecord, TraceStore


@dataclass(frozen=True)
class DataConfig:
    """Everything that turns traces into training arrays. Defaults fit the embedded CPU run."""

    buckets: tuple[tuple[int, int], ...] = ((8, 256), (4, 512), (2, 1024))  # (rows, length)
    max_segments_per_row: int = 32
    length_policy: str = LengthPolicy.SPLIT  # for sequences longer than the largest bucket
    split_overlap: int = 64  # context ids repeated at the head of each later chunk
    step_token_budget: int | None = None  # runs past this many tokens are dropped, whole
    estimator: str = Estimator.GRPO
    std_normalize: bool = True
    adv_eps: float = 1e-6
    drop_zero_variance: bool = True
    include_failed: bool = False  # failed/timed-out runs stay out of training by default
    failed_reward: float | None = None  # reward for included failed runs that have none
    loss_mode: str = LossMode.RUN_MEAN
    constant_normalizer: float = 1024.0  # C of the `constant` loss mode

    def __post_init__(self) -> None:
        validate_buckets(self.buckets)
        for name, enum_cls in (
            ("length_policy", LengthPolicy),
            ("estimator", Estimator),
            ("loss_mode", LossMode),
        ):
            value = getattr(self, name)
            if value not in {e.value for e in enum_cls}:
                raise ValueError(
                    f"DataConfig.{name} must be one of {[e.value for e in enum_cls]}, got {value!r}"
                )
        if self.max_segments_per_row < 1:
            raise ValueError(
                f"DataConfig.max_segments_per_row must be >= 1, got {self.max_segments_per_row}"
            )
        split = self.length_policy == LengthPolicy.SPLIT
        if split and not 1 <= self.split_overlap < self.max_len:
            raise ValueError(
                f"DataConfig.split_overlap must be in [1, {self.max_len}), got {self.split_overlap}"
            )
        if self.step_token_budget is not None and self.step_token_budget < 1:
            raise ValueError(
                f"DataConfig.step_token_budget must be >= 1 or None, got {self.step_token_budget}"
            )
        if not self.constant_normalizer > 0:
            raise ValueError(
                f"DataConfig.constant_normalizer must be > 0, got {self.constant_normalizer}"
            )
        if not self.adv_eps > 0:
            raise ValueError(f"DataConfig.adv_eps must be > 0, got {self.adv_eps}")

    @property
    def bucket_set(self) -> list[Bucket]:
        return validate_buckets(self.buckets)

    @property
    def max_len(self) -> int:
        return max(length for _, length in self.buckets)


@dataclass(frozen=True)
class StepTraces:
    """What one optimizer step trains on: finished runs and each run's calls ordered by seq."""

    rollouts: list[RolloutRecord]
    calls: dict[str, list[CallRecord]]


@dataclass
class StepStats:
    runs: int = 0
    runs_trained: int = 0  # runs with at least one packed token
    excluded: dict[str, int] = field(default_factory=dict)  # reason -> runs
    over_budget_runs: int = 0  # dropped: past step_token_budget
    merge: MergeStats = field(default_factory=MergeStats)
    break_causes: dict[str, int] = field(default_factory=dict)
    split_sequences: int = 0
    micro_batches: int = 0  # this shard's, padding included
    padding_micro_batches: int = 0
    real_tokens: int = 0  # over the whole step (all shards)
    slots: int = 0  # array slots over the whole step (all shards)

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 1.0


@dataclass
class StepBatch:
    step: int
    micro_batches: list[PackedBatch]
    stats: StepStats
    breaks: list[BreakDiagnosis]


def read_traces(store: TraceStore, group_ids: Sequence[str]) -> StepTraces:
    """The runs of these groups and each run's calls, as the store holds them now."""
    rollouts = [r for g in group_ids for r in store.rollouts(g)]
    return StepTraces(rollouts, {r.rollout_id: store.calls(r.rollout_id) for r in rollouts})


def _merge_runs(
    traces: StepTraces,
    runs: Iterable[RolloutRecord],
    cfg: DataConfig,
    stats: StepStats,
    decode: Decoder | None,
) -> tuple[list[MergedSequence], list[BreakDiagnosis]]:
    sequences: list[MergedSequence] = []
    breaks: list[BreakDiagnosis] = []
    used = 0
    for run in runs:
        result = merge_calls(traces.calls.get(run.rollout_id, []), decode=decode)
        seqs = result.sequences
        if cfg.length_policy == LengthPolicy.TRUNCATE:
            seqs = truncate_sequences(seqs, cfg.max_len, result.stats)
        size = sum(len(s.tokens) for s in seqs)
        if cfg.step_token_budget is not None and used + size > cfg.step_token_budget:
            # Dropped whole, never half a run, and never trained later: by the next step the
            # policy has moved on, and its advantages were taken against this step's group.
            stats.over_budget_runs += 1
            continue
        used += size
        stats.merge.add(result.stats)
        breaks += result.breaks
        sequences += seqs
    return sequences, breaks


def build_step(
    step: int,
    traces: StepTraces,
    cfg: DataConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    decode: Decoder | None = None,
) -> StepBatch:
    """Every process builds the whole step the same way (denominators are step-wide), then keeps
    its own share of the micro-batches."""
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"need 0 <= process_index < process_count, got {process_index}/{process_count}"
        )
    stats = StepStats(runs=len(traces.rollouts))
    adv = compute_advantages(
        traces.rollouts,
        estimator=cfg.estimator,
        std_normalize=cfg.std_normalize,
        eps=cfg.adv_eps,
        drop_zero_variance=cfg.drop_zero_variance,
        include_failed=cfg.include_failed,
        failed_reward=cfg.failed_reward,
    )
    stats.excluded = dict(Counter(adv.excluded.values()))
    # A fixed order makes every process pack identically.
    runs = sorted(
        (r for r in traces.rollouts if r.rollout_id in adv.advantages),
        key=lambda r: (r.group_id, r.rollout_id),
    )
    sequences, breaks = _merge_runs(traces, runs, cfg, stats, decode)
    stats.break_causes = dict(Counter(str(b.cause) for b in breaks))
    stats.runs_trained = len({s.rollout_id for s in sequences})
    weights = token_weights(sequences, cfg.loss_mode, constant=cfg.constant_normalizer)
    items = [
        PackItem(s.tokens, s.loss_mask, s.logprobs, w, adv.advantages[s.rollout_id])
        for s, w in zip(sequences, weights, strict=True)
    ]
    if cfg.length_policy == LengthPolicy.SPLIT:
        items, stats.split_sequences = split_items(items, cfg.max_len, cfg.split_overlap)
    packed = pack_items(items, cfg.bucket_set, cfg.max_segments_per_row)
    mine = shard_batches(packed.batches, process_index, process_count)
    stats.real_tokens = sum(b.num_tokens for b in packed.batches)
    stats.slots = sum(b.tokens.size for b in packed.batches)
    stats.micro_batches = len(mine)
    stats.padding_micro_batches = sum(1 for b in mine if b.num_tokens == 0)
    return StepBatch(step, mine, stats, breaks)
