"""`python -m harnessrl.serve --model smollm2|HF_DIR|GGUF --port N [--num-slots 8 ...]`.

In: a model spec and `ServeConfig` fields as flags (the admin token may also come from
HARNESSRL_ADMIN_TOKEN). Out: an OpenAI/vLLM-compatible server in the foreground (warm-up first,
so the first request does not compile); Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

import uvicorn

from harnessrl.listener import server_config
from harnessrl.serve.config import ServeConfig


def _parse_value(name: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--{name.replace('_', '-')}: cannot read {text!r}"
        ) from err
    return text


def parse_args(argv: list[str], env: dict[str, str] | None = None) -> ServeConfig:
    """Flags named after `ServeConfig` fields (`--num-slots 8`, `--prefill-buckets 16,64,256`)."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.serve", description=__doc__)
    for field in dataclasses.fields(ServeConfig):
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        if field.name == "admin_token":
            shown = "$HARNESSRL_ADMIN_TOKEN, else none (then only loopback hosts are allowed)"
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            default=default,
            type=lambda text, n=field.name, d=default: _parse_value(n, text, d),
            help=f"default: {shown}",
        )
    args = parser.parse_args(argv)
    if args.port == 0:
        parser.error("--port must be a fixed port for a foreground server")
    env = dict(os.environ) if env is None else env
    args.admin_token = args.admin_token or env.get("HARNESSRL_ADMIN_TOKEN", "")
    try:
        return ServeConfig(**vars(args))
    except ValueError as err:
        parser.error(str(err))
        raise


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
