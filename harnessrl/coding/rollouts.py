"""Coding rollouts: an unchanged coding agent run in each task's sandbox, and a grade of its diff.

In: coding tasks (`rollout.tasks=coding:shipped` or `coding:PATH`) and run specs with the sidecar
URL. Out: `RunResult`s whose `output` is the diff we took of the agent's checkout, and an
evaluator that grades that diff in a fresh sandbox. mini-swe-agent is the default harness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.coding.grade import Grade, GradeConfig, diff_of, grade
from harnessrl.coding.repo import GitError
from harnessrl.coding.sandbox import Completed, Sandbox, SandboxConfig, SandboxError, prepare
from harnessrl.coding.tasks import CodingTask, load_tasks
from harnessrl.coding.taskset import load_shipped
from harnessrl.rollout.evaluators import Evaluation
from harnessrl.rollout.local import LocalLauncherConfig
from harnessrl.rollout.round import RoundResult
from harnessrl.rollout.tasks import RunResult, RunSpec, Task
from harnessrl.traces.schema import CallRecord, RolloutState

PREFIX = "coding:"
SHIPPED = "shipped"
# mini-swe-agent's exit statuses that end an episode (the agent's diff is its outcome, whatever
# the exit code); any other status (an endpoint that failed, a crash) fails the run.
ENDINGS = (
    "Submitted",
    "LimitsExceeded",
    "TimeExceeded",
    "RepeatedFormatError",
    "ContextWindowExceededError",
)
TRAJECTORY = "traj.json"


@dataclass(frozen=True)
class CodingConfig:
    """Coding tasks: the harness run in each task's sandbox, and how its diff is graded."""

    # The harness argv run in the checkout; empty: mini-swe-agent, unattended, from the settings
    # below. {task_file} (the problem statement), {out_dir} (a writable folder outside the
    # checkout), {base_url} and {rollout_id} expand.
    command: tuple[str, ...] = ()
    # a mini-swe-agent config file, or one of its own by name (mini.yaml, mini_textbased.yaml)
    mini_config: str = "{examples}/mini.yaml"
    model_class: str = "litellm_textbased"  # litellm: tool calls | litellm_textbased: text
    mini_settings: tuple[str, ...] = ()  # more mini-swe-agent `-c key=value` settings
    step_limit: int = 8  # model calls per run
    max_tokens: int = 256  # per model call
    temperature: float = 1.0  # sampling temperature of the model calls
    model_attempts: int = 2  # tries per model call (mini-swe-agent waits 4-60 s between them)
    graded_exits: tuple[str, ...] = ENDINGS  # exit statuses graded even when the exit code is not 0
    grade_workers: int = 2  # runs graded at once
    trajectories: str = ""  # folder that keeps each run's trajectory as ROLLOUT_ID.traj.json
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where the harness runs
    grade: GradeConfig = field(default_factory=GradeConfig)  # the grader and its own sandbox

    def __post_init__(self) -> None:
        for name in ("step_limit", "max_tokens", "model_attempts", "grade_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.coding.{name} must be an integer >= 1, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"rollout.coding.temperature must be >= 0, got {self.temperature!r}")
        if not self.command and not self.model_class:
            raise ValueError("rollout.coding.model_class must name a mini-swe-agent model class")


def is_coding(spec: str) -> bool:
    return spec.startswith(PREFIX)


@dataclass(frozen=True)
class CodingTaskSets:
    """Train and held-out tasks as the loop runs them, and the coding task behind each id."""

    train: list[Task]
    eval: list[Task]
    by_id: dict[str, CodingTask]


def as_task(task: CodingTask) -> Task:
    """The round's view of a coding task: its id and statement (never its patches)."""
    return Task(task.instance_id, task.problem_statement, meta={"kind": task.kind})


def read_coding_tasks(spec: str) -> list[CodingTask]:
    """`coding:shipped` (the HumanEval bug set) or `coding:PATH` (JSONL, task folder(s))."""
    if not is_coding(spec):
        raise ValueError(f"coding tasks are named {PREFIX}shipped or {PREFIX}PATH, got {spec!r}")
    source = spec[len(PREFIX) :]
    if source == SHIPPED:
        return load_shipped()
    if not source:
        raise ValueError(f"{spec!r} names no tasks: write {PREFIX}shipped or {PREFIX}PATH")
    tasks = load_tasks(source)
    if not tasks:
        raise ValueError(f"{spec!r} holds no tasks")
    return tasks


def coding_task_sets(tasks: str, eval_tasks: str, num_eval: int) -> CodingTaskSets:
    """The train set and, unless `eval_tasks` names its own, `num_eval` tasks held out of it.

    The held-out tasks are those whose instance ids hash lowest: the same on every machine and
    seed, and independent of the order of the file.
    """
    train = read_coding_tasks(tasks)
    if eval_tasks:
        held = read_coding_tasks(eval_tasks if is_coding(eval_tasks) else PREFIX + eval_tasks)
        both = {t.instance_id for t in train} & {t.instance_id for t in held}
        if both:
            raise ValueError(
                f"rollout.eval_tasks shares {len(both)} instance(s) with rollout.tasks, e.g. "
                f"{sorted(both)[0]!r}; held-out tasks must not be trained on"
            )
    else:
        if num_eval >= len(train):
            raise ValueError(
                f"rollout.num_eval_tasks={num_eval} leaves no train tasks of the {len(train)} in "
                f"{tasks!r}; lower it or give rollout.eval_tasks"
            )
        ranked = sorted(train, key=lambda t: hashlib.sha256(t.instance_id.encode()).hexdigest())
        held_ids = {t.instance_id for t in ranked[:num_eval]}
        held = [t for t in train if t.instance_id in held_ids]
        train = [t for t in train if t.instance_id not in held_ids]
    by_id = {t.instance_id: t for t in [*train, *held]}
    return CodingTaskSets([as_task(t) for t in train], [as_task(t) for t in held], by_id)


def mini_executable() -> str:
    """mini-swe-agent's `mini` beside this interpreter (the project's extra), else on PATH."""
    beside = Path(sys.executable).with_name("mini")
    found = str(beside) if beside.is_file() else shutil.which("mini")
    if found is None:
        raise ValueError(
            "rollout.coding runs mini-swe-agent, which is not installed: "
            "pip install 'harnessrl[coding]' (or set rollout.coding.command to your harness)"
        )
    return found


def mini_config_file(spec: str) -> Path | str:
    """A config file to copy into each sandbox, or the name of one mini-swe-agent ships."""
    if Path(spec).is_file():
        return Path(spec)
    import minisweagent.config as builtin

    if (Path(builtin.__file__).parent / spec).is_file():
        return spec
    raise ValueError(
        f"rollout.coding.mini_config={spec!r} is neither a file nor one of mini-swe-agent's own "
        "configs (mini.yaml, mini_textbased.yaml)"
    )


class CodingLauncher:
    """Runs each spec's harness in a fresh sandbox of its task and takes the diff it leaves."""

    def __init__(
        self,
        config: CodingConfig,
        tasks: Mapping[str, CodingTask],
        *,
        local: LocalLauncherConfig,
        model: str,
    ) -> None:
        self.config, self.tasks, self.local, self.model = config, tasks, local, model
        self._mini = "" if config.command else mini_executable()
        self._mini_config = "" if config.command else mini_config_file(config.mini_config)
        self._stopping = threading.Event()
        self._live: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        unknown = [s.task.task_id for s in specs if s.task.task_id not in self.tasks]
        if unknown:
            raise ValueError(f"no coding task behind task id(s) {unknown[:3]}")
        if not specs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.local.concurrency, len(specs))) as pool:
            return list(pool.map(self._run_one, specs))

    def stop(self) -> None:
        """Kill every live harness (used on Ctrl-C); pending runs come back FAILED."""
        self._stopping.set()
        with self._lock:
            procs = list(self._live.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap's death ends its pid namespace

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._live[proc.pid] = proc
        if self._stopping.is_set():
            os.killpg(proc.pid, signal.SIGKILL)

    def _run_one(self, spec: RunSpec) -> RunResult:
        start = time.monotonic()
        if self._stopping.is_set():
            return _failed(spec, "launcher stopped before the run started", start)
        try:
            sandbox = prepare(self.tasks[spec.task.task_id], self.config.sandbox)
        except SandboxError as err:
            return _failed(spec, str(err), start)
        with sandbox:
            out_dir = sandbox.dir / "harness"
            out_dir.mkdir()
            try:
                done = self._harness(sandbox, spec, out_dir)
                diff = diff_of(sandbox)
            except GitError as err:
                return _failed(spec, f"could not take the diff of the checkout: {err}", start)
            finally:
                with self._lock:
                    self._live = {k: p for k, p in self._live.items() if p.poll() is None}
            info = _trajectory_info(out_dir / TRAJECTORY)
            self._keep(out_dir / TRAJECTORY, spec.rollout_id)
            info.update(isolation=sandbox.isolation, not_isolated=list(sandbox.not_isolated))
        state = self._state(done.exit_code, done.timed_out, info.get("exit_status"))
        stderr = done.stderr
        if done.timed_out:
            stderr += (
                f"\n[harnessrl] run exceeded its timeout of {spec.timeout_s:g}s and was killed"
            )
        if self._stopping.is_set() and state == RolloutState.SUCCEEDED and done.exit_code != 0:
            state = RolloutState.FAILED
        info["diff_lines"] = diff.count("\n")
        return RunResult(
            spec.rollout_id, state, done.exit_code, done.stdout, stderr,
            time.monotonic() - start, diff, info,
        )  # fmt: skip

    def _keep(self, trajectory: Path, rollout_id: str) -> None:
        if self.config.trajectories and trajectory.is_file():
            folder = Path(self.config.trajectories)
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(trajectory, folder / f"{rollout_id}.{TRAJECTORY}")

    def _harness(self, sandbox: Sandbox, spec: RunSpec, out_dir: Path) -> Completed:
        task_file = out_dir / "task.md"
        task_file.write_text(spec.task.prompt)
        url = sandbox.forward(spec.base_url)
        values = {"{task_file}": str(task_file), "{out_dir}": str(out_dir),
                  "{base_url}": url, "{rollout_id}": spec.rollout_id}  # fmt: skip
        if self.config.command:
            argv = [_expand(a, values) for a in self.config.command]
        else:
            argv = self._mini_argv(spec, url, out_dir)
        env = {
            "OPENAI_BASE_URL": url,
            "OPENAI_API_KEY": self.local.api_key,
            "HARNESSRL_ROLLOUT_ID": spec.rollout_id,
            "HARNESSRL_TASK_FILE": str(task_file),
            # mini-swe-agent unattended: no first-run setup, no cost map download, no price
            # needed for a local model, and a bounded number of tries per model call.
            "MSWEA_CONFIGURED": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(self.config.model_attempts),
            "MSWEA_GLOBAL_CONFIG_DIR": str(out_dir / "mini-config"),
        }
        return sandbox.run(
            argv, timeout_s=spec.timeout_s, env=env, writable=(out_dir,), on_start=self._started
        )

    def _mini_argv(self, spec: RunSpec, url: str, out_dir: Path) -> list[str]:
        config = self._mini_config
        if isinstance(config, Path):  # copied in: only the sandbox's own folders are visible
            shutil.copyfile(config, out_dir / "mini.yaml")
            config = str(out_dir / "mini.yaml")
        c = self.config
        settings = [
            config,
            f"agent.step_limit={c.step_limit}",
            f"model.model_class={c.model_class}",
            f"model.model_kwargs.api_base={url}",
            f"model.model_kwargs.api_key={self.local.api_key}",
            f"model.model_kwargs.max_tokens={c.max_tokens}",
            f"model.model_kwargs.temperature={c.temperature}",
            *c.mini_settings,
        ]
        return [
            self._mini, "--yolo", "--exit-immediately", "--cost-limit=0",
            *(f"--config={s}" for s in settings), f"--model=hosted_vllm/{self.model}",
            f"--task={spec.task.prompt}", f"--output={out_dir / TRAJECTORY}",
        ]  # fmt: skip

    def _state(self, exit_code: int | None, timed_out: bool, status: Any) -> RolloutState:
        if timed_out:
            return RolloutState.TIMED_OUT
        if exit_code == 0 or status in self.config.graded_exits:
            return RolloutState.SUCCEEDED
        return RolloutState.FAILED


def _expand(arg: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace(key, value)
    return arg


def _trajectory_info(path: Path) -> dict[str, Any]:
    """What mini-swe-agent's trajectory says about the run (nothing for other harnesses)."""
    try:
        info = json.loads(path.read_text()).get("info", {})
    except (OSError, ValueError, AttributeError):
        return {}
    stats = info.get("model_stats") or {}
    return {"exit_status": info.get("exit_status", ""), "harness_calls": stats.get("api_calls")}


def _failed(spec: RunSpec, why: str, start: float) -> RunResult:
    return RunResult(
        spec.rollout_id, RolloutState.FAILED, None, "", f"[harnessrl] {why}",
        time.monotonic() - start, "", {"error": why},
    )  # fmt: skip


class CodingEvaluator:
    """Grades a run's diff (its `output`) in a fresh sandbox; reward None if no grade was made."""

    def __init__(self, tasks: Mapping[str, CodingTask], config: GradeConfig) -> None:
        self.tasks, self.config = tasks, config

    def __call__(
        self, task: Task, result: RunResult, calls: Sequence[CallRecord] = ()
    ) -> Evaluation:
        if task.task_id not in self.tasks:
            raise ValueError(
                f"evaluator 'coding' has no coding task {task.task_id!r}; it grades only "
                "rollout.tasks=coding:... tasks"
            )
        verdict = grade(self.tasks[task.task_id], result.output, self.config)
        return Evaluation(verdict.reward, grade_info(verdict))


def grade_info(g: Grade) -> dict[str, Any]:
    """The grade as it goes into the rollout record (the diff itself is the run's output)."""
    info: dict[str, Any] = {
        "resolved": g.resolved,
        "guards": list(g.guards),
        "dropped": list(g.dropped),
        "applied": g.applied,
        "f2p_passed": sum(ok for _, ok in g.f2p),
        "f2p": len(g.f2p),
        "p2p_passed": sum(ok for _, ok in g.p2p),
        "p2p": len(g.p2p),
        "grade_timed_out": g.timed_out,
        "grade_exit_code": g.exit_code,
        "grade_s": round(g.duration_s, 3),
    }
    if g.error:
        info["error"] = g.error
    if g.not_isolated:
        info["grade_not_isolated"] = list(g.not_isolated)
    return info


def coding_metrics(result: RoundResult, prefix: str = "") -> dict[str, Any]:
    """Resolved rate (of all runs), runs with a guard trip and trips by guard; {} if none graded."""
    infos = [result.infos.get(r.rollout_id, {}) for r in result.results]
    if not any("resolved" in i for i in infos):
        return {}
    trips = Counter(g for i in infos for g in i.get("guards", ()))
    return {
        f"{prefix}resolved_rate": sum(bool(i.get("resolved")) for i in infos) / len(infos),
        f"{prefix}guard_trips": sum(1 for i in infos if i.get("guards")),
        f"{prefix}guard_causes": dict(sorted(trips.items())),
    }
