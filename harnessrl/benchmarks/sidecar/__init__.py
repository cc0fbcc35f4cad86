"""Sidecar latency benchmark: direct vs through the sidecar (aiohttp and httpx upstream clients) vs
through the LiteLLM proxy, against one local vLLM-dialect upstream, in the same run.

`python -m harnessrl.benchmarks.sidecar [--quick]`. Prints a table per scenario (1 and 32
concurrent clients, non-streaming and streaming) and ends with
`sidecar: overhead_p50_ms=.. overhead_p99_ms=.. litellm_overhead_ratio=.. lost=..`. Every request
is sent through every path in turn (direct, each sidecar, LiteLLM; the order rotating), so each
path's added latency is per request: that request through it minus the same request direct, and
the overheads are percentiles of those paired differences (one client, non-streaming, capture and
durable SQLite storage on; p50 and p99). The ratio is LiteLLM's added p50 over ours. `lost` counts
200 responses through a sidecar whose call is missing from its store. The LiteLLM proxy comes
with the dev extra; a peer that cannot start stops the benchmark with its output.

Token-in rows follow (tokenin.py): an agent loop's growing conversation at about 1k and
16k tokens (each call adds the function call the sidecar answered and its output) as Responses and
Messages calls, which the sidecar renders and tokenizes itself, beside pass-through chat calls of
the same conversation, one client, non-streaming. The last line adds, per context size (`_1k`,
`_16k`),
`tokenin_p50_ms` / `tokenin_p99_ms` (Responses through the sidecar minus the upstream's
completions on the same token-id prompt), `messages_p50_ms`, `passthrough_p50_ms` /
`passthrough_p99_ms` (chat through the sidecar minus chat direct) and `tokenin_ratio` (the p50s'
ratio), each a percentile of the per-call differences at the same conversation step.
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


@dataclass
class Peer:
    """A process the benchmark started, its stdout and stderr kept in `log`."""

    name: str
    proc: subprocess.Popen[bytes]
    log: str
    url: str = ""  # where it listens

    def output(self, limit: int = 6000) -> str:
        with open(self.log, "rb") as f:
            return f.read().decode(errors="replace")[-limit:]

    def failed(self, why: str) -> PeerFailed:
        return PeerFailed(f"{self.name} {why}; its output:\n{self.output()}")

    def stop(self) -> None:
        """Terminates it if it still runs and reaps it either way."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class PeerFailed(RuntimeError):
    """A server the benchmark needs did not come up; the message carries its output."""


def spawn(
    name: str, args: list[str], logs: str, url: str = "", env: dict[str, str] | None = None
) -> Peer:
    log = os.path.join(logs, f"{name}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    return Peer(name, proc, log, url)


async def wait_ready(url: str, peer: Peer | None = None, timeout_s: float = 120.0) -> None:
    """Until `url` answers below 500. A `peer` that exits first (it is reaped) or is still not
    answering at the deadline raises `PeerFailed` with its output."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if peer is not None and (code := peer.proc.poll()) is not None:
                raise peer.failed(f"exited with status {code} before answering {url}")
            try:
                async with session.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    if peer is not None:
        raise peer.failed(f"did not answer {url} in {timeout_s:.0f} s")
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


@dataclass
class Target:
    name: str
    base: str  # .../v1
    ok: int = 0
    # Per scenario, each request's latency (ms) in the order sent; the same index on every target
    # of a run is the same request (`run_paired`).
    lat: dict[str, list[float]] = field(default_factory=dict)


async def run_paired(
    targets: list[Target], label: str, clients: int, per_client: int, stream: bool
) -> None:
    """`clients` concurrent clients, each sending `per_client` requests, every request through
    every target in turn (the order rotating request by request, so neither position favours a
    target); request i's latencies are appended to every target's `lat[label]` together."""
    body = orjson.dumps(
        {
            "model": "smol",
            "messages": [{"role": "user", "content": "Count to 3."}],
            "max_tokens": 16,
            "stream": stream,
        }
    )
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    samples: list[dict[str, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(target: Target) -> float:
            t0 = time.perf_counter()
            url = target.base + "/chat/completions"
            async with session.post(url, data=body, headers=headers) as r:
                async for _ in r.content.iter_any():
                    pass
                if r.status != 200:
                    raise RuntimeError(f"{target.name}: HTTP {r.status}")
            target.ok += 1
            return (time.perf_counter() - t0) * 1000

        async def paired(k: int) -> dict[str, float]:
            shift = k % len(targets)
            return {t.name: await one(t) for t in targets[shift:] + targets[:shift]}

        async def worker(first: int) -> None:
            for k in range(first, first + per_client):
                samples.append(await paired(k))

        for k in range(5):  # warm-up: connections, caches
            await paired(k)
        await asyncio.gather(*(worker(c) for c in range(clients)))
    for t in targets:
        t.lat.setdefault(label, []).extend(s[t.name] for s in samples)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def paired_overhead(through: list[float], direct: list[float], q: float) -> float:
    """The q-quantile of the per-request differences `through[i] - direct[i]` (request i sent
    both ways in the same run). Not the difference of the two quantiles, which can be negative
    when the direct calls' own tail happens to be slower."""
    if len(through) != len(direct) or not direct:
        raise ValueError(
            f"paired latencies need the same requests both ways, got {len(through)} through and "
            f"{len(direct)} direct"
        )
    return pct([a - b for a, b in zip(through, direct, strict=True)], q)


def start_litellm(upstream: str, tmp: str) -> Peer:
    exe = shutil.which("litellm", path=os.path.dirname(sys.executable))
    if exe is None:
        raise PeerFailed(
            "the LiteLLM proxy, the benchmark's peer, is not installed here: it comes with the dev "
            "extra (pip install -e '.[dev]')"
        )
    cfg = os.path.join(tmp, "litellm.yaml")
    with open(cfg, "w") as f:
        f.write(
            "model_list:\n  - model_name: smol\n    litellm_params:\n"
            f"      model: openai/smol\n      api_base: {upstream}/v1\n      api_key: x\n"
        )
    port = free_port()
    args = [exe, "--config", cfg, "--port", str(port), "--host", "127.0.0.1"]
    env = {
        "LITELLM_LOG": "ERROR",
        "DISABLE_ADMIN_UI": "True",
        "LITELLM_MASTER_KEY": API_KEY,
        # Its model cost map from the installed package, not fetched over the network at start.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    args += ["--num_workers", "1", "--telemetry", "False"]
    return spawn("litellm", args, tmp, f"http://127.0.0.1:{port}", env)


def start_targets(tmp: str) -> tuple[list[Peer], list[Target], dict[str, str]]:
    """The upstream and one sidecar per upstream client library, as processes."""
    up_port = free_port()
    module = "harnessrl.benchmarks.sidecar"
    upstream = f"http://127.0.0.1:{up_port}"
    args = [sys.executable, "-m", module, "--serve-upstream", str(up_port)]
    peers = [spawn("upstream", args, tmp, upstream)]
    targets = [Target("direct", upstream + "/v1")]
    dbs = {}
    for client in ("aiohttp", "httpx"):
        port = free_port()
        dbs[client] = os.path.join(tmp, f"{client}.db")
        args = ["--upstream", upstream, "--store", f"sqlite:///{dbs[client]}", "--port", str(port)]
        args += ["--client", client, "--tokenizer", "smollm2"]
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "proxy_sidecar", *args]
        peers.append(spawn(f"sidecar[{client}]", command, tmp, url))
        targets.append(Target(f"sidecar[{client}]", url + "/v1"))
    return peers, targets, dbs


async def wait_targets(peers: list[Peer]) -> None:
    """The upstream's `/v1/models`, then each sidecar's `/health` (as `start_targets` made them)."""
    await wait_ready(peers[0].url + "/v1/models", peers[0])
    for peer in peers[1:]:
        await wait_ready(peer.url + "/health", peer)


async def measure(args: argparse.Namespace, tmp: str) -> int:
    peers, targets, dbs = start_targets(tmp)
    upstream = targets[0].base.removesuffix("/v1")
    try:
        lite = start_litellm(upstream, tmp)
        peers.append(lite)
        await wait_targets(peers[:-1])
        await wait_ready(lite.url + "/health/liveliness", lite, timeout_s=180)
        targets.append(Target("litellm", lite.url + "/v1"))
        scale = 0.25 if args.quick else 1.0
        scenarios = [
            ("c1", 1, 400, False),
            ("c1-stream", 1, 200, True),
            ("c32", 32, 25, False),
            ("c32-stream", 32, 12, True),
        ]
        for label, clients, per, stream in scenarios:
            await run_paired(targets, label, clients, max(2, int(per * scale)), stream)
        from harnessrl.benchmarks.sidecar.tokenin import measure_tokenin

        sizes = (args.tokenin_small, 16384)
        auth = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
        calls = max(10, int(args.tokenin_calls * scale))
        rows, through = await measure_tokenin(targets[0].base, targets[1].base, sizes, calls, auth)
        targets[1].ok += through  # counted in its store too
    finally:
        for p in peers:
            p.stop()
    from harnessrl.benchmarks.sidecar.tokenin import report_tokenin

    return report(targets, dbs, report_tokenin(rows))


def report(targets: list[Target], dbs: dict[str, str], tokenin: str = "") -> int:
    """Prints the table and the last line; `targets` are direct, both sidecars and LiteLLM."""
    direct = targets[0]
    by_name = {t.name: t for t in targets}
    if "litellm" not in by_name:
        raise ValueError(f"the report needs the LiteLLM target, got {sorted(by_name)}")
    print(
        f"{'scenario':<11} {'target':<16} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    )
    for label in direct.lat:
        for t in targets:
            v = t.lat[label]
            plus = f"{'':>8} {'':>8}"
            if t is not direct:
                plus = " ".join(
                    f"{paired_overhead(v, direct.lat[label], q):>8.3f}" for q in (0.5, 0.99)
                )
            print(
                f"{label:<11} {t.name:<16} {len(v):>5} {pct(v, 0.5):>8.3f} {pct(v, 0.99):>8.3f} {plus}"
            )
    print("(+p50, +p99: percentiles of each request's latency minus the same request's direct)")
    lost = 0
    for client, db in dbs.items():
        stored = (
            sqlite3.connect(db)
            .execute("SELECT COUNT(*) FROM calls WHERE status = 200")
            .fetchone()[0]
        )
        sent = by_name[f"sidecar[{client}]"].ok
        lost += max(0, sent - stored)
        print(f"sidecar[{client}]: {sent} responses received, {stored} calls stored")

    def added(name: str, q: float) -> float:
        return paired_overhead(by_name[name].lat["c1"], direct.lat["c1"], q)

    ours = {c: added(f"sidecar[{c}]", 0.5) for c in ("aiohttp", "httpx")}
    fastest = min(ours, key=lambda c: ours[c])
    print(
        f"upstream client: aiohttp +{ours['aiohttp']:.3f} ms, httpx +{ours['httpx']:.3f} ms at p50 "
        f"(one client); faster: {fastest}"
    )
    over50, over99 = ours["aiohttp"], added("sidecar[aiohttp]", 0.99)
    ratio = added("litellm", 0.5) / max(over50, 1e-3)
    print(
        f"sidecar: overhead_p50_ms={over50:.3f} overhead_p99_ms={over99:.3f} "
        f"litellm_overhead_ratio={ratio:.1f} lost={lost}" + (f" {tokenin}" if tokenin else "")
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
    except PeerFailed as err:
        sys.exit(f"sidecar benchmark: {err}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(code)
