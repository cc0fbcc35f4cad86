"""Benchmark: local coding sandboxes, setup and grading time per task, bubblewrap and plain.

Over the shipped HumanEval bug tasks: `setup` is one `prepare()` (fresh checkout from the built
task source, the copy of its git dir) through `close()`; `grade` is one `grade()` of the gold
patch (its own fresh sandbox, the patches applied, one pytest command). The first checkout of a
task also builds its source repository once; that is reported as `build`. Last line, for
bubblewrap (or plain where bubblewrap cannot run): `sandbox: setup_ms_p50=.. grade_ms_p50=.. tasks=..`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings

from harnessrl.coding.grade import GradeConfig, grade
from harnessrl.coding.sandbox import SandboxConfig, bwrap_problem, prepare
from harnessrl.coding.taskset import load_shipped


def _ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(isolation: str, count: int, plugin_autoload: bool) -> dict[str, list[float]]:
    """Per-task build, setup and grade seconds under one isolation."""
    root = tempfile.mkdtemp(prefix="harnessrl-bench-sandbox-")
    sandbox = SandboxConfig(root=root, isolation=isolation)
    cfg = GradeConfig(sandbox=sandbox, plugin_autoload=plugin_autoload)
    times: dict[str, list[float]] = {"build": [], "setup": [], "grade": []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # plain mode's warning, said once below instead
            for task in load_shipped()[:count]:
                for phase in ("build", "setup"):
                    start = time.perf_counter()
                    prepare(task, sandbox).close()
                    times[phase].append(time.perf_counter() - start)
                start = time.perf_counter()
                result = grade(task, task.patch, cfg)
                times["grade"].append(time.perf_counter() - start)
                if result.reward != 1.0:
                    raise RuntimeError(f"gold patch of {task.instance_id} got {result.reward}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=48, help="how many shipped tasks")
    parser.add_argument("--isolation", choices=("both", "bwrap", "plain"), default="both")
    parser.add_argument(
        "--no-plugin-autoload", action="store_true",
        help="grade without loading installed pytest plugins (the shipped tests need none)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.tasks < 1:
        parser.error(f"--tasks must be >= 1, got {args.tasks}")
    problem = bwrap_problem()
    modes = ["bwrap", "plain"] if args.isolation == "both" else [args.isolation]
    if problem and "bwrap" in modes:
        print(f"bwrap skipped: {problem}")
        modes = [m for m in modes if m != "bwrap"] or ["plain"]
    results = {}
    print(f"{'isolation':<10} {'tasks':>5} {'build p50':>10} {'setup p50':>10} {'setup p90':>10} "
          f"{'grade p50':>10} {'grade p90':>10}  (ms)")  # fmt: skip
    for mode in modes:
        t = results[mode] = measure(mode, args.tasks, not args.no_plugin_autoload)
        print(f"{mode:<10} {len(t['setup']):>5} {_ms(t['build'], 0.5):>10.0f} "
              f"{_ms(t['setup'], 0.5):>10.0f} {_ms(t['setup'], 0.9):>10.0f} "
              f"{_ms(t['grade'], 0.5):>10.0f} {_ms(t['grade'], 0.9):>10.0f}")  # fmt: skip
    if "plain" in results:
        print("plain: network, filesystem, /tmp and processes are NOT isolated (the fallback)")
    head = results.get("bwrap") or results["plain"]
    total = sum(head["grade"])
    print(f"grading all {len(head['grade'])} gold patches took {total:.1f} s "
          f"(median {statistics.median(head['grade']):.3f} s) on one thread")  # fmt: skip
    print(f"sandbox: setup_ms_p50={_ms(head['setup'], 0.5):.0f} "
          f"grade_ms_p50={_ms(head['grade'], 0.5):.0f} tasks={len(head['grade'])}")  # fmt: skip


if __name__ == "__main__":
    main()
