"""Run the viewer: in the foreground (the CLI) or on a thread beside the train loop.

In: a `ViewConfig`. Out: uvicorn on the bounded listener serving `build_app`; the address to open
(with `?token=` when a token is set).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import uvicorn

from harnessrl.http.listener import server_config
from harnessrl.view.app import build_app
from harnessrl.view.config import ViewConfig


def make_server(cfg: ViewConfig, tokenizer: Any = None) -> uvicorn.Server:
    """The viewer's server, not yet running; the store is opened (read-only) now."""
    app = build_app(cfg, tokenizer=tokenizer)
    listener = server_config(
        app, host=cfg.host, port=cfg.port, limits=cfg.limits, log_level=cfg.log_level
    )
    return uvicorn.Server(listener)


def address(cfg: ViewConfig, port: int) -> str:
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    token = f"/?token={quote(cfg.token, safe='')}" if cfg.token else "/"
    return f"http://{host}:{port}{token}"


@dataclass
class ViewerHandle:
    """A viewer serving on a background thread: `url` to open, `stop()`."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_viewer(cfg: ViewConfig, tokenizer: Any = None, startup_s: float = 30.0) -> ViewerHandle:
    """Serve on a daemon thread; returns once it accepts connections (port 0: a free one).
    `tokenizer` (the train loop's) shows token text without loading another."""
    server = make_server(cfg, tokenizer)
    thread = threading.Thread(target=server.run, name="harnessrl-view", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the viewer did not start on {cfg.host}:{cfg.port}")
        time.sleep(0.01)
    port = int(server.servers[0].sockets[0].getsockname()[1])
    return ViewerHandle(address(cfg, port), server, thread)
