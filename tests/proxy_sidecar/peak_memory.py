"""Peak memory of `python -m proxy_sidecar` at its default limits, under loopback load.

Run: `python tests/proxy_sidecar/peak_memory.py` (about a minute; everything on 127.0.0.1). It starts
the load tests' upstream and a sidecar, then sends, each phase at once: small calls from 256
clients; bodies of one long message (1-16 MiB); bodies of many short messages (the parsed form
of such a body is several times its bytes). It prints the sidecar's resident set (VmRSS at start,
VmHWM after each phase) and its last line is
`peak_memory: start_mib=.. small_mib=.. text_mib=.. messages_mib=.. refusals=..`.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import sys
import tempfile

import aiohttp
import orjson

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "fixtures" / "vllm"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from sidecar_proc import start_sidecar, start_upstream, stop

MIB = 1 << 20


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def text_body(size: int, k: int) -> bytes:
    msg = {"role": "user", "content": f"{k} " + "x" * size}
    return orjson.dumps({"model": "smol", "messages": [msg], "max_tokens": 2})


def messages_body(size: int, k: int) -> bytes:
    one = len(orjson.dumps({"role": "user", "content": "hi"})) + 1
    msgs = [{"role": "user", "content": "hi"} for _ in range(size // one)]
    msgs.append({"role": "user", "content": str(k)})
    return orjson.dumps({"model": "smol", "messages": msgs, "max_tokens": 2})


async def send(session: aiohttp.ClientSession, url: str, body: bytes, tries: int = 20) -> int:
    """POST until served (a 503 past the body budget is retried, as OpenAI clients do)."""
    for _ in range(tries):
        async with session.post(url + "/v1/chat/completions", data=body) as r:
            await r.read()
            if r.status != 503:
                return r.status
        await asyncio.sleep(0.2)
    return 503


async def phase(url: str, bodies: list[bytes], concurrency: int) -> list[int]:
    timeout = aiohttp.ClientTimeout(total=300)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        return await asyncio.gather(*(send(session, url, b) for b in bodies))


def main() -> None:
    rng = random.Random(0)
    up, up_url = start_upstream(distinct=True)
    with tempfile.TemporaryDirectory() as tmp:
        sc, url = start_sidecar(up_url, pathlib.Path(tmp) / "mem.db")
        try:
            figures = {"start_mib": status_kib(sc.pid, "VmRSS") / 1024}
            small = [text_body(200, k) for k in range(256 * 8)]
            text = [text_body(rng.randrange(MIB, 16 * MIB - 1024), k) for k in range(24)]
            many = [messages_body(rng.randrange(MIB, 16 * MIB - 1024), k) for k in range(24)]
            for name, bodies, concurrency in (
                ("small", small, 256),
                ("text", text, 8),
                ("messages", many, 8),
            ):
                statuses = asyncio.run(phase(url, bodies, concurrency))
                assert set(statuses) == {200}, sorted(set(statuses))
                figures[f"{name}_mib"] = status_kib(sc.pid, "VmHWM") / 1024
                print(f"after {name}: peak {figures[f'{name}_mib']:.0f} MiB", flush=True)
            metrics = asyncio.run(_metrics(url))
        finally:
            stop(sc)
            stop(up)
    line = " ".join(f"{k}={v:.0f}" for k, v in figures.items())
    print(f"peak_memory: {line} refusals={metrics}")


async def _metrics(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    line = next(x for x in text.splitlines() if x.startswith("sidecar_budget_refusals_total"))
    return int(float(line.split()[1]))


if __name__ == "__main__":
    main()
