"""What the viewer reads from a trace store: pages of rollouts, one rollout's calls, a group.

In: a read-only `SQLStoreBase` (SQLite or PostgreSQL). Out: small dataclasses shaped for the
pages. Every query is bounded (a page, one rollout, one group) and walks an index: rollouts by
creation time, task or group, calls by (rollout_id, seq). Nothing here writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from harnessrl.traces import rows
from harnessrl.traces.schema import CallRecord, RolloutRecord, UnknownRollout
from harnessrl.traces.sql import SQLStoreBase

# Group ids of the train loop: `s{k}-…` holds the runs of train step k+1, `e{k}-…` the eval
# runs after step k (the step numbers of metrics.jsonl).
_GROUP = re.compile(r"^([se])(\d+)-")
_LIST_COLS = (
    "rollout_id, task_id, group_id, attempt, state, reward, exit_code, created_at, updated_at"
)
# Everything of a call but its prompt ids, which only the token view and the merge need.
_CALL_COLS = (
    "seq, started_at, finished_at, endpoint, request, response, choices, policy_version, "
    "upstream, latency_ms, status, error"
)


def step_of(group_id: str) -> tuple[str, int] | None:
    """("train" | "eval", metrics step) of a loop's group id; None for other ids."""
    m = _GROUP.match(group_id)
    if m is None:
        return None
    k = int(m.group(2))
    return ("train", k + 1) if m.group(1) == "s" else ("eval", k)


@dataclass(frozen=True)
class Filters:
    """The rollout list's filters; each is optional and validated by the page."""

    step: int | None = None
    phase: str | None = None  # train | eval
    task: str | None = None
    group: str | None = None
    state: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        args: list[Any] = []
        for column, value in (("task_id", self.task), ("group_id", self.group)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if self.state is not None:
            clauses.append("state = ?")
            args.append(self.state)
        patterns = []
        if self.step is not None:
            if self.phase != "eval" and self.step >= 1:
                patterns.append(f"s{self.step - 1}-%")
            if self.phase != "train":
                patterns.append(f"e{self.step}-%")
            if not patterns:
                clauses.append("1 = 0")  # train step 0 does not exist
        elif self.phase is not None:
            patterns.append("s%" if self.phase == "train" else "e%")
        if patterns:
            clauses.append("(" + " OR ".join("group_id LIKE ?" for _ in patterns) + ")")
            args += patterns
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


@dataclass(frozen=True)
class RolloutRow:
    """One line of the rollout list: the record and its calls' aggregates."""

    rollout: RolloutRecord
    calls: int = 0
    failed_calls: int = 0
    versions: tuple[int | None, int | None] = (None, None)
    duration_s: float | None = None  # first call started → last call finished

    @property
    def step(self) -> tuple[str, int] | None:
        return step_of(self.rollout.group_id)


@dataclass(frozen=True)
class Page:
    rows: list[RolloutRow]
    total: int
    page: int
    page_size: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))


@dataclass(frozen=True)
class CallView:
    """A call as the rollout page shows it (prompt ids left in the store)."""

    record: CallRecord
    prompt_tokens: int | None  # from the response's usage, when the server reported it

    @property
    def dialect(self) -> str:
        # Calls made in another wire format (responses, messages) say which in their response.
        found = (self.record.response or {}).get("dialect")
        return str(found) if found else str(self.record.endpoint)


@dataclass
class RolloutDetail:
    rollout: RolloutRecord
    calls: list[CallView] = field(default_factory=list)


def _rollout(row: tuple[Any, ...]) -> RolloutRecord:
    """A list row (no info column) as a record."""
    return rows.row_to_rollout((*row[:7], "{}", *row[7:]))


class TraceReader:
    """The viewer's queries over one read-only store."""

    def __init__(self, store: SQLStoreBase) -> None:
        if not isinstance(store, SQLStoreBase):
            raise TypeError(f"store must be an SQL trace store, got {type(store).__name__}")
        self.store = store

    def page(self, filters: Filters, page: int, page_size: int) -> Page:
        where, args = filters.where()
        total = int(self.store.select(f"SELECT COUNT(*) FROM rollouts{where}", args)[0][0])
        found = self.store.select(
            f"SELECT {_LIST_COLS} FROM rollouts{where} ORDER BY created_at, rollout_id "
            "LIMIT ? OFFSET ?",
            [*args, page_size, (page - 1) * page_size],
        )
        records = [_rollout(r) for r in found]
        return Page(self._with_aggregates(records), total, page, page_size)

    def _with_aggregates(self, records: list[RolloutRecord]) -> list[RolloutRow]:
        if not records:
            return []
        marks = ", ".join("?" * len(records))
        found = self.store.select(
            "SELECT rollout_id, COUNT(*), MIN(policy_version), MAX(policy_version), "
            "MIN(started_at), MAX(finished_at), "
            "SUM(CASE WHEN error IS NULL AND status >= 200 AND status < 300 THEN 0 ELSE 1 END) "
            f"FROM calls WHERE rollout_id IN ({marks}) GROUP BY rollout_id",
            [r.rollout_id for r in records],
        )
        agg = {r[0]: r for r in found}
        out = []
        for rec in records:
            a = agg.get(rec.rollout_id)
            if a is None:
                out.append(RolloutRow(rec))
                continue
            duration = float(a[5]) - float(a[4]) if a[4] is not None else None
            out.append(RolloutRow(rec, int(a[1]), int(a[6] or 0), (a[2], a[3]), duration))
        return out

    def rollout(self, rollout_id: str) -> RolloutRecord:
        return self.store.rollout(rollout_id)

    def detail(self, rollout_id: str) -> RolloutDetail:
        out = RolloutDetail(self.store.rollout(rollout_id))
        found = self.store.select(
            f"SELECT {_CALL_COLS} FROM calls WHERE rollout_id = ? ORDER BY seq", [rollout_id]
        )
        for r in found:
            call = rows.row_to_call((rollout_id, *r[:6], "[]", *r[6:]))
            usage = (call.response or {}).get("usage") or {}
            tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            out.calls.append(CallView(call, tokens if isinstance(tokens, int) else None))
        return out

    def call(self, rollout_id: str, seq: int) -> CallRecord:
        """One whole call, prompt ids included."""
        found = self.store.select(
            f"SELECT {', '.join(rows.CALL_COLUMNS)} FROM calls WHERE rollout_id = ? AND seq = ?",
            [rollout_id, seq],
        )
        if not found:
            raise UnknownCall(rollout_id, seq)
        return rows.row_to_call(found[0])

    def calls(self, rollout_id: str) -> list[CallRecord]:
        """Every call with its ids, for the merge; requests and responses are left out."""
        self.store.rollout(rollout_id)  # UnknownRollout before an empty list
        found = self.store.select(
            "SELECT seq, started_at, finished_at, endpoint, prompt_token_ids, choices, "
            "policy_version, upstream, latency_ms, status, error FROM calls "
            "WHERE rollout_id = ? ORDER BY seq",
            [rollout_id],
        )
        return [rows.row_to_call((rollout_id, *r[:4], "{}", None, *r[4:])) for r in found]

    def group(self, group_id: str) -> list[RolloutRow]:
        records = self.store.rollouts(group_id)
        if not records:
            raise UnknownGroup(group_id)
        return self._with_aggregates(records)


class UnknownCall(KeyError):
    def __init__(self, rollout_id: str, seq: int) -> None:
        super().__init__(rollout_id)
        self.rollout_id, self.seq = rollout_id, seq

    def __str__(self) -> str:
        return f"rollout {self.rollout_id!r} has no call {self.seq}"


class UnknownGroup(KeyError):
    def __init__(self, group_id: str) -> None:
        super().__init__(group_id)
        self.group_id = group_id

    def __str__(self) -> str:
        return f"no rollouts in group {self.group_id!r}"


__all__ = ["Filters", "Page", "RolloutDetail", "TraceReader", "UnknownCall", "UnknownRollout"]
