"""The trace viewer's config: which store, which run folder, where to listen, who may look."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.http.listener import HttpLimits
from harnessrl.serve.config import is_loopback


@dataclass(frozen=True)
class ViewConfig:
    """Everything `python -m harnessrl.view` needs; validated on construction."""

    # Trace store URL (sqlite:///PATH or postgresql://...); empty: OUT_DIR/traces.db of --runs
    store: str = ""
    runs: str = ""  # a run's out_dir: metrics.jsonl for the curves, config.json for its data config
    host: str = "127.0.0.1"  # interface to bind; off loopback a token is required
    port: int = 8765  # 0 picks a free one
    # Bearer token for every page (or ?token= once, kept in a cookie); needed off loopback
    token: str = field(default="", repr=False)
    # Token text in the sequence view: run = the run's serve.model (from --runs), or a model
    # spec (smollm2, tiny, a .gguf file, an HF folder); none = token ids only
    tokenizer: str = "run"
    page_size: int = 50  # rollouts per page of the list
    max_header_bytes: int = 64 << 10  # request line + headers; larger gets 431
    read_timeout_s: float = 30.0  # deadline of a request's headers
    log_level: str = "warning"  # uvicorn log level

    def __post_init__(self) -> None:
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        size = self.page_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1000:
            raise ValueError(f"page_size must be an integer in [1, 1000], got {size!r}")
        if not is_loopback(self.host) and not self.token:
            raise ValueError(
                f"host {self.host!r} is reachable from other machines: set a token "
                "(--token or HARNESSRL_VIEW_TOKEN), or bind 127.0.0.1"
            )
        HttpLimits(self.max_header_bytes, self.read_timeout_s)

    @property
    def store_url(self) -> str:
        if self.store:
            return self.store
        if not self.runs:
            raise ValueError(
                "no store: give a store URL (sqlite:///PATH or postgresql://...) "
                "or --runs OUT_DIR of a run whose traces.db should be shown"
            )
        return f"sqlite:///{(Path(self.runs) / 'traces.db').absolute()}"

    @property
    def limits(self) -> HttpLimits:
        return HttpLimits(self.max_header_bytes, self.read_timeout_s)
