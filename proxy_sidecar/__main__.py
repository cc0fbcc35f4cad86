"""`python -m proxy_sidecar --upstream URL[,URL] --store sqlite:///PATH --port N`.

In: command-line flags (see `--help`). Out: the sidecar served by uvicorn (uvloop, httptools),
through the same bounded HTTP listener as the embedded server (request heads capped at 64 KiB and
30 s, body pauses at 30 s).
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from harnessrl.http.listener import HttpLimits, server_config
from proxy_sidecar.app import build_app
from proxy_sidecar.config import parse_args


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)  # exits with the reason on a bad flag
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    listener = server_config(
        build_app(config),
        host=config.host,
        port=config.port,
        limits=HttpLimits(),
        loop="uvloop",
        access_log=False,
        server_header=False,
        date_header=False,
        log_level="warning",
        timeout_keep_alive=75,
        backlog=4096,
    )
    uvicorn.Server(listener).run()


if __name__ == "__main__":
    main()
