"""Trace records and stores; `open_store(url)` picks the store from a URL.

In: `sqlite:///PATH` (relative path; `sqlite:////abs/path` for an absolute one, `sqlite:///:memory:`)
or `postgresql://...`. Out: an object implementing `harnessrl.traces.schema.TraceStore`.
"""

from __future__ import annotations

from typing import Any

from harnessrl.traces.schema import TraceStore

__all__ = ["TraceStore", "open_store"]


def open_store(url: str, **options: Any) -> TraceStore:
    """Open the trace store named by `url` (options go to the store's constructor)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a string, got {type(url).__name__}")
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        from harnessrl.traces.sqlite import SQLiteTraceStore

        return SQLiteTraceStore(url[len("sqlite:///") :], **options)
    if url.startswith(("postgresql://", "postgres://")):
        from harnessrl.traces.postgres import PostgresTraceStore

        return PostgresTraceStore(url, **options)
    raise ValueError(
        f"store url {url!r} is not supported; use sqlite:///PATH or postgresql://USER@HOST/DB"
    )
