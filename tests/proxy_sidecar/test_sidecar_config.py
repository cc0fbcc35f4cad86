"""Command line and configuration validation; the entry point refuses unsafe or bad settings."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy_sidecar.__main__ import main
from proxy_sidecar.config import SidecarConfig, parse_args


def test_parse_args_defaults_and_env() -> None:
    cfg = parse_args(
        ["--upstream", "http://a:1/, http://b:2"],
        env={"HARNESSRL_CONTROL_TOKEN": "t", "HARNESSRL_ROLLOUT_ID": "pod-1"},
    )
    assert cfg.upstreams == ("http://a:1", "http://b:2")
    assert cfg.control_token == "t" and cfg.default_rollout == "pod-1"
    assert cfg.host == "127.0.0.1" and cfg.client == "aiohttp" and cfg.mode == "train"
    cfg = parse_args(
        [
            "--upstream",
            "http://a:1",
            "--train-overrides",
            '{"temperature": 1.0}',
            "--eval-overrides",
            '{"temperature": 0}',
            "--mode",
            "eval",
            "--fsync",
            "--no-call-log",
            "--control-token",
            "x",
        ],
        env={},
    )
    assert cfg.overrides("eval") == {"temperature": 0} and cfg.overrides("train") == {
        "temperature": 1.0
    }
    assert (
        cfg.fsync
        and not cfg.log_calls
        and cfg.control_token == "x"
        and cfg.default_rollout == "default"
    )


@pytest.mark.parametrize("bad", ['{"a":', "[1]"])
def test_override_flags_must_be_json_objects(bad: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--upstream", "http://a:1", "--train-overrides", bad], env={})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"upstreams": ()}, "at least one"),
        ({"upstreams": ("ftp://x",)}, "http"),
        ({"mode": "play"}, "mode"),
        ({"client": "curl"}, "client"),
        ({"port": 70000}, "port"),
        ({"default_rollout": "a/b"}, "default_rollout"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"pause_timeout_s": 0}, "pause_timeout_s"),
        ({"retries": -1}, "retries"),
        ({"host": "0.0.0.0"}, "control-token"),
        ({"max_buffered_bytes": 0}, "max_buffered_bytes"),
        ({"max_buffered_bytes": 1000}, "at least max_body_bytes"),
        ({"policy_version": 2**63}, "policy_version"),
        ({"policy_version": -1}, "policy_version"),
        ({"policy_version": True}, "policy_version"),
    ],
)
def test_config_rejects_bad_values(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SidecarConfig(**kw)


@pytest.mark.parametrize("bad", ["9223372036854775808", "-1", "seven"])
def test_policy_version_flag_is_a_64_bit_non_negative_integer(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--upstream", "http://a:1", "--policy-version", bad], env={})
    assert "--policy-version" in capsys.readouterr().err
    top = parse_args(["--upstream", "http://a:1", "--policy-version", str(2**63 - 1)], env={})
    assert top.policy_version == 2**63 - 1


def test_memory_budget_flag() -> None:
    cfg = parse_args(["--upstream", "http://a:1"], env={})
    assert cfg.max_buffered_bytes == 32 * 1024 * 1024 >= cfg.max_body_bytes
    argv = ["--upstream", "http://a:1", "--max-body-bytes", "1000", "--max-buffered-bytes", "5000"]
    cfg = parse_args(argv, env={})
    assert (cfg.max_body_bytes, cfg.max_buffered_bytes) == (1000, 5000)


def test_non_loopback_bind_is_fine_with_a_token() -> None:
    assert SidecarConfig(host="0.0.0.0", control_token="t").host == "0.0.0.0"


def test_main_refuses_unsafe_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HARNESSRL_CONTROL_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="control-token"):
        main(["--upstream", "http://a:1", "--host", "0.0.0.0"])


def test_drain_timeout_is_bounded(sidecar: Any) -> None:
    r = httpx.post(sidecar.url + "/control/pause", json={"drain_timeout_s": 1e300})
    assert r.status_code == 400 and "drain_timeout_s" in r.json()["error"]["message"]
    assert (
        httpx.post(sidecar.url + "/control/pause", json={"drain_timeout_s": 0}).json()["paused"]
        is True
    )
    httpx.post(sidecar.url + "/control/resume")
