"""`python -m harnessrl.serve --model smollm2|HF_DIR|GGUF --port N [--num-slots 8 ...]`.

In: a model spec and `ServeConfig` fields as flags (the admin token may also come from
HARNESSRL_ADMIN_TOKEN; given none, the server makes one and writes it to `--admin-token-file`,
or to a new private temporary file, and prints where). Out: an OpenAI/vLLM-compatible server in
the foreground (warm-up first, so the first request does not compile); Ctrl-C stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from harnessrl.cli import command_line, fail
from harnessrl.serve.admin import admin_token, private_token_file
from harnessrl.serve.config import ServeConfig

PROG = "python -m harnessrl.serve"


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ServeConfig:
    """Flags named after `ServeConfig` fields (`--num-slots 8`, `--prefill-buckets 16,64,256`)."""
    config: ServeConfig = command_line(
        ServeConfig(),
        argv,
        prog=PROG,
        doc=__doc__ or "",
        env=os.environ if env is None else env,
        env_keys={"admin_token": "HARNESSRL_ADMIN_TOKEN"},
    )
    if config.port == 0:
        fail(PROG, "--port must be a fixed port for a foreground server")
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from harnessrl.model.formats.load import load_policy
    from harnessrl.serve.app import make_server

    try:
        model, tokenizer = load_policy(config.model, seed=config.seed)
    except ValueError as err:
        fail(PROG, err)
    made = None  # a private temporary token file of ours, removed on the way out
    if not config.admin_token:
        if not config.admin_token_file:
            made = private_token_file()
            config = dataclasses.replace(config, admin_token_file=str(made))
        config = dataclasses.replace(config, admin_token=admin_token(config))
        where = Path(config.admin_token_file).absolute()
        print(f"admin token (Authorization: Bearer, for /admin/*) written to {where}", flush=True)
    try:
        if config.warmup:
            print(f"warming up {config.model_name} ({config.num_slots} slots)...", flush=True)
        _, server = make_server(model, tokenizer, config)
        print(f"serving {config.model_name} on http://{config.host}:{config.port}/v1", flush=True)
        server.run()
    finally:
        if made is not None:
            made.unlink(missing_ok=True)
            made.parent.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
