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
DISTINCT = FAKE.with_name("distinct_upstream.py")


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


def start_upstream(distinct: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """The fake vLLM, or (`distinct`) the load tests' upstream: almost no CPU per call, and each
    answer derived from its request, so a response given to the wrong client shows."""
    port = free_port()
    cmd = [sys.executable, str(DISTINCT if distinct else FAKE), "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc)
    return proc, url


def start_sidecar(
    upstream: str, db: pathlib.Path | str, *args: str, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`db`: an SQLite file, or a store URL (`postgresql://...`) as is."""
    port = port or free_port()
    store = db if isinstance(db, str) and "://" in db else f"sqlite:///{db}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy_sidecar",
            "--upstream",
            upstream,
            "--store",
            store,
            "--port",
            str(port),
            "--log-calls=false",
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
