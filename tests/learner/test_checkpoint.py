from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from resumable_training import CONFIG, train
from tinylearn import flat, random_step, tiny_model

from harnessrl.learner.checkpoint import Checkpointer
from harnessrl.learner.step import Learner

STEPS = 6


def test_kill_9_mid_training_then_resume_is_bitwise_identical(run_script, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_script(
        "resumable_training.py",
        str(ckpt),
        str(STEPS),
        str(tmp_path / "unused.npz"),
        background=True,
    )
    try:
        for line in proc.stdout:
            if line.strip() == "step 3":
                proc.send_signal(signal.SIGKILL)  # mid-run, possibly mid-write of a checkpoint
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    committed = Checkpointer(ckpt).all_steps()
    assert committed and max(committed) < STEPS
    out = run_script("resumable_training.py", str(ckpt), str(STEPS), str(tmp_path / "resumed.npz"))
    assert "resumed at step" in out and f"step {STEPS}" in out
    resumed = np.load(tmp_path / "resumed.npz")
    straight = train(None, STEPS)  # the uninterrupted run, in this process
    np.testing.assert_array_equal(resumed["params"], flat(straight.params_state()))
    np.testing.assert_array_equal(resumed["opt"], flat(straight.opt_state))


def test_restore_puts_state_back_and_keeps_only_n(tmp_path):
    learner = Learner(
        tiny_model(), CONFIG.replace(checkpoint_dir=str(tmp_path), async_checkpoint=False)
    )
    batches = random_step(seed=1, count=5, buckets=((8, 64),))
    for _ in range(3):
        learner.train_step(batches)
        learner.save({"epoch": 0, "offset": learner.step})
    assert learner.checkpointer.all_steps() == [2, 3]  # keep_checkpoints=2
    saved = flat(learner.params_state())
    learner.train_step(batches)
    assert not np.array_equal(flat(learner.params_state()), saved)
    assert learner.restore() == {"epoch": 0, "offset": 3}
    assert learner.step == 3
    np.testing.assert_array_equal(flat(learner.params_state()), saved)
    assert learner.params["embed_vd"].sharding == learner.param_shardings["embed_vd"]
    with pytest.raises(ValueError, match="step=1 is not among"):
        learner.restore(step=1)
    learner.close()
    with pytest.raises(ValueError, match="no committed checkpoint"):
        Learner(tiny_model(), CONFIG.replace(checkpoint_dir=str(tmp_path / "empty"))).restore()
    with pytest.raises(ValueError, match="checkpoint_dir"):
        Learner(tiny_model(), CONFIG).save()


def test_checkpointer_rejects_bad_keep(tmp_path):
    with pytest.raises(ValueError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)
    assert os.listdir(tmp_path) == []
