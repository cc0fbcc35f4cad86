"""The sidecar benchmark's own pieces: its upstream speaks the vLLM dialect (completions echoing a
token-id prompt for token-in calls), the token-in rows run through a real sidecar, the LiteLLM
proxy it compares with starts from the dev extra, a peer that cannot start stops it with its
output, overheads are percentiles of per-request paired differences, and the report's last line
has the agreed format and counts lost calls."""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from harnessrl.benchmarks.sidecar import (
    API_KEY,
    COMPLETION,
    PROMPT_IDS,
    Peer,
    PeerFailed,
    Target,
    free_port,
    long_chat,
    paired_overhead,
    pct,
    report,
    run_paired,
    spawn,
    start_litellm,
    start_targets,
    upstream_bodies,
    wait_ready,
    wait_targets,
)
from harnessrl.benchmarks.sidecar.tokenin import (
    LABELS,
    TURNS,
    Row,
    added,
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


# Request i of each list is the same request: every pair's overhead is positive but one, where
# the direct call stalled. The tail of the pairs is 10 ms; the difference of the two p99s is 1 ms.
DIRECT = [1.0, 1.0, 1.0, 1.0, 10.0]
THROUGH = [11.0, 2.0, 2.0, 2.0, 2.0]


def test_overheads_are_percentiles_of_paired_differences() -> None:
    assert pct(THROUGH, 0.99) - pct(DIRECT, 0.99) == 1.0  # what a difference of percentiles says
    assert paired_overhead(THROUGH, DIRECT, 0.99) == 10.0
    assert paired_overhead(THROUGH, DIRECT, 0.5) == 1.0
    # Shuffling one side breaks the pairs, and changes the answer: the order is the pairing.
    assert paired_overhead(THROUGH[::-1], DIRECT, 0.99) != 10.0
    row = Row(1024, lat={"direct completions": DIRECT, "sidecar responses": THROUGH})
    assert added(row, "sidecar responses", 0.99) == 10.0
    with pytest.raises(ValueError, match="4 through and 5 direct"):
        paired_overhead(THROUGH[:4], DIRECT, 0.5)


def write_calls(tmp_path: Any, stored: dict[str, int]) -> dict[str, str]:
    dbs = {}
    for client, n in stored.items():
        dbs[client] = str(tmp_path / f"{client}.db")
        with SQLiteTraceStore(dbs[client]) as s:
            for _ in range(n):
                s.add_call(
                    CallRecord(
                        "r", -1, 0.0, 0.0, EndpointKind.CHAT, {}, None, (), (), None, "u", 0.0, 200
                    )
                )
    return dbs


def test_report_line_and_lost_count(tmp_path: Any, capsys: Any) -> None:
    dbs = write_calls(tmp_path, {"aiohttp": 3, "httpx": 2})
    targets = [
        Target("direct", "", ok=0, lat={"c1": DIRECT}),
        Target("sidecar[aiohttp]", "", ok=3, lat={"c1": THROUGH}),
        Target("sidecar[httpx]", "", ok=3, lat={"c1": [3.0] * 5}),
        Target("litellm", "", ok=0, lat={"c1": [d + 4.0 for d in DIRECT]}),
    ]
    assert report(targets, dbs) == 1  # httpx stored 2 of 3
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(
        r"sidecar: overhead_p50_ms=1\.000 overhead_p99_ms=10\.000 litellm_overhead_ratio=4\.0 lost=1",
        out[-1],
    ), out[-1]
    # The table's added columns are paired too: httpx's pairs are 2 ms but one, -7 (the stall).
    (httpx_row,) = [line for line in out if line.startswith("c1 ") and "sidecar[httpx]" in line]
    assert httpx_row.split()[-2:] == ["2.000", "2.000"]


def test_report_needs_the_litellm_comparison(tmp_path: Any) -> None:
    """No `litellm_overhead_ratio=na`: a run without its one peer comparison is not reported."""
    dbs = write_calls(tmp_path, {"aiohttp": 0, "httpx": 0})
    targets = [Target(n, "", lat={"c1": DIRECT}) for n in ("direct", "sidecar[aiohttp]")]
    targets.append(Target("sidecar[httpx]", "", lat={"c1": DIRECT}))
    with pytest.raises(ValueError, match="LiteLLM"):
        report(targets, dbs)


def test_a_peer_that_exits_raises_with_its_output_and_is_reaped(tmp_path: Any) -> None:
    crash = "import sys; print('starting'); sys.exit(\"ModuleNotFoundError: No module named 'x'\")"
    peer = spawn("litellm", [sys.executable, "-c", crash], str(tmp_path))
    url = f"http://127.0.0.1:{free_port()}/health/liveliness"
    with pytest.raises(PeerFailed, match="litellm exited with status 1") as err:
        asyncio.run(wait_ready(url, peer, timeout_s=60))
    assert "starting" in str(err.value) and "No module named 'x'" in str(err.value)
    assert peer.proc.returncode == 1  # reaped: no defunct process left behind


def test_a_peer_that_never_answers_raises_with_its_output(tmp_path: Any) -> None:
    hang = "import time; print('listening elsewhere', flush=True); time.sleep(60)"
    peer = spawn("sidecar[aiohttp]", [sys.executable, "-c", hang], str(tmp_path))
    try:
        with pytest.raises(PeerFailed, match="did not answer") as err:
            asyncio.run(wait_ready(f"http://127.0.0.1:{free_port()}/health", peer, timeout_s=3))
        assert "listening elsewhere" in str(err.value)
    finally:
        peer.stop()
    assert peer.proc.returncode is not None


@pytest.fixture(scope="module")
def running(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[Target], dict[str, str], str]]:
    """The benchmark's upstream and both sidecars, up; yields the targets, the stores and a
    folder for more processes' logs."""
    tmp = str(tmp_path_factory.mktemp("sidecar-bench"))
    peers, targets, dbs = start_targets(tmp)
    try:
        asyncio.run(wait_targets(peers))
        yield targets, dbs, tmp
    finally:
        for p in peers:
            p.stop()


def test_paired_runs_send_every_request_through_every_target(
    running: tuple[list[Target], dict[str, str], str],
) -> None:
    targets = [Target(t.name, t.base) for t in running[0]]
    asyncio.run(run_paired(targets, "c2", 2, 3, stream=False))
    asyncio.run(run_paired(targets, "c1-stream", 1, 2, stream=True))
    assert {t.name: len(t.lat["c2"]) for t in targets} == {t.name: 6 for t in targets}
    assert {t.name: len(t.lat["c1-stream"]) for t in targets} == {t.name: 2 for t in targets}
    assert {t.ok for t in targets} == {5 + 6 + 5 + 2}  # each run's 5 warm-up pairs included
    assert all(v > 0 for t in targets for v in t.lat["c2"])


def test_the_litellm_proxy_starts_and_answers_through_the_upstream(
    running: tuple[list[Target], dict[str, str], str],
) -> None:
    """The one peer comparison runs: the proxy starts with what the dev extra installs and
    forwards to the benchmark's upstream."""
    targets, _, tmp = running
    upstream = targets[0].base.removesuffix("/v1")
    lite: Peer = start_litellm(upstream, tmp)
    try:
        asyncio.run(wait_ready(lite.url + "/health/liveliness", lite, timeout_s=180))
        target = Target("litellm", lite.url + "/v1")
        asyncio.run(run_paired([targets[0], target], "c1", 1, 2, stream=False))
    finally:
        lite.stop()
    assert target.ok == 5 + 2 and len(target.lat["c1"]) == 2


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
    running: tuple[list[Target], dict[str, str], str], capsys: Any
) -> None:
    targets, dbs, _ = running
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    run = measure_tokenin(targets[0].base, targets[1].base, (64,), 2, headers)
    rows, through = asyncio.run(run)
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
        Target("litellm", "", ok=0, lat=lat),
    ]
    assert report(targets, dbs, fields) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("lost=0 " + fields)
