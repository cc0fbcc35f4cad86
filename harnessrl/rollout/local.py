"""Local launcher: one harness process per rollout on this machine.

In: `RunSpec`s (task, rollout id, the sidecar URL for that rollout). Out: `RunResult`s with exit
code, stdout, stderr and state; a run that overstays its timeout has its whole process group killed.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harnessrl.rollout.tasks import RunResult, RunSpec
from harnessrl.traces.schema import RolloutState


@dataclass(frozen=True)
class LocalLauncherConfig:
    """How harness processes are started on this machine and bounded."""

    # The harness argv; `{task_file}` and `{rollout_id}` expand. Required by the launcher (the
    # train loop fills an empty one from rollout.harness).
    command: tuple[str, ...] = ()
    concurrency: int = 8  # harness processes at once
    prompt_on_stdin: bool = True  # the prompt is always in env and file; also on stdin if set
    kill_grace_s: float = 2.0  # after TERM, how long the process group gets before KILL
    api_key: str = "harnessrl"  # the harness's OPENAI_API_KEY (the sidecar does not check it)
    max_output_chars: int = 1_000_000  # per stream; longer output is cut (and says so)

    def __post_init__(self) -> None:
        if not isinstance(self.command, tuple) or not all(isinstance(c, str) for c in self.command):
            raise ValueError(
                f"LocalLauncherConfig.command must be a list of strings, got {self.command!r}"
            )
        if self.concurrency < 1:
            raise ValueError(
                f"LocalLauncherConfig.concurrency must be >= 1, got {self.concurrency}"
            )
        if self.kill_grace_s < 0:
            raise ValueError(
                f"LocalLauncherConfig.kill_grace_s must be >= 0, got {self.kill_grace_s}"
            )


def parse_command(command: str | Sequence[str]) -> tuple[str, ...]:
    """A shell-quoted string or a list → argv (no shell is ever involved)."""
    argv = tuple(shlex.split(command)) if isinstance(command, str) else tuple(command)
    if not argv:
        raise ValueError(f"harness command is empty: {command!r}")
    return argv


class LocalLauncher:
    """Runs each spec as its own process group; at most `concurrency` at once."""

    def __init__(
        self,
        config: LocalLauncherConfig,
        env: dict[str, str] | None = None,
        on_start: Callable[[RunSpec], None] | None = None,
    ) -> None:
        if not config.command:
            raise ValueError("LocalLauncherConfig.command is empty: give the harness command line")
        self.config = config
        self._base_env = dict(os.environ if env is None else env)
        self._on_start = on_start
        self._stopping = threading.Event()
        self._live: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        if not specs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, len(specs))) as pool:
            return list(pool.map(self._run_one, specs))

    def stop(self) -> None:
        """Kill every live run (used on Ctrl-C); pending runs come back FAILED."""
        self._stopping.set()
        with self._lock:
            procs = list(self._live.values())
        for proc in procs:
            _kill_group(proc, grace_s=0.0)

    def _run_one(self, spec: RunSpec) -> RunResult:
        start = time.monotonic()
        if self._stopping.is_set():
            return _failed(spec, "launcher stopped before the run started", start)
        with tempfile.TemporaryDirectory(prefix="harnessrl-run-") as tmp:
            task_file = Path(tmp) / "task.json"
            task_file.write_text(json.dumps(spec.task.to_json()))
            argv = [
                part.replace("{task_file}", str(task_file)).replace("{rollout_id}", spec.rollout_id)
                for part in self.config.command
            ]
            env = self._run_env(spec, task_file)
            stdin = spec.task.prompt.encode() if self.config.prompt_on_stdin else b""
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    cwd=tmp,
                    start_new_session=True,  # own process group: a timeout kills grandchildren too
                )
            except OSError as err:
                return _failed(spec, f"could not start harness {argv[0]!r}: {err}", start)
            with self._lock:
                self._live[proc.pid] = proc
            if self._on_start is not None:
                self._on_start(spec)
            try:
                return self._wait(spec, proc, stdin, start)
            finally:
                with self._lock:
                    self._live.pop(proc.pid, None)

    def _run_env(self, spec: RunSpec, task_file: Path) -> dict[str, str]:
        env = dict(self._base_env)
        # A harness gets its rollout's own reward credential, never the sidecar's control token.
        env.pop("HARNESSRL_CONTROL_TOKEN", None)
        env.update(
            OPENAI_BASE_URL=spec.base_url,
            OPENAI_API_KEY=self.config.api_key,
            HARNESSRL_ROLLOUT_ID=spec.rollout_id,
            HARNESSRL_TASK_FILE=str(task_file),
            HARNESSRL_TASK_PROMPT=spec.task.prompt,
        )
        if spec.reward_url:
            env.update(
                HARNESSRL_REWARD_URL=spec.reward_url, HARNESSRL_REWARD_TOKEN=spec.reward_token
            )
        return env

    def _wait(
        self, spec: RunSpec, proc: subprocess.Popen[bytes], stdin: bytes, start: float
    ) -> RunResult:
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc, grace_s=self.config.kill_grace_s)
            out, err = proc.communicate()
        stdout, stderr = self._text(out), self._text(err)
        if timed_out:
            state = RolloutState.TIMED_OUT
            stderr += (
                f"\n[harnessrl] run exceeded its timeout of {spec.timeout_s:g}s and was killed"
            )
        elif self._stopping.is_set() and proc.returncode != 0:
            state = RolloutState.FAILED
        else:
            state = RolloutState.SUCCEEDED if proc.returncode == 0 else RolloutState.FAILED
        return RunResult(
            rollout_id=spec.rollout_id,
            state=state,
            exit_code=proc.returncode,
            stdout=stdout,
            stderr=stderr,
            duration_s=time.monotonic() - start,
            output=stdout.strip(),
        )

    def _text(self, data: bytes | None) -> str:
        text = (data or b"").decode("utf-8", errors="replace")
        limit = self.config.max_output_chars
        if len(text) > limit:
            text = text[:limit] + f"\n[harnessrl] output cut at {limit} characters"
        return text


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """TERM the process group, wait up to `grace_s`, then KILL whatever is left of it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if wait_s is None:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader exited on TERM; children that ignored it still get KILL below.


def _failed(spec: RunSpec, why: str, start: float) -> RunResult:
    return RunResult(
        rollout_id=spec.rollout_id,
        state=RolloutState.FAILED,
        exit_code=None,
        stdout="",
        stderr=f"[harnessrl] {why}",
        duration_s=time.monotonic() - start,
        output="",
    )
