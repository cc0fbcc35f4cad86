"""The one config loader: YAML file + `key=value` overrides → frozen per-stage dataclasses.

In: `python -m harnessrl.train` arguments. Out: a `TrainConfig` holding one frozen config per
stage (run, rollout, sidecar, serve, data, learner); unknown keys and wrong types are ValueErrors.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from harnessrl.data.pipeline import DataConfig
from harnessrl.learner.config import LearnerConfig
from harnessrl.rollout.round import POSTED_REWARD
from harnessrl.serve.config import ServeConfig

LOOP_MODES = ("sync", "async")
LAUNCHERS = ("local", "kubernetes")
WEIGHT_SYNCS = ("vllm", "embedded")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The loop itself: how long, where outputs go, how it is shown."""

    out_dir: str = "runs/default"  # metrics, checkpoints, traces, plot and HF export go here
    steps: int = 15  # optimizer steps
    seed: int = 0  # task sampling; a bare `seed=N` sets run, serve and learner seeds together
    loop: str = "sync"  # sync: rollouts → update → swap; async: next rollouts overlap the update
    max_staleness: int = 1  # async: most policy versions a trained sample may lag behind
    eval_every: int = 5  # held-out eval every N steps (and always before step 1 and at the end)
    max_minutes: float = 13.0  # time budget: stop before a step that would overrun it; 0 = none
    resume: bool = True  # continue from the last checkpoint in out_dir when there is one
    export_hf: bool = True  # write an HF safetensors folder of the final weights
    display: bool = True  # live rich progress table (plain log lines when off or not a TTY)
    tensorboard: bool = True  # TensorBoard event files under out_dir/tb

    def __post_init__(self) -> None:
        _check_choice("run.loop", self.loop, LOOP_MODES)
        for name in ("steps", "eval_every"):
            _check_min(f"run.{name}", getattr(self, name), 1)
        _check_min("run.max_staleness", self.max_staleness, 0)
        if not self.max_minutes >= 0:
            raise ValueError(f"run.max_minutes must be >= 0, got {self.max_minutes!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Which tasks, which harness, how many runs, and how they are scored."""

    # The command line per run; {python} = this interpreter, {examples} = the examples folder.
    harness: str = (
        "{python} {examples}/answer_agent.py --temperature 0.7 --max-tokens 20 --max-attempts 2"
    )
    launcher: str = "local"  # local | kubernetes
    image: str = ""  # kubernetes: the harness container image
    namespace: str = "harnessrl"  # kubernetes: namespace of the harness Jobs
    # Where traces go: "" = SQLite in out_dir. Kubernetes: a postgresql:// URL, the same one the
    # harness pods' sidecars write to (Secret harnessrl-store).
    store: str = ""
    # Inference servers, comma-separated: "" = the embedded server in this process. Otherwise
    # each push exports the weights to out_dir/weights (shared storage) and the servers load them.
    servers: str = ""
    weight_sync: str = "vllm"  # with servers: vllm (VLLM_SERVER_DEV_MODE=1) | embedded
    sidecar_image: str = ""  # kubernetes: the capture sidecar image ("" = the release image)
    sidecar_port: int = 8080  # kubernetes: the sidecar's port inside each harness pod
    tasks: str = "builtin:addition"  # builtin:addition or a JSONL task file
    eval_tasks: str = ""  # JSONL of held-out tasks (builtin:addition makes its own split)
    num_train_tasks: int = 300  # builtin:addition sizes
    num_eval_tasks: int = 64
    tasks_per_step: int = 6  # tasks sampled per step; each is run group_size times (one group)
    group_size: int = 8
    eval_runs_per_task: int = 1
    # exact_number | exact_match | contains | exit_code, or your own module:function
    evaluator: str = "exact_number"
    # keep: a reward the harness posted itself stands (the evaluator scores the others) |
    # ignore: the evaluator scores every run | require: a run that posted none is marked failed
    posted_reward: str = "keep"
    concurrency: int = 16  # harness processes at once
    timeout_s: float = 300.0  # per run; the process group is killed after it
    kill_grace_s: float = 2.0  # between TERM and KILL

    def __post_init__(self) -> None:
        _check_choice("rollout.launcher", self.launcher, LAUNCHERS)
        _check_choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        _check_choice("rollout.posted_reward", self.posted_reward, tuple(POSTED_REWARD))
        _check_min("rollout.sidecar_port", self.sidecar_port, 1)
        if self.launcher == "kubernetes":
            if not self.image:
                raise ValueError(
                    "rollout.launcher=kubernetes needs rollout.image (the harness image)"
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
        for name in ("eval_runs_per_task", "concurrency"):
            _check_min(f"rollout.{name}", getattr(self, name), 1)
        if not self.timeout_s > 0:
            raise ValueError(f"rollout.timeout_s must be > 0, got {self.timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    """How the train loop starts the capture sidecar (`python -m proxy_sidecar`)."""

    port: int = 0  # 0: a free port
    pause_timeout_s: float = 600.0  # how long harness calls wait during a weight swap
    startup_timeout_s: float = 60.0
    extra_args: str = ""  # more `python -m proxy_sidecar` flags, shell-quoted

    def __post_init__(self) -> None:
        _check_min("sidecar.port", self.port, 0)
        if not self.pause_timeout_s > 0:
            raise ValueError(f"sidecar.pause_timeout_s must be > 0, got {self.pause_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    sidecar: SidecarConfig = dataclasses.field(default_factory=SidecarConfig)
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


SECTIONS: dict[str, type] = dict(typing.get_type_hints(TrainConfig))

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
    "rollout.concurrency": 4,
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


# Bare keys that set several fields at once.
ALIASES: dict[str, tuple[str, ...]] = {"seed": ("run.seed", "serve.seed", "learner.seed")}

# Meanings of fields whose source carries no comment (shown by --help and in the docs).
HELP: dict[str, str] = {
    "rollout.num_eval_tasks": "builtin:addition held-out tasks",
    "rollout.group_size": "runs per task per step; advantages compare the runs of a group",
    "rollout.eval_runs_per_task": "runs per held-out task at each eval",
    "sidecar.startup_timeout_s": "how long to wait for the sidecar to answer /health",
    "serve.model": "smollm2 | HF folder | .gguf path | tiny (random weights, smoke runs)",
    "serve.host": "interface the embedded server binds",
    "serve.port": "embedded server port; 0 picks a free one",
    "serve.num_slots": "KV-cache rows: requests decoded together",
    "serve.max_model_len": "longest prompt + completion in tokens",
    "serve.prefill_buckets": "prompt chunk sizes compiled for prefill",
    "serve.policy_version": "version reported before the first swap",
    "serve.warmup": "compile every serving program before accepting requests",
    "serve.log_level": "uvicorn log level of the embedded server",
    "data.max_segments_per_row": "static cap on packed sequences per row",
    "data.estimator": "grpo | rloo | dr_grpo advantage estimator",
    "data.std_normalize": "divide GRPO advantages by the group's reward std",
    "data.adv_eps": "added to the std before dividing",
    "data.drop_zero_variance": "skip groups whose runs all got the same reward",
    "data.loss_mode": "token_mean | sequence_mean | run_mean | constant normalization",
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
    "learner.seed": "learner RNG seed",
    "learner.eps_low": "PPO clip: lower epsilon of the importance ratio",
}


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")


def _check_min(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")


def _fields(section: str) -> dict[str, Any]:
    cls = SECTIONS[section]
    return typing.get_type_hints(cls)


def resolve_key(key: str) -> tuple[str, str]:
    """`section.field`, or a bare `field` that exactly one section has → (section, field)."""
    name = key.lstrip("-").replace("-", "_")
    if "." in name:
        section, _, field = name.partition(".")
        if section not in SECTIONS:
            raise ValueError(
                f"unknown config section {section!r} in {key!r}; sections: {list(SECTIONS)}"
            )
        if field not in _fields(section):
            raise ValueError(
                f"unknown config key {key!r}: section {section!r} has {sorted(_fields(section))}"
            )
        return section, field
    owners = [s for s in SECTIONS if name in _fields(s)]
    if not owners:
        raise ValueError(f"unknown config key {key!r}; see --help for every option")
    if len(owners) > 1:
        raise ValueError(
            f"config key {key!r} is ambiguous; write one of {[f'{s}.{name}' for s in owners]}"
        )
    return owners[0], name


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` (from YAML, or a command-line string) as type `hint`, or a ValueError naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(key, value, arg)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {args}")
    if hint is Any:
        return value
    if origin is tuple or origin is dict or hint in (tuple, dict):
        return _coerce_container(key, value, hint, origin or hint, args)
    if isinstance(value, str) and hint is not str:
        value = _parse_scalar(key, value, hint)
    return _check_scalar(key, value, hint)


def _parse_scalar(key: str, text: str, hint: Any) -> Any:
    t = text.strip()
    try:
        if hint is bool:
            low = t.lower()
            if low in ("true", "yes", "on", "1"):
                return True
            if low in ("false", "no", "off", "0"):
                return False
            raise ValueError
        if hint is int:
            return int(t)
        if hint is float:
            return float(t)
    except ValueError:
        raise ValueError(f"{key} must be {hint.__name__}, got {text!r}") from None
    return text


def _check_scalar(key: str, value: Any, hint: Any) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{key} must be a number, got NaN")
    if isinstance(hint, type) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        name = getattr(hint, "__name__", str(hint))
        raise ValueError(f"{key} must be {name}, got {type(value).__name__} {value!r}")
    return value


def _coerce_container(key: str, value: Any, hint: Any, origin: Any, args: tuple) -> Any:
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ValueError(f"{key}: cannot parse {value!r} ({err})") from err
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list, e.g. [1, 2], got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if args and len(args) != len(value):
        raise ValueError(f"{key} must have {len(args)} items, got {value!r}")
    return tuple(
        coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
    )


def _flatten_yaml(doc: Any, path: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"config file {path}: expected a mapping of sections, got {doc!r}")
    flat: dict[str, Any] = {}
    for section, body in doc.items():
        if section in SECTIONS and isinstance(body, dict):
            flat.update({f"{section}.{k}": v for k, v in body.items()})
        else:
            flat[str(section)] = body  # a bare key; resolved (or rejected) like a flag
    return flat


def load_config(
    file: str | Path | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    smoke: bool = False,
) -> TrainConfig:
    """Defaults ← smoke preset ← YAML file ← overrides (`key=value` strings or a dict)."""
    merged: dict[tuple[str, str], Any] = {}
    layers: list[dict[str, Any]] = [SMOKE if smoke else {}]
    if file is not None:
        p = Path(file)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        layers.append(_flatten_yaml(yaml.safe_load(p.read_text()), str(p)))
    if isinstance(overrides, list):
        layers.append(parse_overrides(overrides))
    elif overrides:
        layers.append(dict(overrides))
    for layer in layers:
        for key, value in layer.items():
            name = key.lstrip("-")
            for full in ALIASES.get(name, (name,)):
                section, field = resolve_key(full)
                hint = _fields(section)[field]
                merged[(section, field)] = coerce(f"{section}.{field}", value, hint)
    built = {}
    defaults = TrainConfig()
    for section in SECTIONS:
        kwargs = {f: v for (s, f), v in merged.items() if s == section}
        try:
            built[section] = dataclasses.replace(getattr(defaults, section), **kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"config section {section!r}: {err}") from err
    return TrainConfig(**built)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["steps=3", "--learner.learning_rate=1e-5"]` → {key: raw string}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip("-"):
            raise ValueError(f"override {item!r} must look like key=value (or --key=value)")
        out[key.strip()] = value
    return out


def as_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dict (YAML/JSON-friendly) of every setting."""
    return {s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's trailing `# comment` (or the comment lines right above it) in the source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []
    names = {f.name for f in dataclasses.fields(cls)}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = re.match(r"\s*(\w+)\s*:", line)
        if m and m.group(1) in names and m.group(1) not in docs:
            trailing = _trailing_comment(lines, i)
            docs[m.group(1)] = trailing or " ".join(above)
        above = []
    return docs


def _trailing_comment(lines: list[str], i: int) -> str:
    # A default may span lines (an open parenthesis); its comment is then on the closing line.
    j = i
    if lines[i].rstrip().endswith("("):
        while j + 1 < len(lines) and not lines[j].lstrip().startswith(")"):
            j += 1
    _code, sep, comment = lines[j].partition("#")
    return comment.strip() if sep else ""


def describe(markdown: bool = False) -> str:
    """Every option with its type, default and meaning (for --help and docs/configuration.md)."""
    out: list[str] = []
    defaults = TrainConfig()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        doc = (inspect.getdoc(cls) or "").splitlines()[0]
        out.append(f"\n### `{section}` — {doc}\n" if markdown else f"\n[{section}] {doc}")
        if markdown:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            default = getattr(default, "value", default)  # enums show as their value
            meaning = HELP.get(f"{section}.{f.name}") or docs.get(f.name, "")
            kind = _type_name(hints[f.name])
            if markdown:
                out.append(f"| `{section}.{f.name}` | {kind} | `{default!r}` | {meaning} |")
            else:
                out.append(f"  {section}.{f.name}={default!r}  ({kind})  {meaning}")
    return "\n".join(out).lstrip("\n") + "\n"


def _type_name(hint: Any) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


if __name__ == "__main__":
    import sys

    # `python -m harnessrl.config --markdown` regenerates the tables of docs/configuration.md.
    sys.stdout.write(describe(markdown="--markdown" in sys.argv))
