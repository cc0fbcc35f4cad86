"""Sidecar latency benchmark: direct vs through the sidecar (aiohttp and httpx upstream clients) vs
through the LiteLLM proxy, against one local vLLM-dialect upstream, in the same run.

`python -m harnessrl.benchmarks.sidecar [--quick]`. Prints a table per scenario (1 and 32
concurrent clients, non-streaming and streaming) and ends with
`sidecar: overhead_p50_ms=.. overhead_p99_ms=.. litellm_overhead_ratio=.. lost=..` where the
overheads are the sidecar's added latency (p50/p99 of through-sidecar minus direct, one client,
non-streaming, capture and durable SQLite storage on) and the ratio is LiteLLM's added p50 over
ours. `lost` counts 200 responses through a sidecar whose call is missing from its store.

Token-in rows follow (tokenin.py): an agent loop's growing conversation at about 1k and
16k tokens (each call adds the function call the sidecar answered and its output) as Responses and
Messages calls, which the sidecar renders and tokenizes itself, beside pass-through chat calls of
the same conversation, one client, non-streaming. The last line adds, per context size (`_1k`,
`_16k`),
`tokenin_p50_ms` / `tokenin_p99_ms` (Responses through the sidecar minus the upstream's
completions on the same token-id prompt), `messages_p50_ms`, `passthrough_p50_ms` /
`passthrough_p99_ms` (chat through the sidecar minus chat direct) and `tokenin_ratio` (the p50s'
ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
# LiteLLM refuses to start without a master key; every target gets the same header.
API_KEY = "sk-" + "5eb1" * 16
COMPLETION = [33, 30, 378, 1797, 1918, 28, 732, 216, 34, 32, 34, 41, 30, 2, 198, 216]


def _token(i: int, tid: int) -> dict[str, object]:
    return {"token": f"t{tid}", "logprob": -0.1 - i / 7, "bytes": [116], "top_logprobs": []}


def upstream_bodies() -> tuple[bytes, bytes]:
    """A vLLM-shaped chat response and the SSE stream of the same completion."""
    head = {"id": "chatcmpl-b", "created": 1, "model": "smol"}
    content = [_token(i, t) for i, t in enumerate(COMPLETION)]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(f"t{t}" for t in COMPLETION)},
        "logprobs": {"content": content},
        "finish_reason": "length",
        "token_ids": COMPLETION,
    }
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(COMPLETION)}
    full = {
        **head,
        "object": "chat.completion",
        "choices": [choice],
        "usage": usage,
        "prompt_token_ids": PROMPT_IDS,
    }
    chunk = {**head, "object": "chat.completion.chunk"}
    events = [
        {
            **chunk,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "prompt_token_ids": PROMPT_IDS,
        }
    ]
    for i, tid in enumerate(COMPLETION):
        last = i == len(COMPLETION) - 1
        events.append(
            {
                **chunk,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": content[i]["token"]},
                        "logprobs": {"content": [content[i]]},
                        "token_ids": [tid],
                        "finish_reason": "length" if last else None,
                    }
                ],
            }
        )
    sse = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return orjson.dumps(full), sse


@functools.lru_cache(maxsize=8)
def long_chat(prompt_len: int) -> bytes:
    """The chat answer, with the `prompt_len` prompt ids vLLM returns for a long context."""
    full = orjson.loads(upstream_bodies()[0])
    full["prompt_token_ids"] = (PROMPT_IDS * (prompt_len // len(PROMPT_IDS) + 1))[:prompt_len]
    full["usage"]["prompt_tokens"] = prompt_len
    return orjson.dumps(full)


def serve_upstream(port: int) -> None:
    """A minimal pure-ASGI vLLM-dialect server: fixed chat bytes (with as many prompt ids as a
    long-context request names), completions echoing their token-id prompt."""
    import uvicorn

    from harnessrl.benchmarks.sidecar.tokenin import chat_prompt_len, completions_body

    full, sse = upstream_bodies()
    sse_events = [e + b"\n\n" for e in sse.split(b"\n\n") if e]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        stream = b'"stream":true' in body
        answer = full
        if scope["path"] == "/v1/completions":  # token-in calls: their prompt echoed
            answer = completions_body(orjson.loads(body))
        elif (size := chat_prompt_len(body)) is not None:
            answer = long_chat(size)
        headers = [
            (b"content-type", b"text/event-stream" if stream else b"application/json"),
            (b"x-harnessrl-policy-version", b"3"),
        ]
        if not stream:
            headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if not stream:
            await send({"type": "http.response.body", "body": answer})
            return
        for event in sse_events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="off",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


@dataclass
class Target:
    name: str
    base: str  # .../v1
    ok: int = 0
    lat: dict[str, list[float]] = field(default_factory=dict)


async def run_clients(
    target: Target, label: str, clients: int, per_client: int, stream: bool
) -> None:
    body = orjson.dumps(
        {
            "model": "smol",
            "messages": [{"role": "user", "content": "Count to 3."}],
            "max_tokens": 16,
            "stream": stream,
        }
    )
    url = target.base + "/chat/completions"
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                async for _ in r.content.iter_any():
                    pass
                if r.status != 200:
                    raise RuntimeError(f"{target.name}: HTTP {r.status}")
            lat.append((time.perf_counter() - t0) * 1000)
            target.ok += 1

        async def worker() -> None:
            for _ in range(per_client):
                await one()

        for _ in range(5):  # warm-up: connections, caches
            await one()
        lat.clear()
        await asyncio.gather(*(worker() for _ in range(clients)))
    target.lat.setdefault(label, []).extend(lat)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def start_litellm(upstream: str, tmp: str) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    exe = shutil.which("litellm", path=os.path.dirname(sys.executable))
    if exe is None:
        return None, "", "litellm not installed (pip install -e '.[bench]')"
    cfg = os.path.join(tmp, "litellm.yaml")
    with open(cfg, "w") as f:
        f.write(
            "model_list:\n  - model_name: smol\n    litellm_params:\n"
            f"      model: openai/smol\n      api_base: {upstream}/v1\n      api_key: x\n"
        )
    port = free_port()
    proc = spawn(
        [
            exe,
            "--config",
            cfg,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num_workers",
            "1",
            "--telemetry",
            "False",
        ],
        env={"LITELLM_LOG": "ERROR", "DISABLE_ADMIN_UI": "True", "LITELLM_MASTER_KEY": API_KEY},
    )
    return proc, f"http://127.0.0.1:{port}", ""


def start_targets(tmp: str) -> tuple[list[subprocess.Popen[bytes]], list[Target], dict[str, str]]:
    """The upstream and one sidecar per upstream client library, as processes."""
    up_port = free_port()
    procs = [
        spawn(
            [sys.executable, "-m", "harnessrl.benchmarks.sidecar", "--serve-upstream", str(up_port)]
        )
    ]
    upstream = f"http://127.0.0.1:{up_port}"
    targets = [Target("direct", upstream + "/v1")]
    dbs = {}
    for client in ("aiohttp", "httpx"):
        port = free_port()
        dbs[client] = os.path.join(tmp, f"{client}.db")
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "proxy_sidecar",
                    "--upstream",
                    upstream,
                    "--store",
                    f"sqlite:///{dbs[client]}",
                    "--port",
                    str(port),
                    "--client",
                    client,
                    "--tokenizer",
                    "smollm2",
                ]
            )
        )
        targets.append(Target(f"sidecar[{client}]", f"http://127.0.0.1:{port}/v1"))
    return procs, targets, dbs


async def measure(args: argparse.Namespace, tmp: str) -> int:
    procs, targets, dbs = start_targets(tmp)
    upstream = targets[0].base.removesuffix("/v1")
    lite, lite_url, why_not = start_litellm(upstream, tmp)
    try:
        await wait_ready(upstream + "/v1/models")
        for t in targets[1:]:
            await wait_ready(t.base.removesuffix("/v1") + "/health")
        if lite is not None:
            try:
                await wait_ready(lite_url + "/health/liveliness", timeout_s=180)
                targets.append(Target("litellm", lite_url + "/v1"))
            except RuntimeError as err:
                why_not = f"litellm proxy did not start: {err}"
        scale = 0.25 if args.quick else 1.0
        scenarios = [
            ("c1", 1, 400, False),
            ("c1-stream", 1, 200, True),
            ("c32", 32, 25, False),
            ("c32-stream", 32, 12, True),
        ]
        # Targets take turns in several rounds, so load from other processes on the machine
        # hits all of them alike.
        rounds = 4
        for label, clients, per, stream in scenarios:
            for _ in range(rounds):
                for t in targets:
                    n = max(2, int(per * scale * (0.4 if t.name == "litellm" else 1.0)) // rounds)
                    await run_clients(t, label, clients, n, stream)
        from harnessrl.benchmarks.sidecar.tokenin import measure_tokenin

        sizes = (args.tokenin_small, 16384)
        auth = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
        calls = max(10, int(args.tokenin_calls * scale))
        rows, through = await measure_tokenin(targets[0].base, targets[1].base, sizes, calls, auth)
        targets[1].ok += through  # counted in its store too
    finally:
        for p in [*procs, lite]:
            if p is not None:
                p.terminate()
        for p in [*procs, lite]:
            if p is not None:
                p.wait(timeout=30)
    from harnessrl.benchmarks.sidecar.tokenin import report_tokenin

    return report(targets, dbs, why_not, report_tokenin(rows))


def report(targets: list[Target], dbs: dict[str, str], why_not: str, tokenin: str = "") -> int:
    direct = targets[0]
    print(
        f"{'scenario':<11} {'target':<16} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    )
    for label in direct.lat:
        d50, d99 = pct(direct.lat[label], 0.5), pct(direct.lat[label], 0.99)
        for t in targets:
            v = t.lat[label]
            p50, p99 = pct(v, 0.5), pct(v, 0.99)
            print(
                f"{label:<11} {t.name:<16} {len(v):>5} {p50:>8.3f} {p99:>8.3f} {p50 - d50:>8.3f} {p99 - d99:>8.3f}"
            )
    lost = 0
    for client, db in dbs.items():
        stored = (
            sqlite3.connect(db)
            .execute("SELECT COUNT(*) FROM calls WHERE status = 200")
            .fetchone()[0]
        )
        sent = next(t.ok for t in targets if t.name == f"sidecar[{client}]")
        lost += max(0, sent - stored)
        print(f"sidecar[{client}]: {sent} responses received, {stored} calls stored")
    base = pct(direct.lat["c1"], 0.5)
    ours = {t.name: pct(t.lat["c1"], 0.5) - base for t in targets}
    fastest = min(("aiohttp", "httpx"), key=lambda c: ours[f"sidecar[{c}]"])
    print(
        f"upstream client: aiohttp +{ours['sidecar[aiohttp]']:.3f} ms, httpx "
        f"+{ours['sidecar[httpx]']:.3f} ms at p50 (one client); faster: {fastest}"
    )
    side = next(t for t in targets if t.name == "sidecar[aiohttp]")
    over50 = ours["sidecar[aiohttp]"]
    over99 = pct(side.lat["c1"], 0.99) - pct(direct.lat["c1"], 0.99)
    if "litellm" in ours:
        ratio = f"{ours['litellm'] / max(over50, 1e-3):.1f}"
    else:
        ratio = "na"
        print(f"litellm: not measured ({why_not})")
    print(
        f"sidecar: overhead_p50_ms={over50:.3f} overhead_p99_ms={over99:.3f} "
        f"litellm_overhead_ratio={ratio} lost={lost}" + (f" {tokenin}" if tokenin else "")
    )
    return 0 if lost == 0 else 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harnessrl.benchmarks.sidecar")
    parser.add_argument("--quick", action="store_true", help="a quarter of the calls")
    parser.add_argument(
        "--tokenin-calls", type=int, default=200, help="token-in rows: calls of each kind per size"
    )
    parser.add_argument(
        "--tokenin-small", type=int, default=1024, help="token-in rows: the short context's tokens"
    )
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return
    tmp = tempfile.mkdtemp(prefix="sidecar-bench-")
    try:
        import uvloop

        code = uvloop.run(measure(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(code)
