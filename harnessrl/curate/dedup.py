"""Task overlap: near-duplicate problem statements, and tasks that overlap an evaluation set.

In: problem statements (for near-duplicates) or task ids, repositories and dates (against an eval
set). Out: which rows duplicate an earlier one and which overlap the eval set, each with a reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from harnessrl.coding.tasks import CodingTask, RowError

NUM_PERM = 128  # MinHash values per statement; bands × rows always multiply to this
RECALL = 0.999  # chance a pair exactly at the threshold becomes a candidate, at least
_RNG = np.random.default_rng(20240101)  # fixed: the same signatures on every machine
_A = _RNG.integers(1, 2**63, NUM_PERM, dtype=np.uint64) | np.uint64(1)  # odd: a bijection mod 2^64
_B = _RNG.integers(0, 2**63, NUM_PERM, dtype=np.uint64)


def shingles(text: str, words: int) -> frozenset[str]:
    """Word `words`-grams of the lower-cased text; a shorter text is one shingle of all its words."""
    tokens = re.findall(r"\w+", text.lower())
    if len(tokens) <= words:
        return frozenset([" ".join(tokens)]) if tokens else frozenset()
    return frozenset(" ".join(tokens[i : i + words]) for i in range(len(tokens) - words + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def signature(shingle_set: frozenset[str]) -> np.ndarray:
    """MinHash: per permutation (a·h + b mod 2^64, a odd), the least value over the shingles."""
    hashes = np.array(
        [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
         for s in sorted(shingle_set)],
        dtype=np.uint64,
    )  # fmt: skip
    return (hashes[:, None] * _A[None, :] + _B[None, :]).min(axis=0)  # type: ignore[no-any-return]


def band_rows(threshold: float) -> int:
    """Rows per LSH band: the most (fewest candidates) that still meet `RECALL` at `threshold`.

    A pair of Jaccard J shares a band of r rows with chance J^r, so it is a candidate with chance
    1 - (1 - J^r)^(NUM_PERM / r); more similar pairs are candidates more often.
    """
    best = 1
    for r in (1, 2, 4, 8, 16, 32):
        if 1 - (1 - threshold**r) ** (NUM_PERM // r) >= RECALL:
            best = r
    return best


def near_duplicates(texts: Sequence[str], threshold: float, words: int) -> dict[int, int]:
    """Index of each text that duplicates an earlier kept one → that one's index (keep the first).

    Candidates come from MinHash LSH bands; each is confirmed with the exact shingle Jaccard, so a
    reported pair always has Jaccard >= `threshold` (and one at the threshold is missed with
    chance < 1 - RECALL). Texts with no words are never compared.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if words < 1:
        raise ValueError(f"words must be >= 1, got {words!r}")
    rows = band_rows(threshold)
    buckets: dict[tuple[int, bytes], list[int]] = {}
    kept: dict[int, frozenset[str]] = {}
    dups: dict[int, int] = {}
    for i, text in enumerate(texts):
        s = shingles(text, words)
        if not s:
            continue
        sig = signature(s)
        keys = [(b, sig[b * rows : (b + 1) * rows].tobytes()) for b in range(NUM_PERM // rows)]
        candidates = sorted({j for key in keys for j in buckets.get(key, ())})
        best = max(candidates, key=lambda j: (jaccard(s, kept[j]), -j), default=None)
        if best is not None and jaccard(s, kept[best]) >= threshold:
            dups[i] = best
            continue
        kept[i] = s
        for key in keys:
            buckets.setdefault(key, []).append(i)
    return dups


# SWE-bench: owner__name-PR. SWE-smith: owner__name.commit8.bug (its PR mirrors: .pr_PR).
SWE_BENCH_ID = re.compile(r"^(?P<owner>[^_][^/]*?)__(?P<name>[^/]+)-(?P<number>\d+)$")
SWE_SMITH_ID = re.compile(r"^(?P<owner>[^/]+?)__(?P<name>[^/]+?)\.[0-9a-f]{8}\.(?P<bug>.+)$")


def id_key(instance_id: str) -> tuple[str, int | None] | None:
    """('owner/name', PR number or None) an instance id names, or None for other ids."""
    if m := SWE_SMITH_ID.match(instance_id):
        pr = re.fullmatch(r"pr_(\d+)", m["bug"])
        return f"{m['owner']}/{m['name']}".lower(), int(pr[1]) if pr else None
    if m := SWE_BENCH_ID.match(instance_id):
        return f"{m['owner']}/{m['name']}".lower(), int(m["number"])
    return None


def repo_name(repo: str) -> str:
    """'owner/name' of a SWE-bench repo field or a SWE-smith one (swesmith/owner__name.commit8)."""
    if repo.startswith("swesmith/"):
        repo = re.sub(r"\.[0-9a-f]{8}$", "", repo.removeprefix("swesmith/")).replace("__", "/", 1)
    return repo.lower()


def task_keys(task: CodingTask) -> set[tuple[str, int | None]]:
    """Every (repo, PR) a task stands for: its id, its repo field, a PR mirror's source instance."""
    keys = {k for k in [id_key(task.instance_id)] if k}
    if task.repo:
        keys.add((repo_name(task.repo), None))
    ref = task.meta.get("instance_ref")
    if isinstance(ref, dict) and isinstance(ref.get("instance_id"), str):
        keys |= {k for k in [id_key(ref["instance_id"])] if k}
    return keys


@dataclass(frozen=True)
class EvalSet:
    """What an evaluation set holds: instance ids, repositories and (repository, PR) pairs."""

    ids: frozenset[str]
    repos: frozenset[str]
    prs: dict[tuple[str, int], str]  # (repo, PR) → the eval instance with it


def read_eval_set(path: str | Path) -> EvalSet:
    """A JSONL of eval rows: each an object with `instance_id` (and optionally `repo`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"eval set {str(p)!r} does not exist")
    ids: set[str] = set()
    repos: set[str] = set()
    prs: dict[tuple[str, int], str] = {}
    for lineno, line in enumerate(p.read_text().split("\n"), start=1):  # as read_jsonl does
        if not line.strip():
            continue
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as err:
            raise RowError(f"eval set {p}:{lineno}: not valid JSON ({err})") from err
        if not isinstance(row, dict) or not isinstance(row.get("instance_id"), str):
            raise RowError(f"eval set {p}:{lineno}: each row needs a string 'instance_id'")
        iid = row["instance_id"]
        ids.add(iid)
        if isinstance(row.get("repo"), str) and row["repo"]:
            repos.add(repo_name(row["repo"]))
        if key := id_key(iid):
            repos.add(key[0])
            if key[1] is not None:
                prs.setdefault((key[0], key[1]), iid)
    return EvalSet(frozenset(ids), frozenset(repos), prs)


def parse_date(text: str, what: str) -> datetime:
    """An ISO 8601 date or time; one without a zone is UTC."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError as err:
        raise ValueError(
            f"{what} must be an ISO 8601 date such as 2024-01-31, got {text!r}"
        ) from err
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def cutoff_time(text: str) -> datetime:
    """The last instant a cut-off allows; a bare date (2023-12-31) allows all of that day (UTC)."""
    when = parse_date(text, "created_after")
    try:
        date.fromisoformat(text.strip())
    except ValueError:
        return when
    return when + timedelta(days=1, microseconds=-1)


def contamination(
    task: CodingTask, evals: EvalSet | None, *, same_repo: bool, cutoff: datetime | None
) -> str | None:
    """Why `task` overlaps the eval set (or was created after `cutoff`), or None when it doesn't."""
    if evals is not None:
        if task.instance_id in evals.ids:
            return "its instance is in the eval set"
        keys = task_keys(task)
        for repo, number in sorted(keys, key=str):
            if number is not None and (repo, number) in evals.prs:
                return f"same repository and PR as eval instance {evals.prs[repo, number]!r}"
        if same_repo and (hit := sorted({r for r, _ in keys} & evals.repos)):
            return f"its repository {hit[0]!r} is in the eval set"
    created = task.meta.get("created_at")
    if cutoff is not None and created is not None:
        try:
            when = parse_date(str(created), "created_at")
        except ValueError:
            return f"created_at {created!r} is not an ISO 8601 date, so it cannot be shown to be before the cut-off"
        if when > cutoff:
            return f"created {created}, after the cut-off {cutoff.isoformat()}"
    return None
