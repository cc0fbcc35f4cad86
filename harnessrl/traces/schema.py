"""Trace records: what the sidecar captures (calls) and what the launcher tracks (rollouts).

In: parsed upstream responses and launcher events. Out: immutable records that the stores persist
and that `harnessrl.data` turns into training arrays.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Policy versions are stored as 64-bit integers (SQLite INTEGER, PostgreSQL BIGINT).
MAX_POLICY_VERSION = 2**63 - 1


def policy_version_error(value: object) -> str | None:
    """Why `value` cannot be a policy version, or None if it can.

    The trace stores keep versions as 64-bit integers: a larger one could not be recorded, and
    every call stamped with it would fail to store.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 0 <= value <= MAX_POLICY_VERSION
    ):
        return f"must be an integer in [0, 2**63 - 1], got {value!r:.50}"
    return None


class RolloutState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


# Allowed state changes. Terminal states have no way out: a finished run is never re-opened,
# so a late reward or a duplicate "finished" message cannot resurrect an excluded run.
TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.QUEUED: frozenset(
        {RolloutState.RUNNING, RolloutState.FAILED, RolloutState.TIMED_OUT}
    ),
    RolloutState.RUNNING: frozenset(
        {RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.TIMED_OUT}
    ),
    RolloutState.SUCCEEDED: frozenset(),
    RolloutState.FAILED: frozenset(),
    RolloutState.TIMED_OUT: frozenset(),
}

TERMINAL_STATES = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class UnknownRollout(KeyError):
    """A rollout id that no store record exists for."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(rollout_id)
        self.rollout_id = rollout_id

    def __str__(self) -> str:
        return f"unknown rollout {self.rollout_id!r}: create it with create_rollout() first"


class InvalidTransition(ValueError):
    """A state change that TRANSITIONS does not allow."""

    def __init__(self, rollout_id: str, current: RolloutState, target: RolloutState) -> None:
        allowed = sorted(s.value for s in TRANSITIONS[current]) or ["nothing (terminal)"]
        super().__init__(
            f"rollout {rollout_id!r} cannot go from {current.value!r} to {target.value!r}; "
            f"allowed from {current.value!r}: {', '.join(allowed)}"
        )
        self.rollout_id = rollout_id
        self.current = current
        self.target = target


def check_transition(rollout_id: str, current: RolloutState, target: RolloutState) -> None:
    """Raise InvalidTransition unless `current -> target` is in TRANSITIONS."""
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(rollout_id, current, target)


class EndpointKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


@dataclass(frozen=True)
class Choice:
    """One sampled completion of a call, exactly as the server produced it."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # logprob of each sampled token under the serving policy
    finish_reason: str | None
    text: str = ""


@dataclass(frozen=True)
class CallRecord:
    """One model call made by a harness, captured by the sidecar."""

    rollout_id: str
    seq: int  # order of the call within its rollout, 0-based, assigned by the store
    started_at: float  # unix seconds
    finished_at: float
    endpoint: EndpointKind
    request: dict[str, Any]
    response: dict[str, Any] | None  # for streams: the assembled, non-streaming equivalent
    prompt_token_ids: tuple[int, ...]
    choices: tuple[Choice, ...]
    policy_version: int | None
    upstream: str
    latency_ms: float
    status: int  # HTTP status the harness received; 0 when no response reached it
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300 and bool(self.choices)


@dataclass(frozen=True)
class RolloutRecord:
    """One harness run on one task."""

    rollout_id: str
    task_id: str
    group_id: str  # runs of the same task in the same step; advantages are computed per group
    attempt: int = 0
    state: RolloutState = RolloutState.QUEUED
    reward: float | None = None
    exit_code: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # evaluator details, stderr tail, ...
    created_at: float = 0.0
    updated_at: float = 0.0


class TraceStore(Protocol):
    """What the sidecar, the launcher and the data pipeline need from a store."""

    def add_call(self, call: CallRecord) -> int:
        """Persist a call durably before returning; returns the sequence number it got."""
        ...

    def add_calls(self, calls: list[CallRecord]) -> list[int]:
        """Persist several calls in one transaction (group commit); their sequence numbers."""
        ...

    def calls(self, rollout_id: str) -> list[CallRecord]:
        """All calls of a rollout ordered by `seq`."""
        ...

    def count_calls(self, rollout_id: str | None = None) -> int:
        """Calls stored for a rollout (None: for all rollouts)."""
        ...

    def create_rollout(self, rollout: RolloutRecord) -> None: ...

    def rollout(self, rollout_id: str) -> RolloutRecord: ...

    def rollouts(self, group_id: str | None = None) -> list[RolloutRecord]: ...

    def transition(self, rollout_id: str, state: RolloutState, **fields: Any) -> RolloutRecord:
        """Move a rollout to `state` (validated against TRANSITIONS), updating `fields`."""
        ...

    def set_reward(self, rollout_id: str, reward: float) -> RolloutRecord: ...

    def close(self) -> None: ...


@runtime_checkable
class InlineWrites(Protocol):
    """A store whose commits are cheap enough for an event loop, when they need not wait (SQLite)."""

    inline_writes: bool  # False: commit on a thread anyway (as a network database would)

    def try_add_calls(self, calls: list[CallRecord]) -> list[int] | None:
        """`add_calls` if it commits without waiting; None, with nothing written, if it would."""
        ...
