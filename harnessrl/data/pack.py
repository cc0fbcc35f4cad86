"""Pack weighted sequences into static `[rows, bucket_len]` micro-batches.

In: `PackItem`s (tokens, mask, behavior logprobs, per-token weights, advantage) of one step and a
fixed bucket set. Out: `PackedBatch`es, every one shaped like a configured bucket, so the learner
compiles at most one program per bucket, forever.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from harnessrl.data.plan import Bucket, plan_rows, validate_buckets

# A PackedBatch field's metadata declares its dtype; the checks and `zeros` read it from there.
_INT32, _FLOAT32 = {"dtype": np.int32}, {"dtype": np.float32}


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch, the learner's only input: seven `[rows, bucket_len]` arrays of the dtypes
    declared here, aligned to the target token. Construction checks shapes and dtypes."""

    tokens: np.ndarray = field(metadata=_INT32)
    positions: np.ndarray = field(metadata=_INT32)  # restart at 0 in every segment
    segment_ids: np.ndarray = field(metadata=_INT32)  # 1.. per row, 0 = padding
    loss_mask: np.ndarray = field(metadata=_FLOAT32)  # 1 where the policy sampled the token
    behavior_logprobs: np.ndarray = field(metadata=_FLOAT32)  # serving logprob of token t
    advantages: np.ndarray = field(metadata=_FLOAT32)  # the run's advantage on its tokens
    token_weights: np.ndarray = field(metadata=_FLOAT32)  # normalization folded in; 0 off-mask

    def __post_init__(self) -> None:
        shape = np.shape(self.tokens)
        for f in fields(self):
            value, want = getattr(self, f.name), np.dtype(f.metadata["dtype"])
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"PackedBatch.{f.name} must be a numpy array, got {type(value).__name__}"
                )
            if value.ndim != 2 or value.shape != shape:
                raise ValueError(
                    f"PackedBatch.{f.name} has shape {value.shape}, tokens {shape}; all seven "
                    "arrays must be [rows, bucket_len]"
                )
            if value.dtype != want:
                raise TypeError(
                    f"PackedBatch.{f.name} has dtype {value.dtype}, expected {want} "
                    f"(cast it with .astype(np.{want}))"
                )

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.tokens.shape
        return int(rows), int(length)

    @property
    def num_tokens(self) -> int:
        return int(np.count_nonzero(self.segment_ids))

    @classmethod
    def zeros(cls, rows: int, length: int) -> PackedBatch:
        """An all-padding micro-batch: zero weight, so it adds nothing to the gradient."""
        return cls(**{f.name: np.zeros((rows, length), f.metadata["dtype"]) for f in fields(cls)})


@dataclass(frozen=True)
class PackItem:
    """One segment to place: a (chunk of a) merged sequence with its weights."""

    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]; [0] must be False (nothing predicts the first token)
    logprobs: np.ndarray  # float32 [n]
    weights: np.ndarray  # float32 [n]
    advantage: float

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("PackItem: tokens must not be empty")
        for name in ("loss_mask", "logprobs", "weights"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"PackItem: {name} has {len(getattr(self, name))} entries, tokens {n}"
                )
        if self.loss_mask[0]:
            raise ValueError(
                "PackItem: loss_mask[0] must be 0: a segment's first token has no context"
            )


@dataclass(frozen=True)
class PackResult:
    batches: list[PackedBatch]
    # [n_items, 4]: micro-batch index, row, start column, length of each input item.
    placements: np.ndarray

    @property
    def efficiency(self) -> float:
        slots = sum(b.tokens.size for b in self.batches)
        return sum(b.num_tokens for b in self.batches) / slots if slots else 1.0


def split_items(
    items: Sequence[PackItem], max_len: int, overlap: int
) -> tuple[list[PackItem], int]:
    """Cut items longer than `max_len` into chunks that repeat the previous `overlap` ids as
    context (mask and weight 0 there), so each sampled token is trained in exactly one chunk.
    Returns the new items and how many items were split."""
    if not 1 <= overlap < max_len:
        raise ValueError(f"split overlap must be in [1, max_len={max_len}), got {overlap}")
    out: list[PackItem] = []
    n_split = 0
    stride = max_len - overlap
    for item in items:
        n = len(item.tokens)
        if n <= max_len:
            out.append(item)
            continue
        n_split += 1
        for start in range(0, n - overlap, stride):
            end = min(start + max_len, n)
            mask = item.loss_mask[start:end].copy()
            weights = item.weights[start:end].copy()
            if start:
                mask[:overlap] = False
                weights[:overlap] = 0.0
            if mask.any():
                out.append(
                    PackItem(
                        item.tokens[start:end],
                        mask,
                        item.logprobs[start:end],
                        weights,
                        item.advantage,
                    )
                )
    return out, n_split


def pack_items(
    items: Sequence[PackItem], buckets: Sequence[Bucket], max_segments: int
) -> PackResult:
    """First-fit-decreasing packing into the bucket set (see `plan.plan_rows`), then one
    vectorized copy per segment into preallocated arrays."""
    buckets = validate_buckets(buckets)
    lengths = np.fromiter((len(it.tokens) for it in items), dtype=np.int64, count=len(items))
    if lengths.size and lengths.max() > buckets[-1].length:
        raise ValueError(
            f"pack_items: an item has {int(lengths.max())} tokens, more than the largest bucket "
            f"length {buckets[-1].length}; split or truncate first"
        )
    plan = plan_rows(lengths, buckets, max_segments)
    placements = np.zeros((len(items), 4), np.int64)
    arange = np.arange(buckets[-1].length, dtype=np.int32)
    batches: list[PackedBatch] = []
    for b_idx, rows in plan:
        bucket = buckets[b_idx]
        batch = PackedBatch.zeros(bucket.rows, bucket.length)
        for r, row_items in enumerate(rows):
            off = 0
            for seg, i in enumerate(row_items, start=1):
                it, n = items[i], int(lengths[i])
                cols = slice(off, off + n)
                batch.tokens[r, cols] = it.tokens
                batch.positions[r, cols] = arange[:n]
                batch.segment_ids[r, cols] = seg
                batch.loss_mask[r, cols] = it.loss_mask
                batch.behavior_logprobs[r, cols] = it.logprobs
                batch.advantages[r, cols] = it.advantage
                batch.token_weights[r, cols] = it.weights * it.loss_mask
                placements[i] = (len(batches), r, off, n)
                off += n
        batches.append(batch)
    return PackResult(batches, placements)


def shard_batches(batches: Sequence[PackedBatch], index: int, count: int) -> list[PackedBatch]:
    """This data-parallel shard's micro-batches. Every shard gets the same number of each bucket
    shape, in the same order (all-padding, zero-weight micro-batches fill the gaps), so all
    processes run the same sequence of compiled micro-steps."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index/count must satisfy 0 <= index < count, got {index}/{count}")
    by_shape: dict[tuple[int, int], list[PackedBatch]] = {}
    for b in batches:
        by_shape.setdefault(b.shape, []).append(b)
    out: list[PackedBatch] = []
    for shape in sorted(by_shape):
        group = by_shape[shape]
        mine = group[index::count]
        out += mine + [
            PackedBatch.zeros(*shape) for _ in range(math.ceil(len(group) / count) - len(mine))
        ]
    return out
