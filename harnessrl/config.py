"""The train config: each stage's own config as one section, loaded from YAML and `key=value`.

In: `python -m harnessrl.train` arguments (or `load_config`'s file and overrides). Out: a frozen
`TrainConfig` of the stage configs (run, rollout with its launchers, sidecar, serve, data,
learner); a `tpu_configs` recipe named by `--mesh` applies as a whole, beneath the user's keys.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harnessrl.cli import (
    ConfigError,
    Pairs,
    build,
    coerce,
    describe,
    fail,
    flatten,
    get,
    is_bool,
    load_yaml,
    parse_argv,
    typed,
)
from harnessrl.coding.rollouts import CodingConfig, is_coding
from harnessrl.data.pipeline import DataConfig
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import SLICE_KEYS, load_slice_config, recipe_path, split_error
from harnessrl.pods.k8s import KubernetesLauncherConfig
from harnessrl.rollout.local import LocalLauncherConfig
from harnessrl.rollout.round import POSTED_REWARD
from harnessrl.serve.config import ServeConfig
from proxy_sidecar.config import SidecarConfig

LOOP_MODES = ("sync", "async")
LAUNCHERS = ("local", "kubernetes")
WEIGHT_SYNCS = ("vllm", "embedded")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The loop itself: how long, where outputs go, how it is shown."""

    out_dir: str = "runs/default"  # metrics, checkpoints, traces, plot and HF export go here
    steps: int = 15  # optimizer steps
    seed: int = 0  # task sampling; a bare `seed=N` sets run and serve seeds together
    loop: str = "sync"  # sync: rollouts → update → swap; async: next rollouts overlap the update
    # async: most policy versions a trained sample may lag behind (0: only runs whose every call
    # came after the swap are trained)
    max_staleness: int = 1
    eval_every: int = 5  # held-out eval every N steps (and always before step 1 and at the end)
    max_minutes: float = 13.0  # time budget: stop before a step that would overrun it; 0 = none
    resume: bool = True  # continue from the last checkpoint in out_dir when there is one
    export_hf: bool = True  # write an HF safetensors folder of the final weights
    display: bool = True  # live rich progress table (plain log lines when off or not a TTY)
    tensorboard: bool = True  # TensorBoard event files under out_dir/tb
    sidecar_startup_s: float = 60.0  # how long to wait for this process's sidecar to be healthy
    view: bool = False  # serve the trace viewer (127.0.0.1) during the run; prints its address
    view_port: int = 0  # the viewer's port with run.view; 0 picks a free one

    def __post_init__(self) -> None:
        _check_choice("run.loop", self.loop, LOOP_MODES)
        for name in ("steps", "eval_every"):
            _check_min(f"run.{name}", getattr(self, name), 1)
        _check_min("run.max_staleness", self.max_staleness, 0)
        if isinstance(self.view_port, bool) or not 0 <= self.view_port <= 65535:
            raise ValueError(f"run.view_port must be in [0, 65535], got {self.view_port!r}")
        if not self.max_minutes >= 0:
            raise ValueError(f"run.max_minutes must be >= 0, got {self.max_minutes!r}")
        if not self.sidecar_startup_s > 0:
            raise ValueError(f"run.sidecar_startup_s must be > 0, got {self.sidecar_startup_s!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Which tasks, which harness, how many runs, how they are launched and scored."""

    # The harness command line of every run, for either launcher (unless the launcher sets its
    # own command); {python} = this interpreter, {examples} = the examples folder.
    harness: str = (
        "{python} {examples}/answer_agent.py --temperature 0.7 --max-tokens 20 --max-attempts 2"
    )
    launcher: str = "local"  # local | kubernetes (see rollout.local.* and rollout.kubernetes.*)
    # Trace store URL; "" = SQLite in out_dir. Kubernetes: the postgresql:// URL the harness
    # pods' sidecars also write to (Secret harnessrl-store).
    store: str = ""
    # Inference servers, comma-separated, or k8s://NAMESPACE/SERVICE:PORT (every ready replica of
    # that Service, looked up at each push); "" = the embedded server in this process. Otherwise
    # each push exports the weights to out_dir/weights and every server loads them.
    servers: str = ""
    weight_sync: str = "vllm"  # with servers: vllm (started with VLLM_SERVER_DEV_MODE=1) | embedded
    # with servers: shared (each server reads out_dir/weights from shared storage) | http (every
    # server fetches the export from this process at once, docs/howto-vllm.md)
    weight_push: str = "shared"
    # weight_push=http: HOST:PORT the servers reach this process at (e.g. its pod IP and a free
    # port); "" = 127.0.0.1 on a free port
    weight_push_address: str = ""
    # builtin:addition, a JSONL task file, or coding tasks: coding:shipped (the HumanEval bug
    # set) or coding:PATH (SWE-bench/SWE-smith JSONL, a task folder or a folder of them)
    tasks: str = "builtin:addition"
    # held-out tasks (JSONL, or coding:...); builtin:addition and coding tasks without one hold
    # out num_eval_tasks of their own
    eval_tasks: str = ""
    num_train_tasks: int = 300  # builtin:addition sizes
    num_eval_tasks: int = 64  # held-out tasks of builtin:addition, or of coding tasks
    tasks_per_step: int = 6  # tasks sampled per step; each is run group_size times (one group)
    group_size: int = 8  # runs per task per step; advantages compare the runs of a group
    eval_runs_per_task: int = 1  # runs per held-out task at each eval
    # exact_number | exact_match | contains | exit_code | coding (grades a coding run's diff;
    # the default for coding tasks), or your own module:function
    evaluator: str = "exact_number"
    # keep: a reward the harness posted itself stands (the evaluator scores the others) |
    # ignore: the evaluator scores every run | require: a run that posted none is marked failed
    posted_reward: str = "keep"
    timeout_s: float = 300.0  # per run; then the process group is killed / the Job's deadline
    local: LocalLauncherConfig = dataclasses.field(
        default_factory=lambda: LocalLauncherConfig(concurrency=16)
    )
    kubernetes: KubernetesLauncherConfig = dataclasses.field(
        default_factory=KubernetesLauncherConfig
    )
    # coding tasks: the harness (mini-swe-agent) run in a sandbox per run, and the grader
    coding: CodingConfig = dataclasses.field(default_factory=CodingConfig)

    def __post_init__(self) -> None:
        _check_choice("rollout.launcher", self.launcher, LAUNCHERS)
        if self.evaluator == "coding" and not is_coding(self.tasks):
            raise ValueError(
                "rollout.evaluator=coding grades coding tasks only; set rollout.tasks=coding:... "
                f"or pick another evaluator (rollout.tasks is {self.tasks!r})"
            )
        _check_choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        _check_choice("rollout.weight_push", self.weight_push, ("shared", "http"))
        _check_choice("rollout.posted_reward", self.posted_reward, tuple(POSTED_REWARD))
        if self.launcher == "kubernetes":
            if not self.kubernetes.image:
                raise ValueError(
                    "rollout.launcher=kubernetes needs rollout.kubernetes.image (the harness image)"
                )
            if not self.store.startswith(("postgresql://", "postgres://")):
                raise ValueError(
                    "rollout.launcher=kubernetes needs rollout.store=postgresql://... (the trace "
                    f"store the harness pods' sidecars write to), got {self.store!r}"
                )
            if not self.servers:
                raise ValueError(
                    "rollout.launcher=kubernetes needs rollout.servers (the inference servers the "
                    "pods' sidecars forward to, e.g. http://vllm.harnessrl.svc.cluster.local:8000)"
                )
        for name in ("num_train_tasks", "num_eval_tasks", "tasks_per_step", "group_size"):
            _check_min(f"rollout.{name}", getattr(self, name), 1)
        _check_min("rollout.eval_runs_per_task", self.eval_runs_per_task, 1)
        if not self.timeout_s > 0:
            raise ValueError(f"rollout.timeout_s must be > 0, got {self.timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of `python -m harnessrl.train`, one section per stage."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    # The loop's own sidecar: a free port, and no log line per call (sidecar.log stays small).
    sidecar: SidecarConfig = dataclasses.field(
        default_factory=lambda: SidecarConfig(port=0, log_calls=False)
    )
    # The embedded run: a free port, a slot per concurrent harness, short contexts (the task's
    # chats are < 200 tokens), so each decode step and the KV cache stay small on a CPU.
    serve: ServeConfig = dataclasses.field(
        default_factory=lambda: ServeConfig(
            port=0, num_slots=16, max_model_len=512, prefill_buckets=(64, 256)
        )
    )
    # The task's chats are far below 256 tokens: one shape (one learner compile), and rows of
    # 4 leave at most 3 padding rows per step (a typical step packs into 8-12 rows).
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(buckets=((4, 256),)))
    # ~15 steps fit the 20-minute CPU budget, so the step size sits at the top of the usual
    # 1e-6..1e-5 range for a 135M model; checkpoints (1.6 GB with AdamW state) every 5 steps.
    learner: LearnerConfig = dataclasses.field(
        default_factory=lambda: LearnerConfig(
            learning_rate=2e-5, checkpoint_every=5, keep_checkpoints=2
        )
    )


# `--smoke`: the same loop end to end, small enough for CI (tiny random model, two steps,
# two simulated devices for the sharded update).
SMOKE: dict[str, Any] = {
    "serve.model": "tiny",
    "run.steps": 2,
    "run.eval_every": 1,
    "run.out_dir": "runs/smoke",
    "run.resume": False,
    "run.max_minutes": 0.0,
    "rollout.num_train_tasks": 16,
    "rollout.num_eval_tasks": 4,
    "rollout.tasks_per_step": 2,
    "rollout.group_size": 2,
    "rollout.local.concurrency": 4,
    "rollout.kubernetes.concurrency": 4,
    "rollout.timeout_s": 120.0,
    "rollout.harness": "{python} {examples}/answer_agent.py --max-tokens 8 --max-attempts 2 --feedback",
    "serve.num_slots": 4,
    "serve.max_model_len": 256,
    "serve.prefill_buckets": (64, 128),
    "data.buckets": ((2, 128),),
    "data.drop_zero_variance": False,  # a random model earns no reward; still run the update
    "learner.mesh": "data=2",
    "learner.checkpoint_every": 1,
}

# Coding tasks (`rollout.tasks=coding:...`), beneath your own settings and above `--smoke`:
# graded by the coding evaluator; mini-swe-agent's chats run to a few thousand tokens, so the
# context, prefill chunks and packed rows grow, and a step holds fewer, longer runs.
CODING: dict[str, Any] = {
    "rollout.evaluator": "coding",
    "rollout.tasks_per_step": 2,
    "rollout.group_size": 4,
    "rollout.num_eval_tasks": 8,
    "rollout.timeout_s": 900.0,
    "serve.max_model_len": 4096,
    "serve.prefill_buckets": (256, 1024),
    "data.buckets": ((1, 4096),),
}

# `--smoke` with coding tasks: a few short runs of the tiny model (garbage replies, so each run
# ends at its step limit or at mini-swe-agent's third malformed reply).
SMOKE_CODING: dict[str, Any] = {
    "rollout.num_eval_tasks": 2,
    "rollout.group_size": 2,
    "rollout.timeout_s": 300.0,
    "rollout.coding.step_limit": 3,
    "rollout.coding.max_tokens": 16,
    "serve.max_model_len": 2048,
    "data.buckets": ((2, 1024),),  # longer sequences are split
}

# `rollout.launcher=kubernetes`, beneath the rest: a cluster run trains until run.steps, not for
# the embedded CPU run's 13 minutes and 15 steps.
CLUSTER: dict[str, Any] = {
    "run.steps": 1000,
    "run.max_minutes": 0.0,
}

# Bare keys that set several fields at once.
ALIASES: dict[str, tuple[str, ...]] = {"seed": ("run.seed", "serve.seed")}

# Fields the loop sets from other settings, so that the two can never disagree.
WIRED: dict[str, str] = {
    "sidecar.upstreams": "the embedded server, or rollout.servers",
    "sidecar.store": "rollout.store",
    "rollout.kubernetes.sidecar.upstream": "rollout.servers",
}

# Meanings of fields whose source carries no comment (shown by --help and in the docs).
HELP: dict[str, str] = {
    **{key: f"set by the loop from {source}" for key, source in WIRED.items()},
    "rollout.local.command": "harness argv; empty: rollout.harness",
    "rollout.kubernetes.command": "the pods' harness argv; empty: rollout.harness",
    "sidecar.model": "model name sent upstream; none: serve.served_model_name (or serve.model)",
    "sidecar.control_token": "control API bearer token; none: a fresh one per run",
    "sidecar.tokenizer": (
        "token-in mode's tokenizer: tiny, smollm2, an HF folder or a .gguf (docs/dialects.md); "
        "none: serve.model's where it names one on this machine, else token-in mode is off"
    ),
    "data.max_segments_per_row": "static cap on packed sequences per row",
    "data.estimator": "grpo | rloo | dr_grpo advantage estimator",
    "data.std_normalize": "divide GRPO advantages by the group's reward std",
    "data.adv_eps": "added to the std before dividing",
    "data.drop_zero_variance": "skip groups whose runs all got the same reward",
    "data.loss_mode": "token_mean | sequence_mean | run_mean | constant normalization",
    "data.step_token_budget": (
        "a step's token cap (a recipe's budget): runs past it are dropped whole, not trained "
        "later; counted as runs_over_budget"
    ),
    "learner.entropy_coef": "entropy bonus weight",
    "learner.learning_rate": "peak AdamW learning rate",
    "learner.warmup_steps": "linear warmup steps",
    "learner.min_lr_ratio": "cosine floor as a fraction of the peak rate",
    "learner.b1": "AdamW beta1",
    "learner.b2": "AdamW beta2",
    "learner.weight_decay": "AdamW decoupled weight decay",
    "learner.checkpoint_dir": "orbax directory; the train loop uses out_dir/checkpoints when unset",
    "learner.keep_checkpoints": "checkpoints kept on disk",
    "learner.checkpoint_every": "save every N steps (and always at the end)",
    "learner.async_checkpoint": "write checkpoints in the background",
    "learner.eps_low": "PPO clip: lower epsilon of the importance ratio",
    "learner.mesh": "preset, data=2,fsdp=-1,tensor=1, or a tpu_configs recipe (applied whole)",
    "rollout.coding.grade.pytest_args": "more arguments for the grader's pytest command",
}


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")


def _check_min(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")


def recipe_settings(spec: str) -> Pairs:
    """The train settings a `tpu_configs` recipe carries: mesh, buckets, dtypes, remat, ZeRO-3,
    budget.

    Devices are checked later, when the learner builds the mesh on the machine that runs it.
    """
    try:
        recipe = load_slice_config(spec, check_devices=False)
    except ValueError as err:
        raise ConfigError(f"learner.mesh={spec!r}: {err}") from err
    return [
        ("learner.mesh", spec),
        ("data.buckets", recipe.buckets),
        ("data.step_token_budget", recipe.max_step_tokens),
        ("learner.compute_dtype", recipe.compute_dtype),
        ("learner.param_dtype", recipe.param_dtype),
        ("learner.remat", recipe.remat),
        ("learner.zero3", recipe.zero3),
    ]


def _read_file(path: str | Path) -> Pairs:
    """A train YAML (sections), or a recipe file, which stands for `--mesh PATH`."""
    doc = load_yaml(path)
    if isinstance(doc, dict) and doc and set(doc) <= SLICE_KEYS:
        return [("learner.mesh", str(path))]
    return flatten(TrainConfig, doc, str(path))


def _pairs(overrides: Mapping[str, Any] | Sequence[str] | None) -> Pairs:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    return parse_argv(list(overrides), lambda key: False)


def load_config(
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    smoke: bool = False,
) -> TrainConfig:
    """Defaults ← smoke ← coding presets ← mesh recipe ← YAML file ← overrides (`key=value`).

    `--config=FILE` among the overrides reads that file in its place.
    """
    return _load([*([("--config", file)] if file is not None else []), *_pairs(overrides)], smoke)


def _load(pairs: Pairs, smoke: bool) -> TrainConfig:
    user: Pairs = []
    for key, value in pairs:
        user += _read_file(value) if key.lstrip("-") == "config" else [(key, value)]
    values = typed(TrainConfig, user, ALIASES)
    defaults = TrainConfig()
    for key, source in WIRED.items():
        if key in values and values[key] != get(defaults, key):
            raise ConfigError(f"{key} is set by the train loop from {source}; set that instead")
    mesh = values.get("learner.mesh") or (SMOKE["learner.mesh"] if smoke else "")
    preset = recipe_settings(mesh) if recipe_path(mesh) else []
    coding = is_coding(str(values.get("rollout.tasks", defaults.rollout.tasks)))
    cluster = values.get("rollout.launcher", defaults.rollout.launcher) == "kubernetes"
    presets = [
        *(CLUSTER.items() if cluster else []),
        *(SMOKE.items() if smoke else []),
        *(CODING.items() if coding else []),
        *(SMOKE_CODING.items() if smoke and coding else []),
    ]
    below = typed(TrainConfig, [*presets, *preset])
    cfg: TrainConfig = build(defaults, {**below, **values})
    if preset:  # the rows of each micro-batch must split over the slice, or the first update fails
        error = split_error(cfg.data.buckets, load_slice_config(mesh, check_devices=False))
        if error:
            raise ConfigError(
                f"data.buckets={[list(b) for b in cfg.data.buckets]} does not fit "
                f"learner.mesh={mesh}: {error}; set data.buckets to such rows, or leave it unset "
                f"to take the recipe's {[list(b) for b in below['data.buckets']]}"
            )
    return cfg


def parse_args(argv: Sequence[str], prog: str, doc: str) -> TrainConfig:
    """The train command line: keys, `--smoke`, `--config FILE` and `--mesh SPEC`; exits on a bad one."""
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(
            f"usage: {prog} [-h, --help] [--smoke] [--config FILE.yaml] [--mesh SPEC] [key=value ...]\n\n"
            f"{doc}\noptions (key=value, --key=value, or in --config YAML by section):\n"
        )
        sys.stdout.write(describe(TrainConfig(), HELP))
        raise SystemExit(0)
    try:
        smoke = lambda key: key.lstrip("-") == "smoke"  # noqa: E731
        pairs = parse_argv(argv, lambda key: smoke(key) or is_bool(TrainConfig, key, ALIASES))
        on = [coerce("--smoke", value, bool) for key, value in pairs if smoke(key)]
        return _load([p for p in pairs if not smoke(p[0])], smoke=any(on))
    except ValueError as err:
        fail(prog, err)


def reference() -> str:
    """The generated part of docs/configuration.md."""
    return describe(TrainConfig(), HELP, markdown=True)


if __name__ == "__main__":
    # `python -m harnessrl.config` prints the tables of docs/configuration.md.
    sys.stdout.write(reference())
