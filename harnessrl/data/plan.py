"""Packing plan: which item goes into which row of which bucket-shaped micro-batch.

In: item lengths of one step, the bucket set, a cap on segments per row. Out: a list of
micro-batches, each a bucket index and its rows (lists of item indices). Lengths only, no arrays.

Why not grain's `FirstFitPackIterDataset`/`BestFitPackIterDataset`: they pack a stream into a
single target length per feature, emit bins whenever one element does not fit, and never sort.
A step here is finite and known at once, wants several bucket shapes, and is small enough (a few
thousand sequences) to sort: first-fit-decreasing over the whole step wastes far less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class Bucket:
    rows: int
    length: int


def validate_buckets(buckets: Sequence[Bucket | tuple[int, int]]) -> list[Bucket]:
    """Buckets as (rows, length), sorted by length; lengths distinct, all positive."""
    out = []
    for b in buckets:
        rows, length = (b.rows, b.length) if isinstance(b, Bucket) else b
        if not (isinstance(rows, int) and isinstance(length, int)) or rows < 1 or length < 2:
            raise ValueError(f"bucket must be (rows >= 1, length >= 2) integers, got {b!r}")
        out.append(Bucket(rows, length))
    if not out:
        raise ValueError("buckets must not be empty, e.g. ((8, 256), (4, 512), (2, 1024))")
    out.sort(key=lambda b: b.length)
    lengths = [b.length for b in out]
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"bucket lengths must be distinct, got {lengths}")
    return out


class _Rows:
    """Open rows as parallel numpy arrays so each first-fit search is one vectorized scan."""

    def __init__(self, bucket_lens: np.ndarray, max_segments: int) -> None:
        self.bucket_lens = bucket_lens
        self.max_segments = max_segments
        self.free = np.zeros(64, np.int64)
        self.nseg = np.zeros(64, np.int64)
        self.bucket = np.full(64, -1, np.int64)  # -1: removed or unused slot
        self.items: list[list[int]] = []

    def _open(self, b: int) -> int:
        r = len(self.items)
        if r == self.free.size:
            grow = r
            self.free = np.concatenate([self.free, np.zeros(grow, np.int64)])
            self.nseg = np.concatenate([self.nseg, np.zeros(grow, np.int64)])
            self.bucket = np.concatenate([self.bucket, np.full(grow, -1, np.int64)])
        self.free[r] = self.bucket_lens[b]
        self.bucket[r] = b
        self.items.append([])
        return r

    def place(self, i: int, length: int, min_bucket: int) -> None:
        n = len(self.items)
        ok = (self.free[:n] >= length) & (self.nseg[:n] < self.max_segments)
        ok &= self.bucket[:n] >= min_bucket
        hits = np.flatnonzero(ok)
        r = int(hits[0]) if hits.size else self._open(min_bucket)
        self.free[r] -= length
        self.nseg[r] += 1
        self.items[r].append(i)

    def copy(self) -> _Rows:
        out = _Rows(self.bucket_lens, self.max_segments)
        out.free, out.nseg, out.bucket = self.free.copy(), self.nseg.copy(), self.bucket.copy()
        out.items = [list(x) for x in self.items]
        return out

    def slots(self, rows_per: np.ndarray) -> int:
        """Array slots the micro-batches of this plan would occupy."""
        live = self.bucket[: len(self.items)]
        counts = np.bincount(live[live >= 0], minlength=rows_per.size)
        return int((-(-counts // rows_per) * rows_per * self.bucket_lens).sum())

    def remove(self, r: int) -> list[int]:
        self.bucket[r] = -1
        self.free[r] = -1
        items, self.items[r] = self.items[r], []
        return items


def _move_leftovers(rows: _Rows, b: int, rows_per_batch: int, lengths: np.ndarray) -> bool:
    """Re-pack the least-filled rows that overflow bucket b's last micro-batch one bucket up."""
    idx = np.flatnonzero(rows.bucket[: len(rows.items)] == b)
    extra = idx.size % rows_per_batch
    if not extra:
        return False
    used = rows.bucket_lens[b] - rows.free[idx]
    leftovers = idx[np.argsort(used, kind="stable")[:extra]]
    moved = [i for r in leftovers.tolist() for i in rows.remove(r)]
    moved.sort(key=lambda i: -int(lengths[i]))
    for i in moved:
        rows.place(i, int(lengths[i]), b + 1)
    return True


def _best_cascade(rows: _Rows, b: int, rows_per: np.ndarray, lengths: np.ndarray) -> _Rows:
    """Try moving bucket b's overflow rows up by 1, 2, ... buckets (each level passing its own
    overflow on); keep the plan with the fewest slots, the unchanged one on ties."""
    best, best_slots = rows, rows.slots(rows_per)
    trial = rows.copy()
    for c in range(b, rows_per.size - 1):
        if not _move_leftovers(trial, c, int(rows_per[c]), lengths):
            break
        if trial.slots(rows_per) < best_slots:
            best, best_slots = trial.copy(), trial.slots(rows_per)
    return best


def plan_rows(
    lengths: np.ndarray, buckets: Sequence[Bucket], max_segments: int
) -> list[tuple[int, list[list[int]]]]:
    """First-fit-decreasing: longest items first, each into the first open row with room (any
    bucket), else a new row of the smallest bucket that holds it. Then, smallest bucket first,
    the rows that would leave a micro-batch part-empty are re-packed into larger buckets (into
    free space there, or sharing rows, cascading upward) when that takes fewer array slots; else
    they stay in their smaller, cheaper shape. At most one micro-batch per bucket has empty rows."""
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    bucket_lens = np.array([b.length for b in buckets], np.int64)
    rows = _Rows(bucket_lens, max_segments)
    order = np.argsort(-lengths, kind="stable")
    classes = np.searchsorted(bucket_lens, lengths, side="left")
    for i in order.tolist():
        rows.place(i, int(lengths[i]), int(classes[i]))
    rows_per = np.array([b.rows for b in buckets], np.int64)
    for b in range(len(buckets) - 1):
        rows = _best_cascade(rows, b, rows_per, lengths)
    plan: list[tuple[int, list[list[int]]]] = []
    live = rows.bucket[: len(rows.items)]
    for b, bucket in enumerate(buckets):
        idx = np.flatnonzero(live == b).tolist()
        for start in range(0, len(idx), bucket.rows):
            plan.append((b, [rows.items[r] for r in idx[start : start + bucket.rows]]))
    return plan
