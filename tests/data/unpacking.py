"""Read packed micro-batches back into their items: the inverse of `pack_items`, for the tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harnessrl.data.pack import PackedBatch


def unpack_items(
    batches: Sequence[PackedBatch], placements: np.ndarray
) -> list[dict[str, np.ndarray]]:
    """Every packed item's arrays, in input order, from the placements `pack_items` returns."""
    out = []
    for mb, r, off, n in placements.tolist():
        cols = slice(off, off + n)
        out.append({k: v[r, cols] for k, v in batches[mb].as_dict().items()})
    return out
