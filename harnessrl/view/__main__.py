"""`python -m harnessrl.view STORE_URL [--runs OUT_DIR] [--port 8765] [--host 127.0.0.1]`.

In: a trace store URL (sqlite:///PATH or postgresql://...; opened read-only) and optionally a
run's out_dir (its metrics.jsonl gives the training curves). Out: the viewer's web pages, served
in the foreground until Ctrl-C. Off loopback a token is required (--token or HARNESSRL_VIEW_TOKEN).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from harnessrl.cli import command_line, fail
from harnessrl.view.config import ViewConfig

PROG = "python -m harnessrl.view"


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ViewConfig:
    """A leading URL is the store (`STORE_URL` is `--store STORE_URL`); the rest are flags."""
    args = list(argv)
    if args and "://" in args[0] and not args[0].startswith("-"):
        args = [f"--store={args[0]}", *args[1:]]
    config: ViewConfig = command_line(
        ViewConfig(),
        args,
        prog=PROG,
        doc=__doc__ or "",
        env=os.environ if env is None else env,
        env_keys={"token": "HARNESSRL_VIEW_TOKEN"},
    )
    if config.port == 0:
        fail(PROG, "--port must be a fixed port for a foreground viewer")
    return config


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    from harnessrl.view.serve import address, make_server

    try:
        server = make_server(cfg)
    except ValueError as err:
        fail(PROG, err)
    print(f"viewing {cfg.store_url} on {address(cfg, cfg.port)}", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
