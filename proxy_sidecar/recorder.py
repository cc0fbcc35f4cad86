"""Group commit of call records, on the event loop (SQLite) or on one writer thread (network DBs).

In: `CallRecord`s from request handlers. Out: each handler's `await record(call)` returns the seq
only after the store committed it, so the handler can release the response's final bytes knowing
the call is durable. Records produced in one loop iteration (or while a commit runs) share a commit.
A local SQLite commit takes tens of microseconds, so it runs inline: a writer thread would wait up
to the interpreter's 5 ms GIL switch interval for every hand-off under load.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from harnessrl.traces.schema import CallRecord

log = logging.getLogger("proxy_sidecar.recorder")

_STOP = object()


class Recorder:
    def __init__(self, store: Any, *, batch_max: int = 256) -> None:
        self.store = store
        self.batch_max = batch_max
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.inline = bool(getattr(store, "inline_writes", False))
        self._pending: list[tuple[CallRecord, asyncio.Future[int]]] = []
        self.commits = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.inline:
            self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
            self._thread.start()

    async def record(self, call: CallRecord) -> int:
        """Durably store `call`; returns its seq. Raises what the store raised."""
        assert self._loop is not None, "Recorder.start() must run first"
        fut = self._loop.create_future()
        if self.inline:
            if not self._pending:
                self._loop.call_soon(self._flush)
            self._pending.append((call, fut))
        else:
            self._queue.put((call, fut))
        return int(await fut)

    def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self.batch_max]
            del self._pending[: self.batch_max]
            _resolve([fut for _, fut in batch], self._write(batch))

    async def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            stop = False
            while len(batch) < self.batch_max:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[CallRecord, asyncio.Future[int]]]) -> None:
        results = self._write(batch)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_resolve, [fut for _, fut in batch], results)

    def _write(self, batch: list[tuple[CallRecord, asyncio.Future[int]]]) -> list[Any]:
        results: list[Any]
        try:
            results = list(self.store.add_calls([call for call, _ in batch]))
            self.commits += 1
        except Exception:
            # One bad record must not fail its neighbours: retry them one by one.
            results = []
            for call, _ in batch:
                try:
                    results.append(self.store.add_call(call))
                except Exception as err:
                    log.error("trace store write failed for rollout %r: %s", call.rollout_id, err)
                    results.append(err)
        return results


def _resolve(futures: list[asyncio.Future[int]], results: list[Any]) -> None:
    for fut, result in zip(futures, results, strict=True):
        if fut.done():  # the awaiting handler was cancelled
            continue
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)
