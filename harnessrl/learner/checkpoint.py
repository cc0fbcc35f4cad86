"""Learner stage: checkpoints through orbax's CheckpointManager (async writes, keep-N).

In: the learner's sharded params and optimizer state plus a small JSON record (step,
data-iterator position). Out: a step directory per save (the latest `keep`, plus the one a
position names under `keep_step`: the train loop's best eval); restore returns arrays placed on
the shardings the caller asks for. A save interrupted by a crash is never picked up by restore:
orbax commits a step only once every file is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as keep_policy

STATE_ITEM = "state"  # params + optimizer state (sharded arrays)
META_ITEM = "meta"  # JSON: step, data position
KEEP_KEY = "keep_step"  # a data position's step kept beside the latest ones


@dataclasses.dataclass
class KeepStep:
    """An orbax preservation policy: keeps the one checkpoint `step` (None: none)."""

    step: int | None = None

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        return [c.step == self.step for c in checkpoints]


@dataclasses.dataclass(frozen=True)
class Restored:
    params: Any
    opt_state: Any
    step: int
    data_position: Any


class Checkpointer:
    """A thin owner of one `ocp.CheckpointManager`; every process of a job calls it alike."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True) -> None:
        if not isinstance(keep, int) or keep <= 0:
            raise ValueError(f"keep={keep!r} must be a positive integer (checkpoints to retain)")
        self.directory = Path(directory).absolute()
        self._kept = KeepStep()
        latest = keep_policy.LatestN(n=keep)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=keep_policy.AnyPreservationPolicy([latest, self._kept]),
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save that a crash cut short
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, META_ITEM)
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, params: Any, opt_state: Any, data_position: Any = None) -> None:
        """Start writing step `step`; returns once the arrays are copied off the device.

        A dict `data_position` with an int under KEEP_KEY keeps that step from now on, however
        many newer ones come (one such step at a time: the latest save's)."""
        if isinstance(data_position, dict) and data_position.get(KEEP_KEY) is not None:
            self._kept.step = int(data_position[KEEP_KEY])
        meta = {"step": int(step), "data_position": data_position}
        state = {"params": params, "opt_state": opt_state}
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
        )
        self._manager.save(int(step), args=args, force=True)

    def restore(
        self, abstract_params: Any, abstract_opt_state: Any, step: int | None = None
    ) -> Restored:
        """Read `step` (default: the latest committed one) onto the given abstract shardings.

        `abstract_*` are trees of `jax.ShapeDtypeStruct` carrying `sharding`, so each process
        reads only its own shards.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no committed checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise ValueError(
                f"step={step} is not among the checkpoints {self.all_steps()} in {self.directory}"
            )
        target = {"params": abstract_params, "opt_state": abstract_opt_state}
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(target), META_ITEM: ocp.args.JsonRestore()}
        )
        out = self._manager.restore(step, args=args)
        meta = out[META_ITEM]
        state = out[STATE_ITEM]
        return Restored(
            params=state["params"],
            opt_state=state["opt_state"],
            step=int(meta["step"]),
            data_position=meta["data_position"],
        )

    def wait(self) -> None:
        """Block until pending async writes are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
