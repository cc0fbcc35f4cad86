"""`python -m harnessrl.train`, with step 1's update held until a run of step 2 has a call on record.

In the async loop, step 2's runs start while step 1 updates. Whether any of their calls is served
before the weight swap is a race between harness start-up and the update, and a fast learner wins
it every time; the staleness test needs at least one such call, so this entry point makes the
order certain (fault injection: the loop itself is unchanged).
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl import train

WAIT_S = 600.0
_update = train.update


def wait_for_call(db: Path, prefix: str) -> None:
    """Until the trace store holds a call of a rollout whose id starts with prefix."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if db.exists():
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
                query = "SELECT 1 FROM calls WHERE rollout_id LIKE ? LIMIT 1"
                if conn.execute(query, (f"{prefix}%",)).fetchone():
                    return
        time.sleep(0.05)
    raise TimeoutError(f"no call of a {prefix}* rollout reached {db} in {WAIT_S:.0f} s")


def update(run: Any, step: int, rollouts: Any) -> dict[str, Any]:
    if step == 0:  # step 1's update, while step 2's runs (ids s1-...) play
        wait_for_call(run.out / "traces.db", "s1-")
    return _update(run, step, rollouts)


if __name__ == "__main__":
    train.update = update
    sys.exit(train.main())
