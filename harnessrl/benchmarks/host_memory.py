"""Benchmark: learner steps with freed memory kept in-process, against glibc's default, in one run.

`harnessrl.host_memory.keep_freed_memory` is a process-wide allocator setting, so each side runs
in its own fresh process: the same learner step (SmolLM2 by default, a packed `--rows` x
`--length` micro-batch, float32, AdamW), warmed up once, then `--steps` timed steps, reporting
per step the wall time, the page faults and the system (kernel) time. Rounds alternate the two
sides so a shared host's drifting speed weighs on both alike. Figures are medians over every
timed step. Last line: `host_memory: step_s_kept=<s> step_s_default=<s> speedup=<default/kept>
faults_per_step_kept=<n> faults_per_step_default=<n> system_s_kept=<s> system_s_default=<s>`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from harnessrl.host_memory import ENV, keep_freed_memory

SIDES = {"kept": "1", "default": "0"}


def worker(model: str, rows: int, length: int, steps: int) -> None:
    """One side: print one JSON line per timed step (wall s, page faults, system s)."""
    kept = keep_freed_memory()  # first, before XLA starts its threads; honours ENV
    from harnessrl.benchmarks.learner import LEARNING_RATE, packed_batch
    from harnessrl.data.pack import PackedBatch
    from harnessrl.learner.config import LearnerConfig
    from harnessrl.learner.step import Learner
    from harnessrl.model.formats.load import load_policy

    policy, _ = load_policy(model)
    learner = Learner(policy, LearnerConfig(learning_rate=LEARNING_RATE))
    batch = [PackedBatch(**packed_batch(rows, length, policy.cfg.vocab_size))]
    learner.train_step(batch)  # compiles, and touches every buffer once
    for _ in range(steps):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        learner.train_step(batch)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        record = {
            "kept": kept,
            "wall_s": wall,
            "faults": after.ru_minflt - before.ru_minflt,
            "system_s": after.ru_stime - before.ru_stime,
        }
        print(json.dumps(record), flush=True)


def run_side(side: str, args: argparse.Namespace) -> list[dict[str, float]]:
    command = [
        sys.executable, "-m", "harnessrl.benchmarks.host_memory", "--worker",
        "--model", args.model, "--rows", str(args.rows), "--length", str(args.length),
        "--steps", str(args.steps),
    ]  # fmt: skip
    done = subprocess.run(
        command, env={**os.environ, ENV: SIDES[side]}, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"the {side} side failed (exit {done.returncode}):\n{done.stderr}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(records) != args.steps or any(r["kept"] != (side == "kept") for r in records):
        raise RuntimeError(f"the {side} side printed {records!r}, not {args.steps} steps")
    return records


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2 | HF folder | .gguf | tiny")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per side, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rows, args.steps, args.rounds) < 1 or args.length < 40:
        parser.error(
            f"need --rows, --steps, --rounds >= 1 and --length >= 40; got {args.rows}, "
            f"{args.steps}, {args.rounds}, {args.length}"
        )
    if args.worker:
        worker(args.model, args.rows, args.length, args.steps)
        return
    print(
        f"learner step: {args.model}, {args.rows}x{args.length} tokens, float32; {args.rounds} "
        f"fresh processes per side, {args.steps} timed steps each"
    )
    steps: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            steps[side] += run_side(side, args)
    med = {
        side: {
            k: statistics.median(r[k] for r in records) for k in ("wall_s", "faults", "system_s")
        }
        for side, records in steps.items()
    }
    for side, m in med.items():
        print(
            f"{side:>8}: {m['wall_s']:6.2f} s/step  {m['faults']:9.0f} page faults/step  "
            f"{m['system_s']:5.2f} s system/step"
        )
    kept, default = med["kept"], med["default"]
    print(
        f"host_memory: step_s_kept={kept['wall_s']:.2f} step_s_default={default['wall_s']:.2f} "
        f"speedup={default['wall_s'] / kept['wall_s']:.2f} "
        f"faults_per_step_kept={kept['faults']:.0f} faults_per_step_default={default['faults']:.0f} "
        f"system_s_kept={kept['system_s']:.2f} system_s_default={default['system_s']:.2f}"
    )


if __name__ == "__main__":
    main()
