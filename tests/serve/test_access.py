"""Who may do what: `/admin/*` needs the bearer token (checked before the body is read, so a
caller without it learns nothing about paths), the server will not bind off loopback without a
token, and unknown routes or methods answer in vLLM's error body. Real server, real export."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from fakes import ADMIN_TOKEN, bounded_model_config
from flax import nnx

from harnessrl.fleet.serving import remote_serving
from harnessrl.fleet.weight_sync import EmbeddedSync, WeightSyncError
from harnessrl.model.decoder import Decoder
from harnessrl.model.formats.export import export_hf
from harnessrl.serve.__main__ import parse_args
from harnessrl.serve.config import ServeConfig, is_loopback

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _load(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/load_weights", json=body, headers=headers or {}, timeout=120
    )


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
