"""What the user sees: per-step metrics as a live rich display, JSONL, TensorBoard and a PNG plot.

In: one flat dict of numbers per step (and per eval) from the train loop. Out: `metrics.jsonl`,
TensorBoard event files, console lines (an eval's with the best held-out reward so far and its
step), and at the end `reward.png` of train and eval reward with the best eval marked.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# (key, column title, format) of the per-step line, in display order.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward", "{:.3f}"),
    ("pass_rate", "pass", "{:.0%}"),
    ("resolved_rate", "resolved", "{:.0%}"),  # coding runs: share of all runs the grader resolved
    ("eval_reward", "eval", "{:.3f}"),
    ("eval_reward_best", "best", "{:.3f}"),  # the best held-out eval so far...
    ("best_step", "at step", "{:.0f}"),  # ...and the step it came at
    ("eval_resolved_rate", "eval resolved", "{:.0%}"),
    ("runs_failed", "failed", "{:.0f}"),
    ("calls_per_run", "turns", "{:.1f}"),  # model calls per run
    ("guard_trips", "guards", "{:.0f}"),  # coding runs whose diff tripped a grading guard
    ("seqs_per_run", "seq/run", "{:.2f}"),
    ("merge_break_rate", "breaks", "{:.2f}"),
    ("packing_efficiency", "pack", "{:.0%}"),
    ("compiles", "compiles", "{:.0f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("t_rollout", "roll s", "{:.1f}"),
    ("t_update", "upd s", "{:.1f}"),
    ("t_swap", "swap s", "{:.1f}"),
)


class MetricsLog:
    """Appends one JSON line per record; mirrors numbers to TensorBoard; shows a live display."""

    def __init__(
        self,
        out_dir: str | Path,
        total_steps: int,
        *,
        display: bool = True,
        tensorboard: bool = True,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))
        self.console = Console(file=sys.stdout, highlight=False)
        self._live = display and self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[phase]}"),
            console=self.console,
            transient=True,
            disable=not self._live,
        )
        self._task = self._progress.add_task("train", total=total_steps, phase="starting")
        self._progress.start()

    def phase(self, text: str, completed: int | None = None) -> None:
        """What the loop is doing now (shown next to the progress bar)."""
        kwargs: dict[str, Any] = {"phase": text}
        if completed is not None:
            kwargs["completed"] = completed
        self._progress.update(self._task, **kwargs)

    def log(self, record: dict[str, Any], kind: str = "train") -> None:
        """Persist `record` (must hold `step`) and print its line."""
        record = {"kind": kind, "time": time.time(), **record}
        self._file.write(json.dumps(record, sort_keys=True, default=_jsonable) + "\n")
        self._file.flush()
        step = int(record["step"])
        if self._tb is not None:
            for key, value in record.items():
                if _is_number(value) and key not in ("step", "time") and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        self.console.print(format_line(record), soft_wrap=True)

    def close(self) -> None:
        self._progress.stop()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def format_line(record: dict[str, Any]) -> str:
    """`step 3 | reward 0.250 | pass 25% | ...` with only the keys present."""
    parts = [f"{record.get('kind', 'train')} step {int(record['step']):>3}"]
    for key, title, fmt in COLUMNS:
        value = record.get(key)
        if _is_number(value):
            parts.append(f"{title} {fmt.format(value)}")
    for key, title in (("break_causes", "causes"), ("guard_causes", "guarded")):
        counts = record.get(key)
        if counts:
            parts.append(f"{title} " + ",".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return " | ".join(parts)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_rewards(
    records: list[dict[str, Any]],
    out_png: str | Path,
    best: tuple[int | None, float | None] = (None, None),
) -> Path:
    """Train reward per step and held-out eval reward as a PNG (matplotlib, no display needed);
    `best`: (step, reward) of the best eval, marked and named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [
        (r["step"], r["reward"]) for r in records if r.get("kind") == "train" and "reward" in r
    ]
    evals = [(r["step"], r["eval_reward"]) for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        raise ValueError("plot_rewards: no train or eval records to plot")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(
            *zip(*train, strict=True), marker=".", alpha=0.7, label="train reward (mean of runs)"
        )
    if evals:
        ax.plot(*zip(*evals, strict=True), marker="o", linewidth=2, label="held-out eval reward")
    if best[0] is not None and best[1] is not None:
        label = best_label(best[0], best[1])
        ax.plot([best[0]], [best[1]], marker="*", markersize=16, linestyle="none", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out)
    plt.close(fig)
    return out


def best_label(step: int, reward: float) -> str:
    """How the plot's legend names the best held-out eval."""
    return f"best held-out eval {reward:.3f} at step {step}"
