"""The sidecar benchmark's own pieces: its upstream speaks the vLLM dialect (completions echoing a
token-id prompt for token-in calls), the token-in rows run through a real sidecar, and the
report's last line has the agreed format and counts lost calls."""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import orjson

from harnessrl.benchmarks.sidecar import (
    API_KEY,
    COMPLETION,
    PROMPT_IDS,
    Target,
    long_chat,
    report,
    start_targets,
    upstream_bodies,
    wait_ready,
)
from harnessrl.benchmarks.sidecar.tokenin import (
    LABELS,
    TURNS,
    Row,
    chat_prompt_len,
    completions_body,
    measure_tokenin,
    report_tokenin,
)
from harnessrl.traces.parse import parse_response
from harnessrl.traces.schema import CallRecord, EndpointKind
from harnessrl.traces.sqlite import SQLiteTraceStore
from proxy_sidecar.capture import SSETee


def test_benchmark_upstream_is_capturable() -> None:
    full, sse = upstream_bodies()
    prompt, choices = parse_response(EndpointKind.CHAT, orjson.loads(full))
    assert list(prompt) == PROMPT_IDS and list(choices[0].token_ids) == COMPLETION
    tee = SSETee(EndpointKind.CHAT)
    assert tee.feed(sse) + tee.finish() == sse
    prompt, choices = parse_response(EndpointKind.CHAT, tee.assembler.body())
    assert list(prompt) == PROMPT_IDS and list(choices[0].token_ids) == COMPLETION


def test_report_line_and_lost_count(tmp_path: Any, capsys: Any) -> None:
    dbs = {}
    for client, stored in (("aiohttp", 3), ("httpx", 2)):
        dbs[client] = str(tmp_path / f"{client}.db")
        with SQLiteTraceStore(dbs[client]) as s:
            for _ in range(stored):
                s.add_call(
                    CallRecord(
                        "r", -1, 0.0, 0.0, EndpointKind.CHAT, {}, None, (), (), None, "u", 0.0, 200
                    )
                )
    lat = {"c1": [1.0, 1.0, 2.0]}
    targets = [
        Target("direct", "", ok=0, lat={"c1": [0.5, 0.5, 0.6]}),
        Target("sidecar[aiohttp]", "", ok=3, lat=lat),
        Target("sidecar[httpx]", "", ok=3, lat={"c1": [3.0, 3.0, 3.0]}),
    ]
    assert report(targets, dbs, "not installed") == 1  # httpx stored 2 of 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"sidecar: overhead_p50_ms=0\.500 overhead_p99_ms=1\.400 litellm_overhead_ratio=na lost=1",
        last,
    )


def test_benchmark_upstream_answers_token_in_and_long_context_calls() -> None:
    prompt_ids = list(range(5, 40))
    body = orjson.loads(completions_body({"prompt": prompt_ids}))
    prompt, choices = parse_response(EndpointKind.COMPLETIONS, body)
    assert list(prompt) == prompt_ids and list(choices[0].token_ids) == COMPLETION
    assert chat_prompt_len(b'{"model":"smol-p1500","messages":[]}') == 1500
    assert chat_prompt_len(b'{"model":"smol","messages":[]}') is None
    prompt, _ = parse_response(EndpointKind.CHAT, orjson.loads(long_chat(1500)))
    assert len(prompt) == 1500


def test_token_in_rows_run_through_a_real_sidecar_and_reach_the_last_line(
    tmp_path: Any, capsys: Any
) -> None:
    procs, targets, dbs = start_targets(str(tmp_path))
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}

    async def run() -> tuple[list[Row], int]:
        await wait_ready(targets[0].base + "/models")
        await wait_ready(targets[1].base.removesuffix("/v1") + "/health")
        return await measure_tokenin(targets[0].base, targets[1].base, (64,), 2, headers)

    try:
        rows, through = asyncio.run(run())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    # Three sidecar kinds; a warm-up conversation, then one whose first call is not measured.
    steps = 2 * (TURNS + 1)
    assert through == 3 * steps
    (row,) = rows
    assert {k: len(v) for k, v in row.lat.items()} == {label: 2 for label, _, _ in LABELS}
    with SQLiteTraceStore(dbs["aiohttp"]) as s:
        calls = {
            (conv, kind): s.calls(f"bench-64-{conv}-{kind}")
            for conv in (0, 1)
            for kind in ("chat", "responses", "messages")
        }
    assert {k: len(v) for k, v in calls.items()} == {k: TURNS + 1 for k in calls}
    for (_, kind), done in calls.items():  # chat calls carry no dialect
        assert {c.response.get("dialect") for c in done if c.response} == {
            None if kind == "chat" else kind
        }
    for kind in ("responses", "messages"):
        token_in = calls[1, kind]
        assert all(c.endpoint == EndpointKind.COMPLETIONS for c in token_in)
        # The upstream echoes the prompt: the sidecar rendered, incrementally, the ids the direct
        # calls sent (the benchmark renders them from scratch) for the two measured calls.
        assert [list(c.prompt_token_ids) for c in token_in[1:3]] == row.prompts
        # Each call's history grows by the sidecar's function call and its output; each prompt
        # extends the last one's prompt and sampled ids, which are spliced in, never re-rendered.
        for k, (last, call) in enumerate(itertools.pairwise(token_in)):
            head = (*last.prompt_token_ids, *COMPLETION)
            assert call.prompt_token_ids[: len(head)] == head
            assert call.response["token_in"] == {"reused_turns": k + 1, "rendered_turns": 0}
    fields = report_tokenin(rows)
    table = capsys.readouterr().out
    assert "sidecar responses" in table and "sidecar messages" in table
    number = r"-?\d+\.\d+"
    assert re.fullmatch(
        rf"tokenin_p50_ms_64={number} tokenin_p99_ms_64={number} messages_p50_ms_64={number} "
        rf"passthrough_p50_ms_64={number} passthrough_p99_ms_64={number} "
        rf"tokenin_ratio_64={number}",
        fields,
    )
    lat = {"c1": [1.0, 1.0, 2.0]}
    targets = [
        Target("direct", "", ok=0, lat={"c1": [0.5, 0.5, 0.6]}),
        Target("sidecar[aiohttp]", "", ok=sum(map(len, calls.values())), lat=lat),
        Target("sidecar[httpx]", "", ok=0, lat=lat),
    ]
    assert report(targets, dbs, "not installed", fields) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("lost=0 " + fields)
