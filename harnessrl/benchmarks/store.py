"""Benchmark: how many captured calls per second a trace store commits, SQLite beside PostgreSQL.

The sidecar commits calls in groups (one transaction per event-loop turn), so each store is
measured at group sizes 1 and 32 with calls shaped like an agent's: a prompt of `--prompt-tokens`
ids, `--completion-tokens` sampled ids with their logprobs, and the request and response bodies
their text would make. Several writer threads (one store each, as several sidecars sharing one
database) commit at once. PostgreSQL is measured when `--postgres DSN` names a database (the
benchmark creates its tables there, under a fresh store). Last line:
`store: sqlite_calls_s_g1=... sqlite_calls_s_g32=... postgres_calls_s_g1=... ... mb_per_call=...`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from harnessrl.traces import open_store
from harnessrl.traces.schema import CallRecord, Choice, EndpointKind, RolloutRecord

GROUPS = (1, 32)


def make_call(
    rng: np.random.Generator, rollout_id: str, prompt: int, completion: int
) -> CallRecord:
    prompt_ids = tuple(rng.integers(3, 49152, prompt).tolist())
    ids = tuple(rng.integers(3, 49152, completion).tolist())
    text = "x" * (4 * completion)  # about 4 characters per token, as the response carries them
    request = {"messages": [{"role": "user", "content": "y" * (4 * prompt)}], "max_tokens": 512}
    response = {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}
    choice = Choice(0, ids, tuple((-rng.random(completion)).tolist()), "stop", text)
    now = time.time()
    return CallRecord(
        rollout_id, 0, now, now, EndpointKind.CHAT, request, response, prompt_ids, (choice,),
        0, "bench", 1.0, 200,
    )  # fmt: skip


def record_bytes(call: CallRecord) -> int:
    """What one call weighs as JSON text: the scale of what a store writes per call."""
    choice = call.choices[0]
    parts = (call.request, call.response, call.prompt_token_ids, choice.token_ids, choice.logprobs)
    return sum(len(json.dumps(p)) for p in parts)


def measure(url: str, calls: list[CallRecord], group: int, writers: int, seconds: float) -> float:
    """Calls per second committed by `writers` threads, each with its own store and rollouts."""
    done = [0] * writers
    errors: list[BaseException] = []

    # Opened one after another: two connections turning a new SQLite file to WAL at once can
    # find it locked without waiting, which is a race of the setup, not of the writes measured.
    stores = [open_store(url) for _ in range(writers)]
    stop = time.monotonic() + seconds

    def write(i: int) -> None:
        store = stores[i]
        try:
            rollout = f"bench-{uuid.uuid4().hex[:12]}"
            store.create_rollout(RolloutRecord(rollout, "task", "group"))
            batch = [CallRecord(**{**c.__dict__, "rollout_id": rollout}) for c in calls[:group]]
            while time.monotonic() < stop:
                store.add_calls(batch)
                done[i] += len(batch)
        except BaseException as err:  # reported by the main thread
            errors.append(err)
        finally:
            store.close()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harnessrl.benchmarks.store", description=__doc__)
    ap.add_argument("--postgres", default="", help="postgresql://... database to measure too")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--completion-tokens", type=int, default=256)
    ap.add_argument("--writers", type=int, default=4, help="threads committing at once")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 1 or args.completion_tokens < 1 or args.writers < 1:
        ap.error("--prompt-tokens, --completion-tokens and --writers must be >= 1")

    rng = np.random.default_rng(0)
    calls = [
        make_call(rng, "template", args.prompt_tokens, args.completion_tokens)
        for _ in range(max(GROUPS))
    ]
    mb = record_bytes(calls[0]) / 1e6
    stores = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores["sqlite"] = f"sqlite:///{Path(tmp) / 'bench.db'}"
        if args.postgres:
            stores["postgres"] = args.postgres
        out: dict[str, str] = {}
        for name, url in stores.items():
            for group in GROUPS:
                rate = measure(url, calls, group, args.writers, args.seconds)
                print(f"{name:8s} group={group:2d} writers={args.writers}: {rate:9.1f} calls/s, "
                      f"{rate * mb:7.1f} MB/s")  # fmt: skip
                out[f"{name}_calls_s_g{group}"] = f"{rate:.1f}"
    if not args.postgres:
        out.update({f"postgres_calls_s_g{g}": "na" for g in GROUPS})
    fields = " ".join(f"{k}={v}" for k, v in out.items())
    print(f"store: {fields} mb_per_call={mb:.3f} writers={args.writers}")


if __name__ == "__main__":
    main()
