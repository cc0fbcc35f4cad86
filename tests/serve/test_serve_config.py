"""ServeConfig validation and the `python -m harnessrl.serve` flags."""

from __future__ import annotations

import pytest

from harnessrl.serve.__main__ import parse_args
from harnessrl.serve.config import ServeConfig


def test_defaults_and_decode_lengths():
    cfg = ServeConfig()
    assert cfg.model_name == "smollm2" and cfg.max_model_len == 2048
    assert cfg.decode_lengths == (128, 256, 512, 1024, 2048)
    assert ServeConfig(max_model_len=100, prefill_buckets=(16,)).decode_lengths == (100,)
    assert ServeConfig(
        max_model_len=64, prefill_buckets=(8,), decode_buckets=(32, 64)
    ).decode_lengths == (32, 64)
    assert ServeConfig(served_model_name="x").model_name == "x"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_slots": 0}, "num_slots >= 1"),
        ({"port": -1}, "port"),
        ({"max_model_len": True}, "max_model_len"),
        ({"prefill_buckets": (64, 16)}, "strictly increasing"),
        ({"prefill_buckets": ()}, "prefill_buckets"),
        ({"prefill_buckets": (4096,)}, "exceeds max_model_len"),
        ({"decode_buckets": (128, 1024)}, "must end at max_model_len=2048"),
        ({"policy_version": "1"}, "policy_version"),
        ({"policy_version": 2**63}, r"policy_version must be an integer in \[0, 2\*\*63 - 1\]"),
        ({"max_n": 0}, "max_n must be a positive integer"),
        ({"max_request_tokens": True}, "max_request_tokens"),
        ({"max_body_bytes": -1}, "max_body_bytes"),
        ({"max_header_bytes": 100}, "ServeConfig.max_header_bytes must be an integer >= 1024"),
        ({"read_timeout_s": 0}, "ServeConfig.read_timeout_s must be finite and > 0"),
        ({"admin_token": 5}, "admin_token must be a string"),
        ({"admin_token_file": 5}, "admin_token_file must be a string"),
        ({"max_buffered_bytes": 0}, "max_buffered_bytes must be a positive integer"),
        ({"max_buffered_bytes": 1 << 20}, "below max_body_bytes=16777216"),
        ({"body_timeout_s": 0}, "body_timeout_s must be a finite number > 0"),
        ({"body_timeout_s": float("inf")}, "body_timeout_s"),
        ({"body_timeout_s": True}, "body_timeout_s"),
        ({"host": "0.0.0.0"}, "not loopback: set admin_token"),
    ],
)
def test_bad_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServeConfig(**kwargs)


def test_cli_flags_map_to_fields():
    cfg = parse_args(
        [
            "--model",
            "some/dir",
            "--port",
            "9000",
            "--num-slots",
            "16",
            "--prefill-buckets",
            "32,128",
            "--warmup",
            "false",
            "--read-timeout-s",
            "2.5",
            "--max-n",
            "8",
        ],
        env={},
    )
    assert cfg == ServeConfig(
        model="some/dir",
        port=9000,
        num_slots=16,
        prefill_buckets=(32, 128),
        warmup=False,
        read_timeout_s=2.5,
        max_n=8,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "zero"],
        ["--port", "0"],
        ["--num-slots", "0"],
        ["--warmup", "maybe"],
        ["--read-timeout-s", "soon"],
        ["--host", "0.0.0.0"],
    ],
)
def test_cli_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, env={})
    assert "error" in capsys.readouterr().err
