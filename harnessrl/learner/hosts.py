"""Multi-process runs: process 0 drives the loop, every other process follows it into each collective.

In: on process 0, the learner calls of the loop (update with the step's micro-batches, weight
gathers, checkpoint save/restore, stop). Out: the same call on every process, each with its own
block of rows. Only process 0 runs harnesses, serves, logs and writes outputs; every process holds
its shards of the learner state, so each of these calls must run everywhere, in the same order.
With one process, announcing is free and the leader is the learner itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from harnessrl.data.pack import PackedBatch
from harnessrl.learner.step import Learner

TRAIN, PARAMS, SAVE, RESTORE, STOP = range(1, 6)


def _broadcast(value: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def _announce(command: int, size: int = 0) -> np.ndarray:
    """[command, size]: size is the number of micro-batches or the payload's bytes."""
    return _broadcast(np.asarray([command, size], np.int64))


def _broadcast_text(text: str | None, size: int) -> str:
    raw = np.frombuffer(text.encode(), np.uint8) if text is not None else np.zeros(size, np.uint8)
    return bytes(_broadcast(raw)).decode()


def _broadcast_batch(batch: PackedBatch | None) -> PackedBatch:
    """Process 0's micro-batch (its shape first, then each array) on every process."""
    shape = batch.shape if batch is not None else (0, 0)
    rows, length = (int(x) for x in _broadcast(np.asarray(shape, np.int64)))
    # Other processes receive into zeros of the contract's own dtypes.
    source = batch if batch is not None else PackedBatch.zeros(rows, length)
    return PackedBatch(**{name: _broadcast(a) for name, a in source.as_dict().items()})


def own_rows(batch: PackedBatch) -> PackedBatch:
    """This process's contiguous block of a global micro-batch's rows."""
    count, index = jax.process_count(), jax.process_index()
    rows = batch.shape[0]
    if rows % count:
        raise ValueError(
            f"a micro-batch of {rows} rows cannot be split over {count} processes; choose "
            "data.buckets rows that are a multiple of the process count"
        )
    block = rows // count
    return PackedBatch(
        **{k: v[index * block : (index + 1) * block] for k, v in batch.as_dict().items()}
    )


class LeadLearner:
    """Process 0's handle on the learner: announces each collective call, then makes it."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.many = jax.process_count() > 1

    @property
    def step(self) -> int:
        return self.learner.step

    @property
    def compile_count(self) -> int:
        return self.learner.compile_count

    @property
    def checkpointer(self) -> Any:
        return self.learner.checkpointer

    def train_step(self, micro_batches: Sequence[PackedBatch]) -> dict[str, Any]:
        if not self.many:
            return self.learner.train_step(micro_batches)
        # Refused before the announcement, which would leave the other processes waiting.
        bad = [type(b).__name__ for b in micro_batches if not isinstance(b, PackedBatch)]
        if bad:
            raise TypeError(f"micro-batches must be harnessrl.data.pack.PackedBatch, got {bad}")
        _announce(TRAIN, len(micro_batches))
        return self.learner.train_step([own_rows(_broadcast_batch(b)) for b in micro_batches])

    def params_state(self) -> Any:
        self._tell(PARAMS)
        return self.learner.params_state()

    def export_hf(self, out_dir: str | Path, tokenizer: Any = None) -> Path:
        self._tell(PARAMS)  # every process gathers the weights; process 0 writes
        return self.learner.export_hf(out_dir, tokenizer)

    def save(self, position: dict[str, Any]) -> None:
        if self.many:
            text = json.dumps(position)
            _announce(SAVE, len(text.encode()))
            _broadcast_text(text, 0)
        self.learner.save(position)

    def restore(self) -> dict[str, Any] | None:
        self._tell(RESTORE)
        return self.learner.restore()

    def close(self) -> None:
        self._tell(STOP)
        self.learner.close()

    def _tell(self, command: int) -> None:
        if self.many:
            _announce(command)


def follow(learner: Learner) -> int:
    """Processes > 0: make the leader's learner calls until it stops; returns the steps taken."""
    if jax.process_index() == 0:
        raise RuntimeError("follow() runs on processes > 0; process 0 leads with LeadLearner")
    try:
        while True:
            command, a = (int(x) for x in _announce(0)[:2])
            if command == TRAIN:
                learner.train_step([own_rows(_broadcast_batch(None)) for _ in range(a)])
            elif command == PARAMS:
                learner.params_state()
            elif command == SAVE:
                learner.save(json.loads(_broadcast_text(None, a)))
            elif command == RESTORE:
                learner.restore()
            elif command == STOP:
                return learner.step
            else:
                raise RuntimeError(f"unknown command {command} from process 0")
    finally:
        learner.close()
