"""Task records, JSONL task sets and the built-in addition tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.rollout.builtin_tasks import addition_tasks
from harnessrl.rollout.tasks import RunSpec, Task, load_tasks, save_tasks


def test_jsonl_round_trip(tmp_path: Path) -> None:
    tasks = [Task("a", "p1", "1", {"x": 1}), Task("b", "p2")]
    path = save_tasks(tasks, tmp_path / "sub" / "t.jsonl")
    assert load_tasks(path) == tasks
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_load_tasks_rejects_bad_files(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="does not exist"):
        load_tasks(p)
    p.write_text('{"task_id": "a", "prompt": "x"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not valid JSON"):
        load_tasks(p)
    p.write_text('{"task_id": "a", "prompt": "x"}\n\n{"task_id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match=r":3: duplicate task_id 'a'"):
        load_tasks(p)
    p.write_text('{"task_id": "a", "prompt": "x", "answr": "1"}\n')
    with pytest.raises(ValueError, match="unknown task field"):
        load_tasks(p)
    p.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="missing required field"):
        load_tasks(p)
    p.write_text('{"task_id": "a", "prompt": "x", "answer": 3}\n')
    with pytest.raises(ValueError, match="quote numbers"):
        load_tasks(p)
    p.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no tasks"):
        load_tasks(p)


def test_task_and_spec_validation() -> None:
    with pytest.raises(ValueError, match="task_id"):
        Task("", "p")
    with pytest.raises(TypeError, match="prompt"):
        Task("a", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout_id"):
        RunSpec("a/b", Task("a", "p"), "g", 0, "http://x/v1", 1.0)


def test_addition_tasks_are_deterministic_and_disjoint() -> None:
    train, held = addition_tasks(100, 40, seed=3)
    again_train, again_held = addition_tasks(100, 40, seed=3)
    assert (train, held) == (again_train, again_held)
    assert len(train) == 100 and len(held) == 40
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    for t in train + held:
        a, b = t.meta["a"], t.meta["b"]
        assert 1 <= a <= 20 and 1 <= b <= 20
        assert (
            t.answer == str(a + b) and t.prompt == f"What is {a}+{b}? Answer with just the number."
        )
    # Held-out tasks do not move when the train split grows.
    assert addition_tasks(300, 40, seed=3)[1] == held
    assert addition_tasks(100, 40, seed=4)[1] != held


def test_addition_tasks_bad_sizes() -> None:
    with pytest.raises(ValueError, match="only 400 distinct"):
        addition_tasks(390, 20)
    with pytest.raises(ValueError, match="n_train"):
        addition_tasks(0, 5)


def test_addition_tasks_saved_as_jsonl(tmp_path: Path) -> None:
    train, held_out = addition_tasks(10, 5, seed=1)
    train_path = save_tasks(train, tmp_path / "train.jsonl")
    eval_path = save_tasks(held_out, tmp_path / "eval.jsonl")
    assert len(load_tasks(train_path)) == 10 and len(load_tasks(eval_path)) == 5
    first = json.loads(eval_path.read_text().splitlines()[0])
    assert set(first) == {"task_id", "prompt", "answer", "meta"}
