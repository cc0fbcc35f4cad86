"""Who may do what: `/admin/*` always needs the bearer token (a server given none makes one and
hands it to whoever started it), checked before the body is read, so a caller without it learns
nothing about paths; loads run one at a time; the server will not bind off loopback without a
token given; unknown routes or methods answer in vLLM's error body. Real server, real export."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fakes import ADMIN_TOKEN, bounded_model_config
from flax import nnx

from harnessrl.fleet.serving import remote_serving
from harnessrl.fleet.weight_sync import EmbeddedSync, WeightSyncError
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.formats.export import export_hf
from harnessrl.serve.__main__ import parse_args
from harnessrl.serve.config import ServeConfig, is_loopback

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _load(server, body: dict, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/load_weights", json=body, headers=headers or {}, timeout=timeout
    )


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The served weights (seed 0, as conftest builds them) and other weights, exported."""
    root = tmp_path_factory.mktemp("exports")
    cfg = bounded_model_config()
    served = export_hf(Decoder(cfg, rngs=nnx.Rngs(0)), root / "served")
    other = export_hf(Decoder(cfg, rngs=nnx.Rngs(1)), root / "other")
    return served, other


def _greedy(server) -> tuple[list[int], str]:
    body = {"prompt": [72, 105], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(
        server.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120
    )
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["token_ids"], r.headers["x-harnessrl-policy-version"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {ADMIN_TOKEN}"}],
    ids=["none", "wrong", "not-bearer"],
)
def test_admin_without_the_token_is_401_whatever_the_path(bounded_server, exports, headers):
    version = bounded_server.engine.version
    answers = [
        _load(bounded_server, {"path": str(path), "version": version + 1}, headers)
        for path in (exports[1], "/no/such/folder", "/etc")
    ]
    assert {r.status_code for r in answers} == {401}
    assert len({r.content for r in answers}) == 1  # nothing tells an existing path apart
    error = answers[0].json()["error"]
    assert error["type"] == "Unauthorized" and "bearer token" in error["message"]
    assert answers[0].headers["www-authenticate"] == "Bearer"
    assert bounded_server.engine.version == version


def test_a_server_given_no_token_makes_one_and_refuses_loads_without_it(plain_server, exports):
    """The default (loopback, no --admin-token) used to leave /admin/load_weights open to every
    local process: a harness under test could swap the served weights and probe paths."""
    version = plain_server.engine.version

    def refused(headers: dict[str, str]) -> None:
        answers = [
            _load(plain_server, {"path": str(path), "version": version + 1}, headers)
            for path in (exports[1], "/no/such/folder", "/etc", "")
        ]
        assert [r.status_code for r in answers] == [401] * 4, [r.text[:200] for r in answers]
        assert len({r.content for r in answers}) == 1  # nothing tells an existing path apart
        assert answers[0].json()["error"]["type"] == "Unauthorized"
        assert plain_server.engine.version == version

    refused({})
    refused(_bearer("wrong"))
    token = plain_server.admin_token
    assert len(token) >= 32 and token not in repr(plain_server)
    refused(_bearer(token[:-1]))
    refused({"Authorization": token})
    # Whoever started it holds the token: its loads reach the loader.
    bad = _load(plain_server, {"path": "/no/such/folder", "version": version + 1}, _bearer(token))
    assert bad.status_code == 400 and "/no/such/folder" in bad.json()["error"]["message"]


def test_loads_run_one_at_a_time_and_a_concurrent_one_is_409(plain_server, gated_loader, exports):
    """Concurrent loads each held a copy of the weights (3 loads of smollm2: 1.9 -> 5.1 GiB)."""
    served, other = exports
    auth, version = _bearer(plain_server.admin_token), plain_server.engine.version
    first: list[httpx.Response] = []
    gated_loader.gate.clear()
    gated_loader.entered.clear()
    thread = threading.Thread(
        target=lambda: first.append(
            _load(plain_server, {"path": str(other), "version": version + 1}, auth)
        )
    )
    thread.start()
    try:
        assert gated_loader.entered.wait(30), "the first load never reached the loader"
        second = _load(plain_server, {"path": str(served), "version": version + 2}, auth, 10)
    finally:
        gated_loader.gate.set()
        thread.join(timeout=120)
    assert second.status_code == 409, second.text[:300]
    error = second.json()["error"]
    assert error["type"] == "Conflict" and "one at a time" in error["message"]
    assert gated_loader.most_inside == 1
    assert first[0].status_code == 200 and first[0].json() == {"version": version + 1}
    back = _load(plain_server, {"path": str(served), "version": version + 2}, auth)
    assert back.status_code == 200 and plain_server.engine.version == version + 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_cli_writes_the_token_it_makes_to_the_named_file(tmp_path):
    token_file, port = tmp_path / "admin-token", _free_port()
    env = {k: v for k, v in os.environ.items() if k != "HARNESSRL_ADMIN_TOKEN"}
    argv = [sys.executable, "-m", "harnessrl.serve", "--model", "tiny", "--warmup", "false",
            "--num-slots", "1", "--max-model-len", "64", "--prefill-buckets", "16",
            "--port", str(port), "--admin-token-file", str(token_file)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        body = {"path": "/no/such/folder", "version": 1}
        refused = httpx.post(url + "/admin/load_weights", json=body, timeout=30)
        assert refused.status_code == 401
        tried = httpx.post(
            url + "/admin/load_weights", json=body, headers=_bearer(token), timeout=30
        )
        assert tried.status_code == 400 and "/no/such/folder" in tried.text
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0].decode()
    assert str(token_file) in out and token not in out  # where to find it, not the token itself


def test_a_made_token_is_new_each_start_and_written_only_where_asked(tmp_path):
    from harnessrl.serve.admin import admin_token, private_token_file

    named = tmp_path / "token"
    config = ServeConfig(admin_token_file=str(named))
    token = admin_token(config)
    assert named.read_text().strip() == token and stat.S_IMODE(named.stat().st_mode) == 0o600
    again = admin_token(config)
    assert again != token and named.read_text().strip() == again  # replaced, never appended
    assert admin_token(ServeConfig(admin_token="given", admin_token_file=str(named))) == "given"
    assert named.read_text().strip() == again  # a given token is the caller's: not written
    assert len({admin_token(ServeConfig()) for _ in range(3)}) == 3
    private = private_token_file()
    try:
        assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700 and not private.exists()
    finally:
        private.parent.rmdir()


def test_embedded_sync_sends_the_token_and_swaps(bounded_server, exports):
    served, other = exports
    before, v0 = _greedy(bounded_server)
    with pytest.raises(WeightSyncError, match="401"):
        EmbeddedSync(urls=[bounded_server.url]).push(other, int(v0) + 1)
    sync = EmbeddedSync(urls=[bounded_server.url], admin_token=ADMIN_TOKEN)
    sync.push(other, int(v0) + 1)
    after, v1 = _greedy(bounded_server)
    assert v1 == str(int(v0) + 1) and after != before
    sync.push(served, int(v0) + 2)  # back to the weights the other tests were written against
    assert _greedy(bounded_server) == (before, str(int(v0) + 2))


def test_the_loops_remote_serving_sends_the_configured_token(bounded_server, exports, tmp_path):
    """`rollout.servers` + `weight_sync=embedded`: the loop's pushes carry `serve.admin_token`."""
    served, other = exports
    version = bounded_server.engine.version
    without = remote_serving(bounded_server.url, "embedded", tmp_path, tokenizer=None)
    with pytest.raises(WeightSyncError, match="401"):
        without.sync.push(other, version + 1)
    serving = remote_serving(bounded_server.url, "embedded", tmp_path, None, ADMIN_TOKEN)
    serving.sync.push(served, version + 1)
    assert bounded_server.engine.version == version + 1


def test_an_authorized_bad_load_is_400_and_the_weights_stay(bounded_server, tmp_path):
    version = bounded_server.engine.version
    (tmp_path / "config.json").write_text("{not json")
    r = _load(bounded_server, {"path": str(tmp_path), "version": version + 1}, AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert str(tmp_path) in r.json()["error"]["message"]  # the operator learns what failed
    huge = _load(bounded_server, {"path": str(tmp_path), "version": 2**63}, AUTH)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "version"
    assert bounded_server.engine.version == version


def test_binding_off_loopback_needs_an_admin_token(monkeypatch):
    with pytest.raises(ValueError, match="not loopback: set admin_token"):
        ServeConfig(host="0.0.0.0")
    assert ServeConfig(host="0.0.0.0", admin_token="t").admin_token == "t"
    assert "secret" not in repr(ServeConfig(admin_token="secret"))
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))
    assert parse_args(["--host", "0.0.0.0"], env={"HARNESSRL_ADMIN_TOKEN": "e"}).admin_token == "e"
    assert parse_args(["--admin-token", "f"], env={"HARNESSRL_ADMIN_TOKEN": "e"}).admin_token == "f"


def test_the_cli_refuses_to_start_on_all_interfaces_without_a_token():
    env = {"PATH": "/usr/bin:/bin"}  # no HARNESSRL_ADMIN_TOKEN
    done = subprocess.run(
        [sys.executable, "-m", "harnessrl.serve", "--host", "0.0.0.0", "--port", "8999"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr[-500:]
    assert "--admin-token" in done.stderr and "not loopback" in done.stderr


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/nope", 404, "Not Found"),
        ("POST", "/v2/chat/completions", 404, "Not Found"),
        ("GET", "/v1/completions", 405, "Method Not Allowed"),
        ("DELETE", "/admin/load_weights", 405, "Method Not Allowed"),
        ("POST", "/health", 405, "Method Not Allowed"),
    ],
)
def test_unknown_routes_and_methods_answer_in_vllms_error_body(
    bounded_server, method, path, status, kind
):
    r = httpx.request(method, bounded_server.url + path, timeout=30)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error == {"message": error["message"], "type": kind, "param": None, "code": status}
    assert path in error["message"]
    if status == 405:
        assert r.headers["allow"]
    assert r.headers["x-harnessrl-policy-version"] == str(bounded_server.engine.version)
