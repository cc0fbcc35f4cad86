"""The viewer's HTTP side without a browser: bad input, missing and corrupt stores, the token, the
escaping of every page, pagination, PostgreSQL, and how fast a long rollout renders."""

from __future__ import annotations

import dataclasses
import html
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from synthetic import EVIL, call, long_rollout, planted_break

from harnessrl.traces import open_store
from harnessrl.traces.schema import RolloutRecord
from harnessrl.view.__main__ import parse_args
from harnessrl.view.app import build_app, data_config
from harnessrl.view.config import ViewConfig
from harnessrl.view.svg import Series, charts, line_chart

ROOT = Path(__file__).resolve().parents[2]


def _client(url: str, **cfg: Any) -> TestClient:
    return TestClient(build_app(ViewConfig(store=url, **cfg)), follow_redirects=False)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    with open_store(url) as store:
        planted_break(store, "planted")
        rid = "s0-ab-g0-r0"
        store.create_rollout(RolloutRecord(rid, EVIL, "s0-ab-g0", info={"note": EVIL}))
        store.transition(rid, "running")
        store.add_calls(
            [
                call(rid, [1, 2, 3], [4, 5], [{"role": "user", "content": EVIL}], EVIL),
                call(rid, [1, 2, 3, 4, 5, 6], [7], [{"role": EVIL, "content": [{"x": EVIL}]}], ""),
            ]
        )
        store.transition(rid, "failed", info={"error": EVIL})
    return url


def test_nothing_from_a_trace_reaches_a_page_as_markup(store_url: str) -> None:
    client = _client(store_url)
    rid = "s0-ab-g0-r0"
    pages = ["/", f"/rollouts/{rid}", f"/rollouts/{rid}/sequences", "/groups/s0-ab-g0",
             f"/rollouts/{rid}/calls/0/tokens", f"/rollouts/{rid}/calls/1/prompt",
             f"/?task={EVIL}", f"/groups/{EVIL}", f"/rollouts/{EVIL}"]  # fmt: skip
    for path in pages:
        reply = client.get(path)
        assert reply.status_code in (200, 404), path
        for markup in ("<script>window", "<img", '<a href="javascript', "</textarea>"):
            assert markup not in reply.text, (path, markup)
        assert "script-src 'self'" in reply.headers["content-security-policy"]
        assert reply.headers["x-content-type-options"] == "nosniff"
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in client.get(f"/rollouts/{rid}").text


def test_query_parameters_are_validated(store_url: str) -> None:
    client = _client(store_url)
    for query, says in [
        ("step=x", "step must be an integer"),
        ("step=-1", "step must be in [0,"),
        ("page=0", "page must be in [1,"),
        ("state=done", "state must be one of queued, running"),
        ("phase=both", "phase must be one of train, eval"),
        ("colour=red", "unknown query parameter 'colour'"),
        ("step=1&step=2", "'step' is given twice"),
        ("task=" + "a" * 300, "task is longer than 256"),
    ]:
        reply = client.get("/?" + query)
        assert reply.status_code == 400, query
        assert says in html.unescape(reply.text), (query, reply.text)
    assert client.get("/rollouts/planted?x=1").status_code == 400
    assert client.get("/?step=&task=").status_code == 200  # empty fields of the form: no filter


def test_a_harness_that_rewrites_its_history_shows_the_latest_messages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    with open_store(url) as store:
        store.create_rollout(RolloutRecord("r", "t", "g"))
        for k in range(2):
            msgs = [{"role": "user", "content": f"turn {k}-{i}"} for i in range(100)]
            store.add_calls([call("r", [1, 2], [3], msgs, "a")])
    page = _client(url).get("/rollouts/r").text
    assert "60 more new messages before these" in page  # call 0: its last 40 are shown
    assert "turn 0-99" in page and "turn 0-59" not in page and "turn 0-60" in page
    assert page.count("more new messages") == 2  # call 1 repeats nothing of call 0


def test_unknown_ids_get_404_pages(store_url: str) -> None:
    client = _client(store_url)
    for path, says in [
        ("/rollouts/nope", "unknown rollout 'nope'"),
        ("/rollouts/nope/sequences", "unknown rollout 'nope'"),
        ("/rollouts/planted/calls/9/tokens", "rollout 'planted' has no call 9"),
        ("/rollouts/planted/calls/x/tokens", "no page at"),
        ("/groups/nope", "no rollouts in group 'nope'"),
        ("/nothing/here", "no page at /nothing/here"),
    ]:
        reply = client.get(path)
        assert reply.status_code == 404, path
        assert says in html.unescape(reply.text) and 'id="error"' in reply.text, path


def test_rollout_filters_and_pages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'many.db'}"
    with open_store(url) as store:
        for i in range(120):
            step = i // 40
            rec = RolloutRecord(f"s{step}-n-g{i % 4}-r{i}", f"task-{i % 3}", f"s{step}-n-g{i % 4}",
                                created_at=1000.0 + i)  # fmt: skip
            store.create_rollout(rec)
        store.create_rollout(RolloutRecord("e1-n-g0-r0", "task-0", "e1-n-g0", created_at=2000.0))
    client = _client(url, page_size=50)
    first = client.get("/").text
    assert "121 rollouts · page 1 of 3" in first and 'rel="next"' in first
    last = client.get("/?page=3").text
    assert len(re.findall(r'<tr class="state-', last)) == 21 and 'rel="prev"' in last
    assert 'href="?page=2"' in last
    assert "40 rollouts" in client.get("/?step=2&phase=train").text
    assert "41 rollouts" in client.get("/?step=1").text  # train step 1 and the eval after it
    assert "1 rollouts" in client.get("/?step=1&phase=eval").text
    assert "0 rollouts" in client.get("/?step=0&phase=train").text
    assert "40 rollouts" in client.get("/?task=task-1").text
    assert "10 rollouts" in client.get("/?group=s0-n-g1").text
    assert "121 rollouts" in client.get("/?state=queued").text
    narrowed = client.get("/?task=task-1&page=2").text
    assert 'href="?task=task-1&amp;page=1"' in narrowed  # pages keep the filters


def test_a_missing_or_corrupt_store_is_a_clear_message(tmp_path: Path) -> None:
    def view(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "harnessrl.view", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    missing = view(f"sqlite:///{tmp_path / 'none.db'}", "--port", "8799")
    assert missing.returncode == 2
    assert "no trace store at" in missing.stderr and "does not exist" in missing.stderr
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 1000)
    corrupt = view(f"sqlite:///{bad}", "--port", "8799")
    assert corrupt.returncode == 2 and "not a readable SQLite trace store" in corrupt.stderr
    nothing = view("--port", "8799")
    assert nothing.returncode == 2 and "no store: give a store URL" in nothing.stderr
    wrong = view("mysql://x/y", "--port", "8799")
    assert wrong.returncode == 2 and "is not supported" in wrong.stderr


def test_a_store_that_breaks_while_it_is_served_gives_503(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with open_store(f"sqlite:///{path}") as store:
        planted_break(store, "p")
    client = _client(f"sqlite:///{path}")
    assert client.get("/").status_code == 200
    writer = sqlite3.connect(path)  # someone else's hand on the file: the tables are gone
    writer.execute("DROP TABLE calls")
    writer.commit()
    writer.close()
    reply = client.get("/")
    assert reply.status_code == 503
    assert "the trace store cannot be read" in reply.text


def test_token_gate(store_url: str) -> None:
    with pytest.raises(ValueError, match="set a token"):
        ViewConfig(store=store_url, host="0.0.0.0")
    client = _client(store_url, host="0.0.0.0", token="s3cret")
    denied = client.get("/")
    assert denied.status_code == 401 and "token required" in denied.text
    assert client.get("/", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/?token=wrong").status_code == 401
    entry = client.get("/?token=s3cret&step=1")
    assert entry.status_code == 303 and entry.headers["location"] == "/?step=1"
    assert "httponly" in entry.headers["set-cookie"].lower()
    assert client.get("/?step=1").status_code == 200  # the cookie from here on


def test_a_200_call_64k_token_rollout_renders_in_under_a_second(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'long.db'}"
    with open_store(url) as store:
        long_rollout(store, "long", calls=200, tokens=64_000)
    client = _client(url)
    timings, walls = {}, {}
    for path in ("/rollouts/long", "/rollouts/long/sequences"):
        # CPU seconds of this process (the app runs in it): what a render costs on an idle
        # core, however many other jobs share the machine; the best of three.
        best, wall = float("inf"), float("inf")
        for _ in range(3):
            c0, t0 = time.process_time(), time.perf_counter()
            reply = client.get(path)
            best = min(best, time.process_time() - c0)
            wall = min(wall, time.perf_counter() - t0)
            assert reply.status_code == 200
        timings[path], walls[path] = best, wall
    print(f"render CPU seconds: {timings}, wall seconds: {walls}")
    seq = client.get("/rollouts/long/sequences").text
    assert "64000 tokens · 32000 trained" in seq
    assert seq.count('title="id ') == 32_000
    page = client.get("/rollouts/long").text
    assert page.count('class="call') == 200 and "398 earlier messages as in call 198" in page
    assert all(t < 1.0 for t in timings.values()), timings


def test_postgres_store(pg_dsn: str) -> None:
    with open_store(pg_dsn) as store:
        planted_break(store, "planted")
        store.create_rollout(RolloutRecord("s0-x-g0-r0", "t", "s0-x-g0"))
    client = _client(pg_dsn)
    assert "planted" in client.get("/").text
    assert "1 rollouts" in client.get("/?step=1&task=t&state=queued").text
    assert "history_rewritten" in client.get("/rollouts/planted/sequences").text
    assert client.get("/rollouts/planted/calls/1/tokens").status_code == 200


def test_cli_arguments(tmp_path: Path) -> None:
    cfg = parse_args(["sqlite:///x.db", "--runs", str(tmp_path), "--port", "9000"], env={})
    assert (cfg.store, cfg.runs, cfg.port, cfg.host) == ("sqlite:///x.db", str(tmp_path), 9000,
                                                         "127.0.0.1")  # fmt: skip
    assert parse_args(["--runs", "r"], env={}).store_url.endswith("/r/traces.db")
    assert parse_args(["sqlite:///x.db"], env={"HARNESSRL_VIEW_TOKEN": "t"}).token == "t"
    with pytest.raises(SystemExit):
        parse_args(["sqlite:///x.db", "--port", "0"], env={})
    with pytest.raises(SystemExit):
        parse_args(["sqlite:///x.db", "--host", "0.0.0.0"], env={})


def test_curves_and_data_config_from_the_run_folder(tmp_path: Path) -> None:
    assert data_config("").loss_mode == "run_mean"
    (tmp_path / "config.json").write_text(
        '{"data": {"loss_mode": "token_mean", "buckets": [[2, 256]]}}'
    )
    assert data_config(str(tmp_path)).loss_mode == "token_mean"
    (tmp_path / "config.json").write_text('{"data": {"loss_mode": "nonsense"}}')
    assert data_config(str(tmp_path)).loss_mode == "run_mean"  # unreadable: the defaults
    records = [{"kind": "train", "step": 1, "reward": 0.5}, {"kind": "train", "step": 2,
               "reward": float("nan")}, {"kind": "eval", "step": 2, "eval_reward": 0.75}]  # fmt: skip
    drawn = charts(records)
    assert drawn[0].title == "reward"
    assert [len(s.points) for s in drawn[0].series] == [1, 1]  # NaN is left out
    assert "no data" in drawn[2].svg
    label = line_chart("t", [Series(EVIL, [(0.0, 1.0)])]).svg
    assert "<script>" not in label and "&lt;script&gt;" in label
    with open_store(f"sqlite:///{tmp_path / 'traces.db'}") as store:
        planted_break(store, "p")
    client = _client("", runs=str(tmp_path))
    assert "does not exist (yet)" in client.get("/curves").text
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "reward": 0.5}\n{"tor')
    assert client.get("/curves").text.count("<svg") == 6
    assert "--runs OUT_DIR" in _client(f"sqlite:///{tmp_path / 'traces.db'}").get("/curves").text


def test_token_text_comes_from_the_runs_tokenizer_escaped(tmp_path: Path) -> None:
    from harnessrl.view.tokens import decoder_for, load_tokenizer, tokenizer_spec

    tokenizer = load_tokenizer("tiny")
    evil = tokenizer.encode("<script>window.__pwned = 1</script>")
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    with open_store(url) as store:
        store.create_rollout(RolloutRecord("r", "t", "g"))
        store.add_calls([call("r", [1, *evil], evil, [{"role": "user", "content": "x"}], "y")])
    (tmp_path / "config.json").write_text('{"serve": {"model": "tiny"}}')
    assert tokenizer_spec("run", str(tmp_path)) == "tiny"
    assert tokenizer_spec("run", "") == "" and tokenizer_spec("none", str(tmp_path)) == ""
    page = _client(url, runs=str(tmp_path)).get("/rollouts/r/sequences").text
    assert "token text (tiny tokenizer)" in page and 'class="seq text"' in page
    assert "<script>window" not in page
    assert '<span class="c">&lt;script&gt;window' in page.replace("&lt;|im_start|&gt;", "")
    assert (
        "token ids (no tokenizer)"
        in _client(url, tokenizer="none").get("/rollouts/r/sequences").text
    )
    with pytest.raises(ValueError, match="--tokenizer nowhere: tokenizer 'nowhere' is neither"):
        decoder_for("nowhere", "")
    (tmp_path / "config.json").write_text('{"serve": {"model": "/no/such/model"}}')
    decode, note = decoder_for("run", str(tmp_path))  # the run's own: ids, and the page says why
    assert decode is None and "could not be read" in note


def test_prompts_of_every_endpoint_read_as_turns() -> None:
    from harnessrl.view.calls import prompt_messages, turn_of

    assert prompt_messages({"prompt": "2+2="}) == [{"role": "prompt", "content": "2+2="}]
    assert prompt_messages({"input": "hi"}) == [{"role": "user", "content": "hi"}]
    assert prompt_messages({"input": [{"type": "message", "content": "x"}]})[0]["content"] == "x"
    assert prompt_messages({}) == []
    tool = turn_of({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]})
    assert tool.role == "assistant" and 'tool_calls: [{"id": "c1"}]' in tool.text
    parts = turn_of({"role": "user", "content": [{"type": "text", "text": "a"}, {"image": 1}]})
    assert parts.text == 'a\n{"image": 1}'
    long = turn_of({"role": "user", "content": "z" * 25_000})
    assert len(long.text) == 20_000 and long.cut == 5_000
    assert turn_of("bare").role == "?"


def test_an_unreachable_database_is_a_clear_message() -> None:
    from harnessrl.view.app import open_reader

    with pytest.raises(ValueError, match="cannot open the trace store 'postgresql://nobody@"):
        open_reader(ViewConfig(store="postgresql://nobody@127.0.0.1:1/traces"))


def test_failed_calls_show_their_error_and_dialect_calls_their_wire_format(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    with open_store(url) as store:
        store.create_rollout(RolloutRecord("r", "t", "g"))
        ok = call("r", [1, 2], [3], [{"role": "user", "content": "q"}], "a")
        spoke = dataclasses.replace(ok, response={**(ok.response or {}), "dialect": "responses"})
        failed = dataclasses.replace(ok, status=502, error="upstream HTTP 502: overloaded",
                                     choices=(), response=None)  # fmt: skip
        store.add_calls([spoke, failed])
    page = _client(url).get("/rollouts/r").text
    assert "responses · HTTP 200" in page
    assert "chat · HTTP 502" in page and "upstream HTTP 502: overloaded" in page
    assert 'class="call failed"' in page
    listed = _client(url).get("/").text
    assert "(1 failed)" in listed
    merged = _client(url).get("/rollouts/r/sequences").text
    assert "2 (1 failed, 0 retries dropped)" in merged
