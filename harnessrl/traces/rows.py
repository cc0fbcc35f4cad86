"""Trace store rows: the one mapping between records and database columns.

In: `CallRecord` / `RolloutRecord`. Out: flat tuples of str/int/float/None that both the SQLite and
the PostgreSQL store write, and the inverse for rows read back. JSON goes through orjson, whose
float output round-trips every float64 exactly, so stored logprobs equal the server's.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from harnessrl.traces.schema import (
    CallRecord,
    Choice,
    EndpointKind,
    RolloutRecord,
    RolloutState,
    policy_version_error,
)

# Column -> kind, in table order; each store spells the kinds in its own SQL types (sql.schema).
# A trailing "?" makes the column nullable.
CALL_COLUMNS: dict[str, str] = {
    "rollout_id": "text",
    "seq": "bigint",
    "started_at": "real",
    "finished_at": "real",
    "endpoint": "text",
    "request": "json",
    "response": "json?",
    "prompt_token_ids": "json",
    "choices": "json",
    "policy_version": "bigint?",
    "upstream": "text",
    "latency_ms": "real",
    "status": "int",
    "error": "text?",
}

ROLLOUT_COLUMNS: dict[str, str] = {
    "rollout_id": "text",
    "task_id": "text",
    "group_id": "text",
    "attempt": "int",
    "state": "text",
    "reward": "real?",
    "exit_code": "int?",
    "info": "json",
    "created_at": "real",
    "updated_at": "real",
}

# Fields a state change may update besides the state itself.
MUTABLE_ROLLOUT_FIELDS = frozenset({"reward", "exit_code", "info"})


def dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError as err:  # orjson's own message ("Recursion limit reached") names no limit
        raise TypeError(
            f"value cannot be stored as JSON ({err}): it must hold only JSON types, integers "
            "within 64 bits, and nest at most 254 levels deep"
        ) from err


def loads(value: Any) -> Any:
    # PostgreSQL's jsonb comes back already decoded; SQLite gives text.
    if isinstance(value, str | bytes):
        return orjson.loads(value)
    return value


def check_call(call: CallRecord) -> None:
    """Reject records the store could not read back faithfully."""
    if not isinstance(call, CallRecord):
        raise TypeError(f"call must be a CallRecord, got {type(call).__name__}")
    if not isinstance(call.rollout_id, str) or not call.rollout_id:
        raise ValueError(f"call.rollout_id must be a non-empty string, got {call.rollout_id!r}")
    error = None if call.policy_version is None else policy_version_error(call.policy_version)
    if error:
        raise ValueError(f"call.policy_version {error} (or None)")
    for choice in call.choices:
        if len(choice.token_ids) != len(choice.logprobs):
            raise ValueError(
                f"choice {choice.index} of a call in rollout {call.rollout_id!r} has "
                f"{len(choice.token_ids)} token ids but {len(choice.logprobs)} logprobs; "
                "they must pair one to one"
            )


def call_to_row(call: CallRecord, seq: int) -> tuple[Any, ...]:
    choices = [
        {
            "index": c.index,
            "token_ids": list(c.token_ids),
            "logprobs": list(c.logprobs),
            "finish_reason": c.finish_reason,
            "text": c.text,
        }
        for c in call.choices
    ]
    return (
        call.rollout_id,
        seq,
        float(call.started_at),
        float(call.finished_at),
        EndpointKind(call.endpoint).value,
        dumps(call.request),
        None if call.response is None else dumps(call.response),
        dumps(list(call.prompt_token_ids)),
        dumps(choices),
        call.policy_version,
        call.upstream,
        float(call.latency_ms),
        int(call.status),
        call.error,
    )


def row_to_call(row: tuple[Any, ...] | list[Any]) -> CallRecord:
    values = dict(zip(CALL_COLUMNS, row, strict=True))
    choices = tuple(
        Choice(
            index=int(c["index"]),
            token_ids=tuple(c["token_ids"]),
            logprobs=tuple(float(x) for x in c["logprobs"]),
            finish_reason=c["finish_reason"],
            text=c.get("text", ""),
        )
        for c in loads(values["choices"])
    )
    response = values["response"]
    return CallRecord(
        rollout_id=values["rollout_id"],
        seq=int(values["seq"]),
        started_at=float(values["started_at"]),
        finished_at=float(values["finished_at"]),
        endpoint=EndpointKind(values["endpoint"]),
        request=loads(values["request"]),
        response=None if response is None else loads(response),
        prompt_token_ids=tuple(loads(values["prompt_token_ids"])),
        choices=choices,
        policy_version=values["policy_version"],
        upstream=values["upstream"],
        latency_ms=float(values["latency_ms"]),
        status=int(values["status"]),
        error=values["error"],
    )


def check_rollout(rollout: RolloutRecord) -> None:
    if not isinstance(rollout, RolloutRecord):
        raise TypeError(f"rollout must be a RolloutRecord, got {type(rollout).__name__}")
    for name in ("rollout_id", "task_id", "group_id"):
        value = getattr(rollout, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"rollout.{name} must be a non-empty string, got {value!r}")
    if rollout.reward is not None:
        check_reward(rollout.reward)


def check_reward(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"reward must be a number, got {type(reward).__name__} {reward!r}")
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward!r}")
    return float(reward)


def check_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Validate the extra fields of a state change; returns them normalized."""
    unknown = set(fields) - MUTABLE_ROLLOUT_FIELDS
    if unknown:
        raise TypeError(
            f"transition() got unknown fields {sorted(unknown)}; "
            f"allowed: {sorted(MUTABLE_ROLLOUT_FIELDS)}"
        )
    out = dict(fields)
    if out.get("reward") is not None:
        out["reward"] = check_reward(out["reward"])
    code = out.get("exit_code")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        raise TypeError(f"exit_code must be an int or None, got {out['exit_code']!r}")
    if "info" in out and not isinstance(out["info"], dict):
        raise TypeError(f"info must be a dict, got {type(out['info']).__name__}")
    return out


def rollout_to_row(rollout: RolloutRecord) -> tuple[Any, ...]:
    return (
        rollout.rollout_id,
        rollout.task_id,
        rollout.group_id,
        int(rollout.attempt),
        RolloutState(rollout.state).value,
        rollout.reward,
        rollout.exit_code,
        dumps(rollout.info),
        float(rollout.created_at),
        float(rollout.updated_at),
    )


def row_to_rollout(row: tuple[Any, ...] | list[Any]) -> RolloutRecord:
    values = dict(zip(ROLLOUT_COLUMNS, row, strict=True))
    return RolloutRecord(
        rollout_id=values["rollout_id"],
        task_id=values["task_id"],
        group_id=values["group_id"],
        attempt=int(values["attempt"]),
        state=RolloutState(values["state"]),
        reward=None if values["reward"] is None else float(values["reward"]),
        exit_code=values["exit_code"],
        info=loads(values["info"]),
        created_at=float(values["created_at"]),
        updated_at=float(values["updated_at"]),
    )
