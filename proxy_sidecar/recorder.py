"""Group commit of call records: inline on the event loop while that never waits, else on a thread.

In: `CallRecord`s from request handlers. Out: each handler's `await record(call)` returns the seq
only after the store committed it, so the handler can release the response's final bytes knowing
the call is durable. Records produced in one loop iteration (or while a commit runs) share a commit.

A local SQLite commit takes tens of microseconds, so it is tried inline: a writer thread would wait
up to the interpreter's 5 ms GIL switch interval for every hand-off under load. The inline try
never waits for a lock (`try_add_calls`): when another process or thread holds the database's
write lock, the batch goes to the writer thread, which waits for it (up to the store's busy
timeout) while the loop keeps serving `/health`, streams and other calls. Later batches follow it
there until the thread has caught up, so commits keep the order in which calls completed.
Network stores (PostgreSQL) always commit on the writer thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from harnessrl.traces.schema import CallRecord, InlineWrites, TraceStore
from harnessrl.traces.sql import StoreUnavailable
from harnessrl.traces.sqlite import is_busy

log = logging.getLogger("proxy_sidecar.recorder")

_STOP = object()

Pending = tuple[CallRecord, "asyncio.Future[int]"]


class Recorder:
    def __init__(self, store: TraceStore, *, batch_max: int = 256) -> None:
        self.store = store
        self.batch_max = batch_max
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inline_store: InlineWrites | None = (
            store if isinstance(store, InlineWrites) and store.inline_writes else None
        )
        self._pending: list[Pending] = []
        self._on_thread = 0  # records handed to the writer thread and not yet resolved
        self.commits = 0
        self.handoffs = 0  # records whose inline commit would have waited: went to the thread

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    async def record(self, call: CallRecord) -> int:
        """Durably store `call`; returns its seq. Raises what the store raised."""
        assert self._loop is not None, "Recorder.start() must run first"
        fut = self._loop.create_future()
        if self._inline_store is not None:
            if not self._pending:
                self._loop.call_soon(self._flush)
            self._pending.append((call, fut))
        else:
            self._hand_off([(call, fut)])
        return int(await fut)

    def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self.batch_max]
            del self._pending[: self.batch_max]
            results = None if self._on_thread else self._try_inline(batch)
            if results is None:
                self.handoffs += len(batch)
                self._hand_off(batch)
            else:
                self.commits += 1
                _resolve([fut for _, fut in batch], results)

    def _try_inline(self, batch: list[Pending]) -> list[Any] | None:
        assert self._inline_store is not None  # only inline stores flush on the loop
        try:
            seqs = self._inline_store.try_add_calls([call for call, _ in batch])
        except Exception:
            return None  # nothing was written; the writer thread retries, one by one if need be
        return None if seqs is None else list(seqs)

    def _hand_off(self, batch: list[Pending]) -> None:
        self._on_thread += len(batch)
        for item in batch:
            self._queue.put(item)

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
            results = self._write(batch)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._thread_done, batch, results)
            if stop:
                return

    def _thread_done(self, batch: list[Pending], results: list[Any]) -> None:
        self._on_thread -= len(batch)
        _resolve([fut for _, fut in batch], results)

    def _write(self, batch: list[Pending]) -> list[Any]:
        results: list[Any]
        try:
            results = list(self.store.add_calls([call for call, _ in batch]))
            self.commits += 1
        except Exception as err:
            # Waited the store's whole busy timeout, or its server stayed unreachable past the
            # reconnect budget: a retry of each call would wait again.
            if is_busy(err) or isinstance(err, StoreUnavailable):
                log.error("trace store unavailable; %d call(s) not recorded: %s", len(batch), err)
                return [err] * len(batch)
            # One bad record must not fail its neighbours: retry them one by one.
            results = []
            for call, _ in batch:
                try:
                    results.append(self.store.add_call(call))
                except Exception as one:
                    log.error("trace store write failed for rollout %r: %s", call.rollout_id, one)
                    results.append(one)
        return results


def _resolve(futures: list[asyncio.Future[int]], results: list[Any]) -> None:
    for fut, result in zip(futures, results, strict=True):
        if fut.done():  # the awaiting handler was cancelled
            continue
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)
