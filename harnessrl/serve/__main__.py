"""`python -m harnessrl.serve --model smollm2|HF_DIR|GGUF --port N [--num-slots 8 ...]`.

In: a model spec and `ServeConfig` fields as flags (the admin token may also come from
HARNESSRL_ADMIN_TOKEN). Out: an OpenAI/vLLM-compatible server in the foreground (warm-up first,
so the first request does not compile); Ctrl-C stops it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

import uvicorn

from harnessrl.cli import command_line, fail
from harnessrl.listener import server_config
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
    from harnessrl.engine.decode import Engine
    from harnessrl.model.load import load_model
    from harnessrl.serve.app import build_app

    loaded = load_model(config.model)
    if loaded.tokenizer is None:
        raise SystemExit(
            f"model {config.model!r} has no tokenizer (tokenizer.json); cannot serve chat"
        )
    engine = Engine(
        loaded.model, loaded.tokenizer.eos_token_ids or [loaded.config.eos_token_id], config
    )
    if config.warmup:
        print(f"warming up {config.model_name} ({engine.config.num_slots} slots)...", flush=True)
        engine.warm_up()
    app = build_app(engine, loaded.tokenizer, config)
    print(f"serving {config.model_name} on http://{config.host}:{config.port}/v1", flush=True)
    limits = config.http_limits
    uvicorn.Server(
        server_config(
            app, host=config.host, port=config.port, limits=limits, log_level=config.log_level
        )
    ).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
