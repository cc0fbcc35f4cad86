"""The train loop's own sidecar: `python -m proxy_sidecar` as a child process of the trainer.

In: the sidecar config (upstreams, store, limits; every field passed on as a flag). Out: a running
sidecar that dies with the trainer, with its control API (pause, resume, policy version) at hand.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from harnessrl.cli import to_argv
from harnessrl.model import registry
from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.control import rollout_url


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Model specs whose tokenizer is SmolLM2's (random policies around it, and SmolLM2 itself).
SMOLLM2_SPECS = frozenset({"smollm2", *registry.RANDOM_SPECS})
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def served_tokenizer(model: str) -> str | None:
    """The sidecar's `tokenizer` for the served model spec `model` (serve.model), turning token-in
    mode on; None where the spec names no tokenizer on this machine."""
    if model in SMOLLM2_SPECS:
        return "smollm2"
    path = Path(model)
    if path.is_dir() and any((path / name).is_file() for name in HF_TOKENIZER_FILES):
        return str(path.absolute())
    if path.is_file() and path.suffix == ".gguf":
        return str(path.absolute())
    return None


# Runs as the sidecar's `python -c` prelude: on Linux, ask for SIGTERM when the trainer dies (even
# by SIGKILL), then become `python -m proxy_sidecar ...`. Done in the child's own interpreter, not
# in a preexec_fn, because forking a multithreaded JAX process must not run Python before exec.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "    if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'proxy_sidecar', *sys.argv[2:]])\n"
)


class SidecarRefused(RuntimeError):
    """A sidecar's control API answered something other than 200 (its error message quoted)."""

    def __init__(self, url: str, action: str, response: httpx.Response) -> None:
        try:
            message = str(response.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        super().__init__(
            f"sidecar {url}/control/{action} answered {response.status_code}: {message}"
        )
        self.url, self.action, self.status = url, action, response.status_code


class SidecarProcess:
    """`python -m proxy_sidecar` run with `cfg`; port 0 picks a free one, no token a fresh one."""

    def __init__(self, cfg: SidecarConfig, log_path: Path, startup_timeout_s: float = 60.0) -> None:
        self.token = cfg.control_token or secrets.token_hex(16)
        self.port = cfg.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Every field travels as a flag, except the token: through the environment, out of `ps`.
        flags = to_argv(dataclasses.replace(cfg, port=self.port), skip=("control_token",))
        argv = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *flags]
        env = dict(os.environ, HARNESSRL_CONTROL_TOKEN=self.token)
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the trainer, which stops the sidecar in order
        )
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=120.0
        )
        self._wait_healthy(startup_timeout_s, log_path)

    def _wait_healthy(self, timeout_s: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"the sidecar did not become healthy on {self.url}; its log ends:\n{tail}"
        )

    def base_url(self, rollout_id: str) -> str:
        """What a harness gets as OPENAI_BASE_URL for this rollout."""
        return rollout_url(self.url, rollout_id)

    def control(
        self, action: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /control/{action}; SidecarRefused on any answer but 200. `timeout_s`: the wait
        for the answer (a pause that drains answers only when drained or refused)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        r = self.client.post(f"/control/{action}", json=body or {}, timeout=timeout)
        if r.status_code != 200:
            raise SidecarRefused(self.url, action, r)
        return dict(r.json())

    def status(self) -> dict[str, Any]:
        return dict(self.client.get("/control/status").json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.client.close()
        self._log.close()
