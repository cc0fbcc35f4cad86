"""`python -m proxy_sidecar --upstream URL[,URL] --store sqlite:///PATH --port N`.

In: command-line flags (see `--help`). Out: the sidecar served by uvicorn (uvloop, httptools).
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from proxy_sidecar.app import build_app
from proxy_sidecar.config import parse_args


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ValueError as err:
        sys.exit(f"proxy_sidecar: {err}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        server_header=False,
        date_header=False,
        log_level="warning",
        timeout_keep_alive=75,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
