from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unpacking import unpack_items

from harnessrl.data.pack import (
    PackedBatch,
    PackItem,
    pack_items,
    shard_batches,
    split_items,
)
from harnessrl.data.plan import Bucket, validate_buckets

BUCKETS = [Bucket(8, 16), Bucket(4, 32), Bucket(2, 64), Bucket(1, 128)]


def _item(n: int, seed: int, advantage: float = 0.5) -> PackItem:
    rng = np.random.default_rng(seed)
    mask = rng.random(n) < 0.6
    mask[0] = False
    logprobs = np.where(mask, -rng.random(n), 0.0).astype(np.float32)
    weights = (mask / max(1, mask.sum())).astype(np.float32)
    return PackItem(rng.integers(1, 1000, n).astype(np.int32), mask, logprobs, weights, advantage)


items_strategy = st.lists(
    st.tuples(st.integers(1, 128), st.integers(0, 2**31)), min_size=0, max_size=60
).map(lambda specs: [_item(n, seed, advantage=float(k)) for k, (n, seed) in enumerate(specs)])


@settings(max_examples=60, deadline=None)
@given(items_strategy, st.integers(1, 6))
def test_packing_round_trips_and_uses_only_bucket_shapes(items, max_segments):
    res = pack_items(items, BUCKETS, max_segments)
    shapes = {(b.rows, b.length) for b in BUCKETS}
    assert {b.shape for b in res.batches} <= shapes
    for item, back in zip(items, unpack_items(res.batches, res.placements), strict=True):
        assert np.array_equal(back["tokens"], item.tokens)
        assert np.array_equal(back["loss_mask"], item.loss_mask.astype(np.float32))
        assert np.array_equal(back["behavior_logprobs"], item.logprobs)
        assert np.array_equal(back["token_weights"], item.weights * item.loss_mask)
        assert np.all(back["advantages"] == item.advantage)
        assert np.array_equal(back["positions"], np.arange(len(item.tokens)))
    real = sum(len(it.tokens) for it in items)
    assert sum(b.num_tokens for b in res.batches) == real
    for b in res.batches:
        pad = b.segment_ids == 0
        for name, arr in b.as_dict().items():
            assert not arr[pad].any(), name
        assert b.segment_ids.max(initial=0) <= max_segments
        # segment ids run 1..k along a row, each segment contiguous
        for row in b.segment_ids:
            ids = row[row > 0]
            assert np.all(np.diff(ids) >= 0) and (ids.size == 0 or ids[0] == 1)
            assert np.all(np.diff(ids) <= 1)
            assert np.all(row[: ids.size] > 0)  # padding only at the end of a row
    # At most one micro-batch per bucket has empty rows.
    partial = [b.shape for b in res.batches if (b.segment_ids.max(axis=1) == 0).any()]
    assert len(partial) == len(set(partial))


def test_first_fit_decreasing_fills_rows_tightly():
    items = [_item(n, n) for n in [100, 60, 40, 28, 24, 20, 12, 10, 8, 4] * 8]
    res = pack_items(items, BUCKETS, 64)
    assert res.efficiency > 0.9
    assert (
        res.batches[0].tokens.dtype == np.int32 and res.batches[0].token_weights.dtype == np.float32
    )


def test_empty_step_packs_to_nothing():
    res = pack_items([], BUCKETS, 4)
    assert res.batches == [] and res.efficiency == 1.0


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 400), st.integers(8, 64), st.integers(1, 7), st.integers(0, 2**31))
def test_split_trains_every_sampled_token_exactly_once(n, max_len, overlap, seed):
    item = _item(n, seed)
    chunks, n_split = split_items([item], max_len, overlap)
    assert n_split == (n > max_len)
    assert all(len(c.tokens) <= max_len and not c.loss_mask[0] for c in chunks)
    got = np.concatenate([c.logprobs[c.loss_mask] for c in chunks]) if chunks else np.zeros(0)
    assert np.array_equal(np.sort(got), np.sort(item.logprobs[item.loss_mask]))
    # Chunks copy the item's float32 weights; summed in float64 (<= 400 terms, each sum off by
    # <= 400 * 2^-53 relative), only the grouping differs: 1e-12 is ~20x that.
    total = sum(float((c.weights * c.loss_mask).sum(dtype=np.float64)) for c in chunks)
    whole = float((item.weights * item.loss_mask).sum(dtype=np.float64))
    assert total == pytest.approx(whole, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(items_strategy, st.integers(1, 5))
def test_shards_get_equal_micro_batch_counts_and_shapes(items, count):
    batches = pack_items(items, BUCKETS, 8).batches
    shards = [shard_batches(batches, i, count) for i in range(count)]
    assert len({tuple(b.shape for b in s) for s in shards}) == 1
    real = [b for s in shards for b in s if b.num_tokens]
    assert sorted(id(b) for b in real) == sorted(id(b) for b in batches if b.num_tokens)
    for s in shards:
        for b in s:
            if not b.num_tokens:
                assert not b.token_weights.any() and not b.loss_mask.any()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="largest bucket"):
        pack_items([_item(129, 0)], BUCKETS, 4)
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        PackItem(
            np.ones(2, np.int32),
            np.array([True, True]),
            np.zeros(2, np.float32),
            np.zeros(2, np.float32),
            0.0,
        )
    with pytest.raises(ValueError, match="logprobs"):
        PackItem(
            np.ones(2, np.int32),
            np.array([False, True]),
            np.zeros(3, np.float32),
            np.zeros(2, np.float32),
            0.0,
        )
    with pytest.raises(ValueError, match="overlap"):
        split_items([], 8, 8)
    with pytest.raises(ValueError, match="index/count"):
        shard_batches([], 2, 2)
    with pytest.raises(ValueError, match="distinct"):
        validate_buckets([(2, 8), (4, 8)])
    with pytest.raises(ValueError, match="rows >= 1"):
        validate_buckets([(0, 8)])
    with pytest.raises(ValueError, match="empty"):
        validate_buckets([])
    with pytest.raises(ValueError, match="max_segments"):
        pack_items([_item(4, 0)], BUCKETS, 0)


def test_zero_batch_and_as_dict_follow_the_contract():
    z = PackedBatch.zeros(2, 8)
    d = z.as_dict()
    assert list(d) == [
        "tokens",
        "positions",
        "segment_ids",
        "loss_mask",
        "behavior_logprobs",
        "advantages",
        "token_weights",
    ]
    assert all(v.shape == (2, 8) for v in d.values()) and z.num_tokens == 0
    assert [v.dtype for v in d.values()] == [np.int32] * 3 + [np.float32] * 4


def test_packed_batch_refuses_arrays_outside_the_contract():
    good = PackedBatch.zeros(8, 32).as_dict()
    with pytest.raises(TypeError, match=r"missing 1 required .*'advantages'"):
        PackedBatch(**{k: v for k, v in good.items() if k != "advantages"})
    with pytest.raises(ValueError, match=r"loss_mask has shape \(8, 16\), tokens \(8, 32\)"):
        PackedBatch(**{**good, "loss_mask": np.zeros((8, 16), np.float32)})
    with pytest.raises(ValueError, match=r"tokens has shape \(32,\)"):
        PackedBatch(**{k: v[0] for k, v in good.items()})
    with pytest.raises(TypeError, match="tokens has dtype float32, expected int32"):
        PackedBatch(**{**good, "tokens": np.zeros((8, 32), np.float32)})
    with pytest.raises(TypeError, match="advantages has dtype float64, expected float32"):
        PackedBatch(**{**good, "advantages": np.zeros((8, 32))})
    with pytest.raises(TypeError, match="segment_ids must be a numpy array, got list"):
        PackedBatch(**{**good, "segment_ids": [[0] * 32] * 8})


def test_overflow_rows_move_up_only_when_that_saves_slots():
    two = [Bucket(4, 16), Bucket(2, 32)]
    moved = pack_items([_item(30, 1)] + [_item(16, k) for k in range(5)], two, 8)
    assert [b.shape for b in moved.batches] == [(4, 16), (2, 32)]  # the 5th row filled the free one
    assert moved.efficiency == pytest.approx(110 / 128)
    kept = pack_items([_item(5, 1)], two, 8)
    assert [b.shape for b in kept.batches] == [(4, 16)]  # moving up would cost as many slots
