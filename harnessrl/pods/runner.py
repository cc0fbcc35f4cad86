"""Inside a coding run's pod: the checkout (init container), then the harness and our diff of it.

In: a checkout row (the task's base only: never its patches or tests) and the harness argv. Out:
the checkout and a copy of its git dir (`prepare`), then the container log (`harness`): the tail
of the harness's output, and last our diff of the work tree, framed so that it reads back exactly.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.coding.repo import IDENTITY, checkout, git
from harnessrl.coding.tasks import CodingTask

BEGIN = "harnessrl-diff-begin"
END = "harnessrl-diff-end "
TRAJECTORY = "traj.json"
LOG_TAIL = 64_000  # bytes of the harness's own output repeated in the container log
_CHECKOUT_FIELDS = ("instance_id", "repo", "base_commit", "branch", "files", "setup")
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4


def checkout_row(task: CodingTask) -> dict[str, Any]:
    """What the pod gets of a task: where its base comes from. No patch, test or statement."""
    row = {name: getattr(task, name) for name in _CHECKOUT_FIELDS}
    row["files"] = dict(task.files)
    return row


def task_of(row: Any) -> CodingTask:
    if not isinstance(row, dict) or set(row) != set(_CHECKOUT_FIELDS):
        raise ValueError(f"a checkout row has exactly the fields {_CHECKOUT_FIELDS}, got {row!r}")
    files = tuple(sorted(row["files"].items()))
    return CodingTask(
        row["instance_id"], "", "", repo=row["repo"], base_commit=row["base_commit"],
        branch=row["branch"], files=files, setup=row["setup"],
    )  # fmt: skip


def prepare(task: CodingTask, repo: Path, base: Path, *, mirrors: str, history: str) -> str:
    """Check the task out at `repo` and keep its git dir as `base`/git; the base commit."""
    with tempfile.TemporaryDirectory(prefix="checkout-") as scratch:
        co = checkout(task, repo, mirrors=mirrors, cache_dir=Path(scratch), history=history)
    # Taken before setup runs: the diff base is the task's checkout, not what setup leaves.
    shutil.copytree(repo / ".git", base / "git", symlinks=True)
    (base / "commit").write_text(co.base_commit)
    if task.setup:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(repo.parent),
            **IDENTITY,
        }
        done = subprocess.run(["sh", "-c", task.setup], cwd=repo, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"setup of task {task.instance_id!r} exited {done.returncode}")
    return co.base_commit


def take_diff(repo: Path, base_git: Path, base_commit: str, scratch: Path) -> str:
    """The changes in `repo`'s work tree (committed, staged or not, untracked) against the base.

    Read with the kept git dir, which may be read-only: new objects and the index go to `scratch`.
    Nothing of the agent's .git (config, hooks, refs) is used; its work tree is read as files.
    """
    env = {
        "GIT_INDEX_FILE": str(scratch / "index"),
        "GIT_OBJECT_DIRECTORY": str(scratch / "objects"),
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(base_git / "objects"),
    }
    if scratch.resolve().is_relative_to(repo.resolve()):  # TMPDIR made a link into the tree
        raise RuntimeError(f"the scratch folder {scratch} lies inside the checkout {repo}")
    (scratch / "objects").mkdir(exist_ok=True)
    where = ["--git-dir", str(base_git), "--work-tree", str(repo)]
    git(scratch, *where, "read-tree", base_commit, env=env)
    git(scratch, *where, "add", "-A", env=env)
    return git(
        scratch, *where, "diff", "--cached", "--binary", "--full-index", "--no-renames",
        "--no-ext-diff", "--no-textconv", base_commit, env=env,
    )  # fmt: skip


def frame(diff: str, info: dict[str, Any]) -> str:
    """The diff as the log's last lines: base64 lines between markers, checked by a digest."""
    data = diff.encode("utf-8", "surrogateescape")
    text = base64.b64encode(data).decode()
    lines = [text[i : i + 76] for i in range(0, len(text), 76)]
    end = {**info, "sha256": hashlib.sha256(data).hexdigest(), "lines": len(lines)}
    return "\n".join([BEGIN, *lines, END + json.dumps(end, sort_keys=True)]) + "\n"


@dataclass(frozen=True)
class Framed:
    """A run's log read back: what came before the frame, the diff, and the frame's info."""

    before: str
    diff: str
    info: dict[str, Any]


def unframe(log: str) -> Framed:
    """Read the frame from the end of the log (whatever came before it cannot fake it)."""
    lines = log.rstrip("\n").split("\n")
    if not lines or not lines[-1].startswith(END):
        raise ValueError("the log does not end with a diff frame (the run ended before its diff)")
    try:
        info = json.loads(lines[-1][len(END) :])
        n = info["lines"]
        if not isinstance(n, int) or n < 0 or len(lines) < n + 2 or lines[-2 - n] != BEGIN:
            raise ValueError("the frame's begin marker is not where its line count puts it")
        data = base64.b64decode("".join(lines[len(lines) - 1 - n : -1]), validate=True)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the diff frame at the end of the log is malformed: {err}") from err
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise ValueError("the diff frame's digest does not match its content")
    before = "\n".join(lines[: len(lines) - 2 - n])
    return Framed(before, data.decode("utf-8", "surrogateescape"), info)


def _guard_self() -> bool:
    """No one of our uid may trace us or read our memory and fds (the harness runs as our uid);
    whether that took (it is recorded with the diff)."""
    # As the pod's PID 1 only signals with handlers reach us: SIGINT's becomes a no-op.
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        return bool(libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # not Linux
        return False


def _end_others(proc: subprocess.Popen[bytes]) -> None:
    """Kill what the harness left running, so nothing changes the tree while we read it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if os.getpid() != 1:  # outside a pod (tests): the harness's own group is all we may end
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # as PID 1: every other process of the container
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # reap them (we are their init)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)


def _exit_status(out: Path) -> str:
    """mini-swe-agent's exit status from its trajectory ("" for other harnesses)."""
    try:
        info = json.loads((out / TRAJECTORY).read_text()).get("info", {})
        return str(info.get("exit_status") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def run_harness(
    argv: Sequence[str], *, repo: Path, base: Path, out: Path, timeout_s: float,
    graded_exits: Sequence[str] = (),
) -> int:  # fmt: skip
    """Run the harness in `repo`, then print the tail of its output and our framed diff."""
    undumpable = _guard_self()
    for folder in (out, *(Path(os.environ[v]) for v in ("HOME", "TMPDIR") if v in os.environ)):
        folder.mkdir(parents=True, exist_ok=True)
    log_path = out / "harness.log"
    start = time.monotonic()
    with open(log_path, "w+b") as log:
        # Its output goes to a file, never to our stdout: only we write the container log.
        proc = subprocess.Popen(
            list(argv), cwd=repo, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        _end_others(proc)
        # Read back through our own descriptor: the path may have been replaced meanwhile.
        log.seek(max(0, os.fstat(log.fileno()).st_size - LOG_TAIL))
        tail = log.read(LOG_TAIL).decode("utf-8", "replace")
    info: dict[str, Any] = {
        "exit_code": code, "timed_out": code is None, "exit_status": _exit_status(out),
        "harness_s": round(time.monotonic() - start, 3), "undumpable": undumpable,
    }  # fmt: skip
    commit = (base / "commit").read_text().strip()
    try:  # TMPDIR is the harness's too: what it left there may refuse us
        with tempfile.TemporaryDirectory(prefix="diff-") as scratch:
            diff = take_diff(repo, base / "git", commit, Path(scratch))
    except (OSError, RuntimeError) as err:
        print(f"[harnessrl] could not take the diff: {err}", file=sys.stderr, flush=True)
        return 3
    sys.stdout.write(tail if tail.endswith("\n") or not tail else tail + "\n")
    sys.stdout.write(frame(diff, info))
    sys.stdout.flush()
    if code is None:
        return 124
    if code == 0 or info["exit_status"] in graded_exits:
        return 0
    return code if code > 0 else 128 - code  # killed by a signal: the shell's convention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harnessrl.pods.runner", description=__doc__)
    sub = p.add_subparsers(dest="step", required=True)
    pre = sub.add_parser("prepare", help="init container: the checkout and the kept git dir")
    pre.add_argument("--task", required=True, help="the checkout row (JSON file)")
    pre.add_argument("--mirrors", default="", help="folder of clones named owner__name")
    pre.add_argument("--history", default="base", choices=("base", "past"))
    har = sub.add_parser("harness", help="harness container: run it, then print our diff")
    har.add_argument("--out", required=True, help="a writable folder outside the checkout")
    har.add_argument("--timeout-s", type=float, required=True)
    har.add_argument("--graded-exits", default="", help="comma-separated exit statuses")
    har.add_argument("argv", nargs="+", help="the harness command, after --")
    for step in (pre, har):
        step.add_argument("--repo", required=True, help="the checkout (the harness's work tree)")
        step.add_argument("--base", required=True, help="where the kept git dir lives")
    args = p.parse_args(argv)
    repo, base = Path(args.repo), Path(args.base)
    if args.step == "prepare":
        task = task_of(json.loads(Path(args.task).read_text()))
        commit = prepare(task, repo, base, mirrors=args.mirrors, history=args.history)
        print(f"[harnessrl] checked out {task.instance_id} at {commit}", flush=True)
        return 0
    exits = [s for s in args.graded_exits.split(",") if s]
    return run_harness(args.argv, repo=repo, base=base, out=Path(args.out),
                       timeout_s=args.timeout_s, graded_exits=exits)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
