"""Command line and configuration validation; the entry point refuses unsafe or bad settings."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.cli import to_argv
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
            "--log-calls",
            "false",
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


def test_main_refuses_unsafe_bind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HARNESSRL_CONTROL_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--upstream", "http://a:1", "--host", "0.0.0.0"])
    assert exc.value.code == 2
    assert "--host '0.0.0.0' is not loopback: set --control-token" in capsys.readouterr().err


def test_drain_timeout_is_bounded(sidecar: Any) -> None:
    r = httpx.post(sidecar.url + "/control/pause", json={"drain_timeout_s": 1e300})
    assert r.status_code == 400 and "drain_timeout_s" in r.json()["error"]["message"]
    assert (
        httpx.post(sidecar.url + "/control/pause", json={"drain_timeout_s": 0}).json()["paused"]
        is True
    )
    httpx.post(sidecar.url + "/control/resume")


SAFE_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30)
# Exponent floats and infinities: JSON writes them in forms YAML 1.1 would read as strings.
EDGES = st.sampled_from([1e-05, 2.5e300, -0.0, float("inf"), float("-inf")])
NUMBERS = EDGES | st.floats(allow_nan=False) | st.integers(-(2**40), 2**40) | st.booleans()


@settings(max_examples=200, deadline=None)
@given(
    ports=st.lists(st.integers(1, 65535), min_size=1, max_size=3),
    store=SAFE_TEXT,
    port=st.integers(0, 65535),
    default_rollout=SAFE_TEXT.filter(lambda s: s and "/" not in s),
    mode=st.sampled_from(["train", "eval"]),
    model=st.none() | SAFE_TEXT.filter(lambda s: s.strip().lower() not in ("none", "null")),
    overrides=st.dictionaries(st.text("abcdefghij_", min_size=1, max_size=8), NUMBERS, max_size=4),
    policy_version=st.none() | st.integers(0, 2**63 - 1),
    pause_timeout_s=st.floats(1e-9, 1e12),
    retries=st.integers(0, 9),
    fsync=st.booleans(),
    log_calls=st.booleans(),
)
def test_every_field_survives_the_command_line(
    ports: list[int], overrides: dict[str, Any], **fields: Any
) -> None:
    """What the train loop's SidecarProcess passes (`to_argv`) parses back to the same config."""
    config = SidecarConfig(
        upstreams=tuple(f"http://h{i}:{p}" for i, p in enumerate(ports)),
        train_overrides=overrides,
        eval_overrides={"temperature": 0.0, **overrides},
        **fields,
    )
    assert parse_args(to_argv(config, skip=("control_token",)), env={}) == config


def test_every_flag_in_the_docs_is_one_the_command_line_takes() -> None:
    """docs/sidecar.md's configuration table, flag by flag, names a key of the command line;
    booleans take their value as the loader spells them (`--log-calls false`)."""
    import pathlib
    import re

    from harnessrl.cli import resolve

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "sidecar.md").read_text()
    table = doc.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    flags = re.findall(r"`(--[a-z-]+)", "\n".join(rows))
    assert "--log-calls" in flags and "--body-timeout-s" in flags
    for flag in flags:
        resolve(SidecarConfig, flag, {"upstream": ("upstreams",)})  # unknown: ConfigError
    cfg = parse_args(["--upstream", "http://a:1", "--log-calls", "false"], env={})
    assert cfg.log_calls is False and SidecarConfig().log_calls is True
