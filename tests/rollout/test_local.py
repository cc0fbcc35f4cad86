"""Local launcher: env and task wiring, exit codes, timeouts that kill whole process groups."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from harnessrl.rollout.local import LocalLauncher, LocalLauncherConfig, parse_command
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.traces.schema import RolloutState


def _spec(i: int = 0, timeout_s: float = 30.0, prompt: str = "What is 2+3?") -> RunSpec:
    task = Task(task_id=f"t{i}", prompt=prompt, answer="5", meta={"k": i})
    return RunSpec(
        rollout_id=f"r{i}",
        task=task,
        group_id="g0",
        attempt=0,
        base_url=f"http://127.0.0.1:9/rollouts/r{i}/v1",
        timeout_s=timeout_s,
    )


def _launcher(code: str, **kw: object) -> LocalLauncher:
    return LocalLauncher(LocalLauncherConfig(command=(sys.executable, "-c", code), **kw))  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state to tell.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


def test_harness_gets_env_file_and_stdin_and_output_is_kept() -> None:
    code = (
        "import json, os, sys\n"
        "task = json.load(open(os.environ['HARNESSRL_TASK_FILE']))\n"
        "print(json.dumps({'stdin': sys.stdin.read(), 'task': task,"
        " 'env': {k: os.environ[k] for k in ('OPENAI_BASE_URL', 'OPENAI_API_KEY',"
        " 'HARNESSRL_TASK_PROMPT', 'HARNESSRL_ROLLOUT_ID')}}))\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    [res] = _launcher(code, api_key="k-123").run([_spec(3)])
    assert res.state == RolloutState.SUCCEEDED and res.exit_code == 0
    got = json.loads(res.stdout)
    assert got["stdin"] == "What is 2+3?"
    assert got["task"] == {
        "task_id": "t3",
        "prompt": "What is 2+3?",
        "answer": "5",
        "meta": {"k": 3},
    }
    assert got["env"] == {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/rollouts/r3/v1",
        "OPENAI_API_KEY": "k-123",
        "HARNESSRL_TASK_PROMPT": "What is 2+3?",
        "HARNESSRL_ROLLOUT_ID": "r3",
    }
    assert res.stderr.strip() == "to stderr"
    assert res.output == res.stdout.strip()


def test_harness_gets_its_reward_credential_and_never_the_control_token() -> None:
    code = (
        "import json, os\n"
        "print(json.dumps({k: os.environ.get(k) for k in ('HARNESSRL_REWARD_URL',"
        " 'HARNESSRL_REWARD_TOKEN', 'HARNESSRL_CONTROL_TOKEN')}))\n"
    )
    env = {**os.environ, "HARNESSRL_CONTROL_TOKEN": "the-sidecars-own"}
    launcher = LocalLauncher(LocalLauncherConfig(command=(sys.executable, "-c", code)), env=env)
    offered = dataclasses.replace(
        _spec(1), reward_url="http://s/rollouts/r1/reward", reward_token="t1"
    )
    with_reward, without = launcher.run([offered, _spec(2)])
    assert json.loads(with_reward.stdout) == {
        "HARNESSRL_REWARD_URL": "http://s/rollouts/r1/reward",
        "HARNESSRL_REWARD_TOKEN": "t1",
        "HARNESSRL_CONTROL_TOKEN": None,
    }
    assert set(json.loads(without.stdout).values()) == {None}  # nothing offered, nothing set


def test_placeholders_in_the_command_expand() -> None:
    cfg = LocalLauncherConfig(
        command=(
            sys.executable,
            "-c",
            "import sys; print(sys.argv[1:])",
            "{rollout_id}",
            "{task_file}",
        )
    )
    [res] = LocalLauncher(cfg).run([_spec(7)])
    args = eval(res.output)  # a printed Python list
    assert args[0] == "r7" and args[1].endswith("task.json")


def test_nonzero_exit_is_failed_not_raised() -> None:
    [res] = _launcher("import sys; print('partial'); sys.exit(3)").run([_spec()])
    assert res.state == RolloutState.FAILED
    assert res.exit_code == 3 and res.output == "partial"


def test_missing_executable_is_a_failed_result() -> None:
    launcher = LocalLauncher(LocalLauncherConfig(command=("/nonexistent/harness-binary",)))
    [res] = launcher.run([_spec()])
    assert res.state == RolloutState.FAILED and res.exit_code is None
    assert "could not start harness" in res.stderr


def test_timeout_kills_the_whole_process_group_even_when_term_is_ignored(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c',"
        " 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    [res] = _launcher(code, kill_grace_s=0.3).run([_spec(timeout_s=1.5)])
    elapsed = time.monotonic() - start
    assert res.state == RolloutState.TIMED_OUT
    assert res.exit_code == -9  # TERM was ignored, so KILL ended it
    assert "started" in res.stdout and "timeout of 1.5s" in res.stderr
    assert elapsed < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "grandchild survived the timeout"


def test_term_is_sent_first_so_a_harness_can_clean_up() -> None:
    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('cleaned up', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(60)\n"
    )
    [res] = _launcher(code, kill_grace_s=5.0).run([_spec(timeout_s=1.0)])
    assert res.state == RolloutState.TIMED_OUT  # a timed-out run stays excluded even if it exits 0
    assert "cleaned up" in res.stdout


def test_concurrency_limit_is_respected(tmp_path: Path) -> None:
    code = (
        "import os, time\n"
        f"d = {str(tmp_path)!r}\n"
        "rid = os.environ['HARNESSRL_ROLLOUT_ID']\n"
        "open(os.path.join(d, rid + '.start'), 'w').write(repr(time.time()))\n"
        "time.sleep(0.4)\n"
        "open(os.path.join(d, rid + '.end'), 'w').write(repr(time.time()))\n"
    )
    specs = [_spec(i) for i in range(6)]
    results = _launcher(code, concurrency=2).run(specs)
    assert [r.rollout_id for r in results] == [s.rollout_id for s in specs]
    assert all(r.state == RolloutState.SUCCEEDED for r in results)
    spans = [
        (float((tmp_path / f"r{i}.start").read_text()), float((tmp_path / f"r{i}.end").read_text()))
        for i in range(6)
    ]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2


def test_stop_kills_live_runs() -> None:
    launcher = _launcher("import time; time.sleep(60)")
    import threading

    out: list = []
    th = threading.Thread(target=lambda: out.extend(launcher.run([_spec(0), _spec(1)])))
    th.start()
    time.sleep(1.0)
    launcher.stop()
    th.join(timeout=10)
    assert not th.is_alive()
    assert [r.state for r in out] == [RolloutState.FAILED, RolloutState.FAILED]


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="command is empty"):
        LocalLauncher(LocalLauncherConfig(command=()))
    with pytest.raises(ValueError, match="command must be a list of strings"):
        LocalLauncherConfig(command=("x", None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency"):
        LocalLauncherConfig(command=("x",), concurrency=0)
    with pytest.raises(ValueError, match="kill_grace_s"):
        LocalLauncherConfig(command=("x",), kill_grace_s=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        _spec(timeout_s=0)
    with pytest.raises(ValueError, match="empty"):
        parse_command("  ")
    assert parse_command("python -m x --a 'b c'") == ("python", "-m", "x", "--a", "b c")
