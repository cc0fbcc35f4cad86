"""The passk step: which probed tasks stay, and a probe that is one round of the real train loop."""

from __future__ import annotations

import json
import sys
import tempfile

import pytest

from harnessrl.coding.tasks import CodingTask, write_jsonl
from harnessrl.coding.taskset import load_shipped
from harnessrl.curate.clean import CleanConfig, clean
from harnessrl.curate.probe import PassKFilter, select_passk
from harnessrl.traces import open_store

pytestmark = pytest.mark.filterwarnings("ignore:coding sandboxes run as plain processes")


def test_select_keeps_mixed_outcomes_and_a_seeded_share_of_all_fail_tasks():
    tasks = load_shipped()[:10]
    ids = [t.instance_id for t in tasks]
    runs: list[list[float | None]] = [
        [1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0],
        [None, None, None], [None, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, None, 0.0], [0.0, 0.5, 0.0],
    ]  # fmt: skip
    rewards = dict(zip(ids, runs, strict=True))
    config = PassKFilter(k=3, keep_all_fail=0.5)
    drops = select_passk(rewards, tasks, config)
    assert {0, 6, 9}.isdisjoint(drops)  # mixed (a failed run is no evidence either way)
    assert "nothing to learn" in drops[1] and "nothing to learn" in drops[7]
    assert "none of its 3 probing runs was graded" in drops[5]
    all_fail = [2, 3, 4, 8]
    kept = [i for i in all_fail if i not in drops]
    assert len(kept) == 2  # round(0.5 * 4)
    # The share is chosen by the seed and the instance ids, not by the order of the file.
    order = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    again = select_passk(rewards, [tasks[i] for i in order], config)
    assert {tasks[order[i]].instance_id for i in again} == {tasks[i].instance_id for i in drops}
    picks = {
        frozenset(i for i in all_fail if i not in select_passk(rewards, tasks, PassKFilter(k=3, keep_all_fail=0.5, seed=s)))
        for s in range(8)
    }  # fmt: skip
    assert len(picks) > 1  # other seeds keep other tasks
    assert set(all_fail) <= set(select_passk(rewards, tasks, PassKFilter(k=3)))
    assert set(all_fail).isdisjoint(select_passk(rewards, tasks, PassKFilter(k=3, keep_all_fail=1)))


# Stands in for a coding agent inside each run's sandbox: applies the task's fix on the runs the
# plan says it solves (the run index ends the rollout id, `...-rJ`).
HARNESS = """
import json, os, subprocess, sys
run = int(sys.argv[1].rsplit("-r", 1)[1])
for module, (patch, solves) in json.loads(sys.argv[2]).items():
    if os.path.exists(module) and run in solves:
        subprocess.run(["git", "apply", "-"], input=patch, text=True, check=True)
"""


def module_of(task: CodingTask) -> str:
    return next(p for p, _ in task.files if not p.startswith("test_"))


@pytest.fixture
def short_dir():
    """Sandboxes under a short path: the sidecar relay's Unix socket path must fit 108 bytes."""
    with tempfile.TemporaryDirectory(prefix="hrl-") as tmp:
        yield tmp


def test_passk_through_one_round_of_the_train_loop(tmp_path, short_dir):
    tasks = load_shipped()[:4]
    solves = {tasks[0].instance_id: [0, 1], tasks[1].instance_id: [1],
              tasks[2].instance_id: [], tasks[3].instance_id: []}  # fmt: skip
    plan = {module_of(t): (t.patch, solves[t.instance_id]) for t in tasks}
    command = [sys.executable, "-c", HARNESS, "{rollout_id}", json.dumps(plan)]
    write_jsonl(tasks, tmp_path / "in.jsonl")
    roots = [f"rollout.coding.{s}.root={short_dir}" for s in ("sandbox", "grade.sandbox")]
    train_set = (
        "serve.model=tiny", "serve.warmup=false", "serve.num_slots=2", "rollout.timeout_s=120",
        f"rollout.coding.command={json.dumps(command)}", "rollout.coding.grade.plugin_autoload=false",
        *roots,
    )  # fmt: skip
    out = tmp_path / "out.jsonl"
    report = clean(CleanConfig(
        input=str(tmp_path / "in.jsonl"), output=str(out), steps=("passk",),
        passk=PassKFilter(k=2, keep_all_fail=0.5, train_set=train_set),
    ))  # fmt: skip
    passk = report.steps[-1]
    assert passk.name == "passk" and (passk.rows_in, passk.rows_out) == (4, 2)
    assert "nothing to learn" in passk.dropped[tasks[0].instance_id]  # solved in both runs
    kept = [r.task.instance_id for r in report.kept]
    assert tasks[1].instance_id in kept  # solved once in two
    assert len({tasks[2].instance_id, tasks[3].instance_id} & set(kept)) == 1  # half the all-fail
    # The runs went through the loop's store: a finished, graded record per run.
    store = open_store(f"sqlite:///{tmp_path / 'out.jsonl.passk' / 'traces.db'}")
    try:
        records = store.rollouts()
    finally:
        store.close()
    by_task: dict[str, list[float | None]] = {}
    for r in sorted(records, key=lambda r: r.rollout_id):
        by_task.setdefault(r.task_id, []).append(r.reward)
    assert by_task == {tasks[0].instance_id: [1.0, 1.0], tasks[1].instance_id: [0.0, 1.0],
                       tasks[2].instance_id: [0.0, 0.0], tasks[3].instance_id: [0.0, 0.0]}  # fmt: skip
