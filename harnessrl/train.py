"""`python -m harnessrl.train`: reinforcement learning through an unchanged harness.

In: a config (`--config FILE.yaml`, `key=value` overrides; no flags = the embedded CPU run). Out,
under `run.out_dir`: traces (SQLite), metrics.jsonl + TensorBoard, checkpoints (the best held-out
eval's kept beside the latest), reward.png, and HF exports of the final and the best weights. The
loop: rollouts → rewards → packed arrays → update → swap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import jax

from harnessrl.cli import fail
from harnessrl.coding.rollouts import (
    CodingEvaluator,
    coding_metrics,
    coding_task_sets,
    is_coding,
)
from harnessrl.config import TrainConfig
from harnessrl.config import parse_args as parse_config
from harnessrl.data.pipeline import StepTraces, build_step, read_traces
from harnessrl.host_memory import keep_freed_memory
from harnessrl.learner.checkpoint import KEEP_KEY
from harnessrl.learner.hosts import LeadLearner, follow
from harnessrl.learner.mesh import init_distributed, logical_axis_rules, make_mesh, use_mesh
from harnessrl.learner.plan import check_fits
from harnessrl.learner.step import Learner
from harnessrl.model.formats.load import check_policy_spec, load_policy
from harnessrl.report import MetricsLog, plot_rewards, read_metrics
from harnessrl.rollout import (
    RoundResult,
    Task,
    addition_tasks,
    get_evaluator,
    load_tasks,
    plan_round,
    run_round,
    sample_tasks,
)
from harnessrl.stack import Coding, Stack

SMOKE_DEVICES = 2  # the smoke run's sharded update spans this many simulated CPU devices


def _set_device_flags(argv: list[str]) -> None:
    # XLA reads its flags when the first device is touched, so main() runs this first. Importing
    # jax (and this module) touches none; tests/test_train.py keeps it that way.
    if "--smoke" in argv:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flag = f"--xla_force_host_platform_device_count={SMOKE_DEVICES}"
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


@dataclasses.dataclass
class Run:
    """Everything the loop touches, built once by `setup` and closed by `teardown`."""

    cfg: TrainConfig
    out: Path
    # The store, the serving (the embedded server, or remote servers fed through shared storage),
    # the capture (this process's sidecar, or the harness pods'), the launcher and the evaluator.
    stack: Stack
    learner: LeadLearner  # on multi-process runs, every call is made by all processes
    log: MetricsLog
    train_tasks: list[Task]
    eval_tasks: list[Task]
    tokenizer: Any
    nonce: str  # distinguishes this process's rollout ids from an interrupted run's
    position: dict[str, Any]  # resume bookkeeping saved with each checkpoint
    started: float  # time.monotonic() at process start: model loading counts against the budget
    minutes_before: float = 0.0  # wall minutes of interrupted attempts before this one
    last_eval_s: float = 0.0
    viewer: Any = None  # the trace viewer's handle with run.view


# ---- tasks, launcher, services -------------------------------------------------------------------


def load_task_sets(cfg: TrainConfig) -> tuple[list[Task], list[Task], Coding]:
    r = cfg.rollout
    if is_coding(r.tasks):
        sets = coding_task_sets(r.tasks, r.eval_tasks, r.num_eval_tasks)
        return sets.train, sets.eval, sets.by_id
    if r.tasks == "builtin:addition":
        return (*addition_tasks(r.num_train_tasks, r.num_eval_tasks, seed=cfg.run.seed), {})
    if not r.eval_tasks:
        raise ValueError(f"rollout.tasks={r.tasks!r} needs rollout.eval_tasks (a held-out JSONL)")
    return load_tasks(r.tasks), load_tasks(r.eval_tasks), {}


def setup(cfg: TrainConfig, started: float) -> Run:
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1, default=str))
    train_tasks, eval_tasks, coding = load_task_sets(cfg)
    stack = Stack(cfg, coding, out)  # fails on a bad evaluator or launcher before anything starts
    # Remote servers load their own copy: the learner's is read straight into its shards.
    model, tokenizer, policy_learner = load_learner(cfg, sharded=bool(cfg.rollout.servers))
    learner = LeadLearner(policy_learner)
    stack.start(model, tokenizer)
    log = MetricsLog(out, cfg.run.steps, display=cfg.run.display, tensorboard=cfg.run.tensorboard)
    position = {"step": 0, "attempt": 0, "eval_start": None, "minutes": 0.0, **NO_BEST}
    run = Run(
        cfg, out, stack, learner, log, train_tasks, eval_tasks, tokenizer, uuid.uuid4().hex[:6],
        position, started,
    )  # fmt: skip
    if cfg.run.view:
        try:
            run.viewer = start_view(cfg, stack.store_url, out, tokenizer)
        except BaseException:
            teardown(run)  # nothing may outlive a failed start
            raise
        log.console.print(f"view: {run.viewer.url}")
    return run


def start_view(cfg: TrainConfig, store_url: str, out: Path, tokenizer: Any) -> Any:
    """The trace viewer on 127.0.0.1 (run.view_port), reading the run's store and out_dir; it
    shows token text with the policy's own tokenizer."""
    from harnessrl.view.config import ViewConfig
    from harnessrl.view.serve import start_viewer

    view = ViewConfig(store=store_url, runs=str(out), port=cfg.run.view_port)
    return start_viewer(view, tokenizer)


def load_learner(cfg: TrainConfig, sharded: bool) -> tuple[Any, Any, Learner]:
    """The policy, its tokenizer and its learner. `sharded`: the checkpoint is read straight
    into the learner's shards (each device gets only its own); else the policy is built whole
    on one device, as the embedded server takes it, and the learner places a copy."""
    learner_cfg = cfg.learner
    if learner_cfg.checkpoint_dir is None:
        folder = Path(cfg.run.out_dir) / "checkpoints"
        learner_cfg = learner_cfg.replace(checkpoint_dir=str(folder.absolute()))
    check_policy_spec(cfg.serve.model)  # an unset model is named before the mesh's devices
    mesh = make_mesh(learner_cfg.mesh)
    with use_mesh(mesh, logical_axis_rules(learner_cfg.zero3)) if sharded else nullcontext():
        model, tokenizer = load_policy(cfg.serve.model, seed=cfg.run.seed)
    return model, tokenizer, Learner(model, learner_cfg, mesh)


def follow_leader(cfg: TrainConfig) -> int:
    """Processes > 0 of a multi-process learner: hold shards, make process 0's learner calls."""
    _, _, learner = load_learner(cfg, sharded=True)  # followers serve nothing
    print(f"process {jax.process_index()}: following process 0", flush=True)
    steps = follow(learner)
    print(f"process {jax.process_index()}: done at learner step {steps}", flush=True)
    return 0


def resume(run: Run) -> None:
    """Continue after the last checkpoint: learner state, loop position, and the served weights."""
    position = run.learner.restore() or {}
    run.position.update(position)
    run.position["attempt"] = int(run.position.get("attempt", 0)) + 1
    run.minutes_before = float(run.position.get("minutes", 0.0))
    swap_weights(run)
    run.log.console.print(
        f"resumed from checkpoint at step {run.position['step']} (policy version {run.learner.step})"
    )


def teardown(run: Run) -> None:
    run.stack.stop_runs()
    if run.viewer is not None:
        run.viewer.stop()
    run.stack.stop()
    run.learner.close()  # waits for an async checkpoint to be committed
    run.log.close()


# ---- one step ------------------------------------------------------------------------------------


def play(run: Run, tasks: list[Task], prefix: str, runs_per_task: int) -> RoundResult:
    """One round: runs_per_task runs of each task through the capture, scored and in the store."""
    r = run.cfg.rollout
    specs = plan_round(
        tasks,
        prefix=f"{prefix}-{run.nonce}",
        runs_per_task=runs_per_task,
        base_url=run.stack.capture.base_url,
        timeout_s=r.timeout_s,
        attempt=int(run.position["attempt"]),
        reward=run.stack.capture.reward_credential,
    )
    # Graders run tests in sandboxes: several at once; the other evaluators are instant.
    workers = r.coding.grade_workers if isinstance(run.stack.evaluate, CodingEvaluator) else 1
    return run_round(
        specs, run.stack.launcher, run.stack.store, run.stack.evaluate, r.posted_reward, workers
    )


def collect(run: Run, step: int) -> RoundResult:
    """The step's rollouts: tasks_per_step tasks × group_size runs."""
    r = run.cfg.rollout
    tasks = sample_tasks(run.train_tasks, r.tasks_per_step, run.cfg.run.seed, step)
    return play(run, tasks, f"s{step}", r.group_size)


def step_traces(run: Run, rollouts: RoundResult) -> tuple[StepTraces, dict[str, float]]:
    """The round's runs and calls; runs whose calls lag more than max_staleness are dropped."""
    traces = read_traces(run.stack.store, rollouts.group_ids)
    records, calls = traces.rollouts, traces.calls
    # Policy versions a call lags behind the learner (the sidecar records who served each call).
    lags = {
        rid: [run.learner.step - c.policy_version for c in cs if c.policy_version is not None]
        for rid, cs in calls.items()
    }
    every = [lag for run_lags in lags.values() for lag in run_lags]
    stale = {rid for rid, xs in lags.items() if any(x > run.cfg.run.max_staleness for x in xs)}
    kept = [rec for rec in records if rec.rollout_id not in stale]
    stats = {
        "staleness_mean": sum(every) / len(every) if every else 0.0,
        "staleness_max": float(max(every, default=0)),
        "runs_stale": float(len(stale)),
    }
    return StepTraces(kept, {rec.rollout_id: calls[rec.rollout_id] for rec in kept}), stats


def update(run: Run, step: int, rollouts: RoundResult) -> dict[str, Any]:
    """Traces → packed micro-batches → one optimizer step; returns the step's metrics."""
    traces, staleness = step_traces(run, rollouts)
    batch = build_step(step, traces, run.cfg.data, decode=run.tokenizer.decode)
    s = batch.stats
    t0 = time.monotonic()
    learner_metrics = run.learner.train_step(batch.micro_batches) if batch.micro_batches else {}
    t_update = time.monotonic() - t0
    calls = max(1, s.merge.calls)
    return {
        "step": step + 1,
        "reward": rollouts.reward_mean(),
        "pass_rate": rollouts.pass_rate,
        "runs": len(rollouts.results),
        "runs_failed": rollouts.failed,
        "runs_timed_out": rollouts.timed_out,
        "runs_trained": s.runs_trained,
        "runs_over_budget": s.over_budget_runs,  # dropped whole, past data.step_token_budget
        "excluded": s.excluded,
        "calls_per_run": rollouts.calls / max(1, len(rollouts.results)),
        "seqs_per_run": s.merge.sequences / max(1, s.runs_trained),
        "merge_break_rate": s.merge.breaks / calls,
        "break_causes": s.break_causes,
        "packing_efficiency": s.efficiency,
        "micro_batches": s.micro_batches,
        "trained_tokens": s.real_tokens,
        "compiles": run.learner.compile_count + run.stack.serving.compile_count,
        "tokens_per_s": s.real_tokens / t_update if learner_metrics else 0.0,
        "t_rollout": rollouts.duration_s,
        "t_update": t_update,
        **staleness,
        **coding_metrics(rollouts),
        **{f"learner_{k}": v for k, v in learner_metrics.items()},
    }


def swap_weights(run: Run) -> float:
    """New weights into the servers while the sidecars hold new calls; returns seconds taken."""
    t0 = time.monotonic()
    version = run.learner.step
    with run.stack.capture.hold(version):
        run.stack.serving.push(run.learner, version)
    return time.monotonic() - t0


# The best held-out eval so far, in the resume position: its loop step, reward, and the policy
# version (learner step) it scored, whose checkpoint is kept (KEEP_KEY) and exported to hf-best/.
NO_BEST: dict[str, Any] = {"best_step": None, "best_eval_reward": None, KEEP_KEY: None}


def evaluate(run: Run, step: int) -> dict[str, Any]:
    """Held-out reward: every eval task, eval_runs_per_task runs, failed runs counted as 0,
    sampled with the sidecars' eval overrides (greedy by default). Returns eval_reward,
    eval_reward_best and best_step (`step` itself when this eval is a new best)."""
    run.log.phase(f"eval at step {step}")
    with run.stack.capture.evaluating():
        result = play(run, run.eval_tasks, f"e{step}", run.cfg.rollout.eval_runs_per_task)
    reward = result.reward_mean(failed_as=0.0)
    run.last_eval_s = result.duration_s
    best = run.position.get("best_eval_reward")
    if best is None or reward > best:  # ties keep the earlier step
        run.position.update(best_step=step, best_eval_reward=reward)
        run.position[KEEP_KEY] = run.learner.step
    scores = {
        "eval_reward": reward,
        "eval_reward_best": run.position["best_eval_reward"],
        "best_step": run.position["best_step"],
    }
    run.log.log(
        {
            "step": step,
            **scores,
            "eval_pass_rate": result.pass_rate,
            "eval_runs_failed": result.failed,
            "t_eval": result.duration_s,
            **coding_metrics(result, prefix="eval_"),
        },
        kind="eval",
    )
    return scores


def keep_best(run: Run, step: int) -> None:
    """After a new best eval at `step`: its checkpoint (kept beside the latest) and hf-best/."""
    checkpoint(run, step, force=True)
    if run.cfg.run.export_hf:
        run.learner.export_hf(run.out / "hf-best", run.tokenizer)


def checkpoint(run: Run, step: int, force: bool = False) -> None:
    run.position["step"] = step
    run.position["minutes"] = minutes(run)
    ckpt = run.learner.checkpointer
    due = force or step % run.cfg.learner.checkpoint_every == 0
    if ckpt is not None and due and ckpt.latest_step() != run.learner.step:
        run.learner.save(dict(run.position))


def minutes(run: Run) -> float:
    """Wall minutes of this run, interrupted attempts included."""
    return run.minutes_before + (time.monotonic() - run.started) / 60


# ---- the loop ------------------------------------------------------------------------------------


def train(run: Run) -> None:
    """Steps from the resume point to run.steps; async overlaps the next rollouts with the update."""
    cfg = run.cfg.run
    if run.position["eval_start"] is None:
        run.position["eval_start"] = evaluate(run, 0)["eval_reward"]
        keep_best(run, 0)  # the first eval is the best so far
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
    pending: Future[RoundResult] | None = None
    first, loop_start = int(run.position["step"]), time.monotonic()
    try:
        for step in range(first, cfg.steps):
            done = step - first
            last = step + 1 == cfg.steps or (done > 0 and not time_for_two(run, done, loop_start))
            eval_due = (step + 1) % cfg.eval_every == 0 or last
            run.log.phase(f"step {step + 1}: rollouts", completed=step)
            rollouts = (pending or pool.submit(collect, run, step)).result()
            pending = None
            if cfg.loop == "async" and not eval_due:
                # Runs while this step updates; with max_staleness=0, only its runs whose every
                # call came after the swap are trained, the others are dropped as stale. Not
                # beside an eval: the sidecar samples all its calls in eval mode meanwhile.
                pending = pool.submit(collect, run, step + 1)
            run.log.phase(f"step {step + 1}: update")
            metrics = update(run, step, rollouts)
            run.log.phase(f"step {step + 1}: weight swap")
            metrics["t_swap"] = swap_weights(run) if "learner_step" in metrics else 0.0
            if eval_due:
                metrics.update(evaluate(run, step + 1))
            run.log.log(metrics)
            if eval_due and metrics["best_step"] == step + 1:
                keep_best(run, step + 1)
            checkpoint(run, step + 1, force=last)
            if last:
                break
    except BaseException:
        run.stack.stop_runs()  # interrupted: the step's runs are abandoned, not waited for
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def time_for_two(run: Run, done: int, loop_start: float) -> bool:
    """Whether this step, one more, and the final eval fit in run.max_minutes (0: no limit).

    When they do not, this step is the last: it ends with the final eval and a checkpoint.
    """
    budget = run.cfg.run.max_minutes
    if not budget:
        return True
    step_s = (time.monotonic() - loop_start) / max(1, done)
    needed = minutes(run) + (2 * step_s + run.last_eval_s) / 60
    if needed <= budget:
        return True
    run.log.console.print(
        f"step {int(run.position['step']) + 1} is the last: one more step and the final eval "
        f"would end at {needed:.1f} min, past run.max_minutes={budget:g}"
    )
    return False


def finish(run: Run) -> str:
    """Export, plot, and the one-line summary (the best eval's weights are in hf-best/)."""
    run.log.phase("export and plot", completed=run.cfg.run.steps)
    if run.cfg.run.export_hf:
        run.learner.export_hf(run.out / "hf", run.tokenizer)
    records = read_metrics(run.out / "metrics.jsonl")
    best_step, best = run.position["best_step"], run.position["best_eval_reward"]
    plot_rewards(records, run.out / "reward.png", best=(best_step, best))
    evals = [r["eval_reward"] for r in records if r.get("kind") == "eval"]
    start = run.position["eval_start"] if run.position["eval_start"] is not None else evals[0]
    return (
        f"train: eval_reward_start={start:.3f} eval_reward_end={evals[-1]:.3f} "
        f"eval_reward_best={best:.3f} best_step={best_step} "
        f"steps={run.position['step']} minutes={minutes(run):.1f}"
    )


def clear_outputs(out: Path) -> None:
    """A fresh start: remove a previous run's outputs in out_dir (never anything else)."""
    for name in ("metrics.jsonl", "reward.png", "traces.db", "traces.db-wal", "traces.db-shm"):
        (out / name).unlink(missing_ok=True)
    for name in ("tb", "checkpoints", "hf", "hf-best"):
        shutil.rmtree(out / name, ignore_errors=True)


def has_checkpoint(cfg: TrainConfig) -> bool:
    folder = Path(cfg.learner.checkpoint_dir or Path(cfg.run.out_dir) / "checkpoints")
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def parse_args(argv: list[str]) -> TrainConfig:
    prog = "python -m harnessrl.train"
    cfg = parse_config(argv, prog, __doc__ or "")
    try:
        if cfg.rollout.evaluator != "coding":  # built from the coding tasks, at setup
            get_evaluator(cfg.rollout.evaluator)  # a user's module:function must import, now
        # A run whose state and activations cannot fit its recipe's chips stops before any load.
        check_fits(cfg.serve.model, cfg.learner, cfg.data.buckets)
    except ValueError as err:
        fail(prog, err)
    return cfg


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    _set_device_flags(argv)
    keep_freed_memory()  # before XLA starts its threads (harnessrl/host_memory.py)
    cfg = parse_args(argv)
    init_distributed()  # multi-process learners: before anything touches a device
    if jax.process_index() > 0:
        return follow_leader(cfg)
    fresh = not (cfg.run.resume and has_checkpoint(cfg))
    if fresh:
        clear_outputs(Path(cfg.run.out_dir))
    signal.signal(signal.SIGTERM, _interrupt)  # a killed job shuts down like Ctrl-C
    run = setup(cfg, started)
    try:
        if not fresh:
            resume(run)
        train(run)
        line = finish(run)
    except KeyboardInterrupt:
        run.log.console.print(
            "interrupted: run the same command again to resume from the last checkpoint"
        )
        return 130
    finally:
        teardown(run)
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
