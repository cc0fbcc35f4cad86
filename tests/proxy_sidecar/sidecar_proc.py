"""Run the fake upstream and `python -m proxy_sidecar` as real processes (load and crash tests)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import httpx
from fake_vllm import free_port

FAKE = pathlib.Path(__file__).parents[1] / "fixtures" / "vllm" / "fake_vllm.py"


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Wait until `url` answers; a process that never does is killed, not left behind."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"{url} not up after {timeout_s}s")


def start_upstream(fixed: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """The fake vLLM, or (`fixed`) the benchmark's upstream that answers fixed vLLM-shaped bytes
    at almost no CPU cost, for tests that measure the sidecar rather than the fake."""
    port = free_port()
    if fixed:
        cmd = [sys.executable, "-m", "harnessrl.benchmarks.sidecar", "--serve-upstream", str(port)]
    else:
        cmd = [sys.executable, str(FAKE), "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc)
    return proc, url


def start_sidecar(
    upstream: str, db: pathlib.Path, *args: str, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = port or free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy_sidecar",
            "--upstream",
            upstream,
            "--store",
            f"sqlite:///{db}",
            "--port",
            str(port),
            "--no-call-log",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
