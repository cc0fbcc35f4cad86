"""The train entry point: `--smoke` end to end (server, sidecar, harness processes, store,
packing, 2-device sharded update, weight swap) and its outputs; CLI parsing; resume."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.train import parse_args

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(
    r"^train: eval_reward_start=(\d+\.\d+) eval_reward_end=(\d+\.\d+) steps=(\d+) minutes=(\d+\.\d+)$"
)


def _train(out: Path, *args: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "harnessrl.train", "--smoke", f"run.out_dir={out}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_smoke_runs_the_whole_loop(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    proc = _train(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, f"last line is {last!r}"
    assert int(m.group(3)) == 2

    records = _records(out)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in train:
        assert r["runs"] == 4 and r["runs_failed"] == 0
        assert r["learner_step"] == r["step"]  # the sharded update ran every step
        assert r["micro_batches"] >= 1 and 0 < r["packing_efficiency"] <= 1
        assert r["calls_per_run"] >= 1 and r["seqs_per_run"] >= 1
        assert r["t_swap"] > 0 and r["compiles"] > 0
    # Compiles stop growing once every shape has been seen.
    assert train[1]["compiles"] == train[0]["compiles"]

    config = json.loads((out / "config.json").read_text())
    assert config["learner"]["mesh"] == "data=2"
    assert (out / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "2").is_dir()
    assert (out / "hf" / "config.json").is_file() and list((out / "hf").glob("*.safetensors"))

    db = sqlite3.connect(out / "traces.db")
    states = dict(db.execute("select state, count(*) from rollouts group by state").fetchall())
    assert states == {"succeeded": 8 + 12}  # 2 steps × 4 runs + 3 evals × 4 tasks
    versions = dict(
        db.execute(
            "select substr(rollout_id, 1, 2), max(policy_version) from calls group by 1"
        ).fetchall()
    )
    assert versions == {
        "s0": 0,
        "s1": 1,
        "e0": 0,
        "e1": 1,
        "e2": 2,
    }  # every swap reached the server
    n_calls, n_ids = db.execute(
        "select count(*), sum(length(prompt_token_ids) > 2) from calls"
    ).fetchone()
    assert n_calls >= 20 and n_ids == n_calls
    db.close()


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for key in ("run.steps", "rollout.harness", "sidecar.pause_timeout_s", "serve.num_slots",
                "data.loss_mode", "learner.learning_rate"):  # fmt: skip
        assert key in text


def test_cli_overrides_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_args(["steps=3", "--learner.learning_rate=2e-6", "--mesh", "fsdp", "--smoke"])
    assert cfg.run.steps == 3 and cfg.learner.learning_rate == 2e-6
    assert cfg.learner.mesh == "fsdp" and cfg.serve.model == "tiny"
    with pytest.raises(SystemExit) as exc:
        parse_args(["stepz=3"])
    assert exc.value.code == 2
    assert "unknown config key 'stepz'" in capsys.readouterr().err


@pytest.mark.skipif(
    os.environ.get("HARNESSRL_SLOW") != "1",
    reason="Ctrl-C and resume runs the smoke loop twice (~3 min); set HARNESSRL_SLOW=1 to run it",
)
def test_ctrl_c_then_restart_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "resume"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = [sys.executable, "-m", "harnessrl.train", "--smoke", f"run.out_dir={out}",
            "steps=4", "run.resume=true"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not (out / "checkpoints" / "1").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout[-2000:]
    assert "resume from the last checkpoint" in stdout
    done = [r["step"] for r in _records(out) if r["kind"] == "train"]
    assert done and max(done) < 4

    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = re.search(r"resumed from checkpoint at step (\d+)", again.stdout)
    assert resumed and int(resumed.group(1)) >= 1
    steps = [r["step"] for r in _records(out) if r["kind"] == "train"]
    assert steps[-1] == 4 and sorted(set(steps)) == [1, 2, 3, 4]
    assert FINAL.match(again.stdout.strip().splitlines()[-1])
