"""Subprocess: train the tiny model for STEPS steps with a checkpoint after every step.

`resumable_training.py CKPT_DIR STEPS OUT.npz` resumes from the latest committed checkpoint in
CKPT_DIR when there is one (the data iterator position comes back with it), prints `step N` after
each step, and writes the final params to OUT.npz. The kill-and-resume test SIGKILLs it mid-run.
"""

from __future__ import annotations

import sys

import numpy as np
from tinylearn import flat, random_step, tiny_model

from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.step import Learner

CONFIG = LearnerConfig(learning_rate=1e-2, checkpoint_every=1, keep_checkpoints=2)


def step_batches(position: int):
    """The data stream: step `position`'s micro-batches depend only on the position."""
    return random_step(seed=1000 + position, count=1 + (position * 37) % 60, buckets=((8, 64),))


def train(ckpt_dir: str | None, steps: int) -> Learner:
    learner = Learner(tiny_model(), CONFIG.replace(checkpoint_dir=ckpt_dir))
    position = 0
    if learner.checkpointer is not None and learner.checkpointer.latest_step() is not None:
        position = learner.restore()["next_batch"]
        print(f"resumed at step {learner.step}", flush=True)
    while learner.step < steps:
        learner.train_step(step_batches(position))
        position += 1
        due = learner.step % CONFIG.checkpoint_every == 0  # as the train loop schedules saves
        if learner.checkpointer is not None and due:
            learner.save({"next_batch": position})
        print(f"step {learner.step}", flush=True)
    return learner


def main(ckpt_dir: str, steps: int, out: str) -> None:
    learner = train(ckpt_dir, steps)
    learner.close()
    np.savez(out, params=flat(learner.params_state()), opt=flat(learner.opt_state))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
