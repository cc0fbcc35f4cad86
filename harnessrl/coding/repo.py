"""Task repositories: where a task's code comes from and a fresh checkout of its base commit.

In: a `CodingTask` and where mirrors live. Out: a new git repository at the base commit that holds
no later history, no other refs, no remote and no reflog (the fix is not in its object store).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harnessrl.coding.tasks import CodingTask

# Our git never reads the user's or the system's config (hooks, signing, aliases, autocrlf) and
# stamps commits with one fixed identity and date, so an inline task's base commit has one hash.
IDENTITY = {
    "GIT_AUTHOR_NAME": "harnessrl",
    "GIT_AUTHOR_EMAIL": "tasks@harnessrl.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "harnessrl",
    "GIT_COMMITTER_EMAIL": "tasks@harnessrl.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
SMITH_REMOVAL = "Remove F2P Tests"  # SWE-smith's commit that hides the failing tests on a branch


class GitError(RuntimeError):
    """A git command failed; carries the command and git's own message."""


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(IDENTITY)
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_TERMINAL_PROMPT="0",
        GIT_ASKPASS="true",
    )
    env.update(extra or {})
    return env


def git(
    cwd: str | Path, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> str:
    """Run git in `cwd` with isolated config; its stdout, or GitError with its stderr."""
    argv = ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.quotePath=false", *args]
    # surrogateescape: file bytes that are not UTF-8 survive a round trip through a diff str.
    proc = subprocess.run(
        argv, cwd=cwd, input=stdin, capture_output=True, text=True, errors="surrogateescape",
        env=git_env(env), check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise GitError(f"`git {' '.join(args)}` failed in {cwd}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def commit_tree(workdir: Path, files: dict[str, str], message: str) -> str:
    """Write `files` into an empty repository and commit them; the commit's hash."""
    for rel, text in files.items():
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(workdir, "add", "-A")
    git(workdir, "commit", "-q", "--no-gpg-sign", "-m", message)
    return git(workdir, "rev-parse", "HEAD").strip()


def apply_patch(workdir: Path, patch: str, *, what: str) -> None:
    """`git apply` a patch; GitError names `what` failed to apply."""
    if not patch.strip():
        return
    try:
        git(workdir, "apply", "--binary", "--whitespace=nowarn", "-", stdin=patch)
    except GitError as err:
        raise GitError(f"the {what} does not apply: {err}") from err


def _inline_key(task: CodingTask) -> str:
    h = hashlib.sha256()
    for path, text in task.files:
        h.update(f"{len(path)}:{path}{len(text)}:{text}".encode())
    h.update(task.patch.encode() + b"\0" + task.test_patch.encode())
    return h.hexdigest()[:20]


def inline_source(task: CodingTask, cache_dir: Path) -> Path:
    """Build (once per cache) the upstream repo of an inline task: its base, then the fix on top.

    The fix commit is there on purpose: like a real upstream, the source knows the answer, and the
    checkout must be what keeps it from the agent.
    """
    dest = cache_dir / f"inline-{_inline_key(task)}"
    if (dest / ".git").is_dir():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        git(tmp, "init", "-q", "-b", "main")
        base = commit_tree(tmp, dict(task.files), "base")
        if task.base_commit and base != task.base_commit:
            raise ValueError(
                f"task {task.instance_id!r}: its files commit to {base}, not to its base_commit "
                f"{task.base_commit}; the row was edited by hand or built by another generator"
            )
        apply_patch(tmp, task.patch, what=f"gold patch of {task.instance_id!r}")
        apply_patch(tmp, task.test_patch, what=f"test patch of {task.instance_id!r}")
        git(tmp, "add", "-A")
        git(tmp, "commit", "-q", "--no-gpg-sign", "--allow-empty", "-m", "fix")
        try:
            tmp.rename(dest)
        except OSError:  # another process built the same source first
            if not (dest / ".git").is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def mirror_of(task: CodingTask, mirrors: str) -> str:
    """Where a repo-backed task's upstream lives: `{repo}` in a URL template, or a mirror folder."""
    if not mirrors:
        raise ValueError(
            f"task {task.instance_id!r} needs its repository {task.repo!r}; set the sandbox's "
            "mirrors to a folder of clones (owner__name) or a URL template with {repo}"
        )
    if "{repo}" in mirrors:
        return mirrors.format(repo=task.repo)
    name = task.repo.replace("/", "__")
    for candidate in (Path(mirrors) / name, Path(mirrors) / f"{name}.git"):
        if candidate.is_dir():
            return str(candidate)
    raise ValueError(
        f"task {task.instance_id!r}: no mirror of {task.repo!r} in {mirrors} "
        f"(looked for {name} and {name}.git)"
    )


@dataclass(frozen=True)
class Checkout:
    """A fresh checkout: its base commit and the test patch the grader applies over a diff."""

    path: Path
    base_commit: str
    test_patch: str


def _smith_test_patch(source: str, branch: str, scratch: Path) -> str:
    """SWE-smith hides the failing tests in a last commit; undoing it is the test patch."""
    git(scratch, "init", "-q", "-b", "scratch")
    git(scratch, "fetch", "-q", "--no-tags", "--depth=2", source, f"refs/heads/{branch}")
    subject = git(scratch, "log", "-1", "--format=%s", "FETCH_HEAD").strip()
    if subject != SMITH_REMOVAL:
        return ""
    return git(scratch, "diff", "--binary", "--full-index", "FETCH_HEAD", "FETCH_HEAD~1")


def checkout(
    task: CodingTask, dest: Path, *, mirrors: str, cache_dir: Path, history: str
) -> Checkout:
    """A new repository at `dest` holding the base commit (and, with history="past", its past)."""
    if history not in ("base", "past"):
        raise ValueError(f"history must be 'base' or 'past', got {history!r}")
    source = str(inline_source(task, cache_dir)) if task.files else mirror_of(task, mirrors)
    want = task.base_commit or f"refs/heads/{task.branch}"
    # A SWE-smith branch's past holds the commit that planted the bug: only its tip may come.
    shallow = history == "base" or task.kind == "swe-smith"
    dest.mkdir(parents=True)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "fetch", "-q", "--no-tags", *(["--depth=1"] if shallow else []), source, want)
    git(dest, "checkout", "-q", "-B", "main", "FETCH_HEAD")
    (dest / ".git" / "FETCH_HEAD").unlink()
    git(dest, "reflog", "expire", "--expire=now", "--all")
    base = git(dest, "rev-parse", "HEAD").strip()
    if task.base_commit and base != task.base_commit:
        raise ValueError(f"task {task.instance_id!r}: checked out {base}, not {task.base_commit}")
    test_patch = task.test_patch
    if task.kind == "swe-smith" and not test_patch:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            test_patch = _smith_test_patch(source, task.branch, Path(scratch))
    return Checkout(dest, base, test_patch)
