"""The sidecar benchmark's own pieces: its upstream speaks the vLLM dialect, and the report's last
line has the agreed format and counts lost calls."""

from __future__ import annotations

import re
from typing import Any

import orjson

from harnessrl.benchmarks.sidecar import COMPLETION, PROMPT_IDS, Target, report, upstream_bodies
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
