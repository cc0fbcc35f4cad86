"""Diagnose why a call's prompt ids do not extend the sequence built so far.

In: the previous sequence's ids (and which of them were sampled), the new prompt's ids, and
optionally a decoder. Out: the first differing position, the ids on both sides, and a cause class.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Decoder = Callable[[list[int]], str]
_WINDOW = 8  # ids shown on each side, and the widest short edit considered a re-tokenization
_ANCHOR = 4  # ids that must agree again after an edit for the two sides to count as re-synced


class BreakCause(enum.StrEnum):
    BPE_REMERGE = "bpe_remerge"  # same text, other token boundaries (or only whitespace changed)
    TEMPLATE_ALTERED = "template_altered"  # template dropped/changed sampled content (reasoning)
    HISTORY_REWRITTEN = "history_rewritten"  # harness edited, removed or truncated earlier context
    OTHER = "other"  # no shared prefix (a new context), or too little evidence to tell


@dataclass(frozen=True)
class BreakDiagnosis:
    rollout_id: str
    call_seq: int  # the call whose prompt broke the chain
    position: int  # first index where the ids differ
    previous_ids: tuple[int, ...]  # previous sequence from `position` (up to 8 ids)
    new_ids: tuple[int, ...]  # new prompt from `position` (up to 8 ids)
    cause: BreakCause
    detail: str


def _text(decode: Callable[[list[int]], str] | None, ids: np.ndarray) -> str | None:
    if decode is None:
        return None
    try:
        return decode([int(x) for x in ids])
    except (KeyError, IndexError, ValueError):
        return None  # an id the decoder does not know: fall back to id-only evidence


def _resync(old: np.ndarray, new: np.ndarray, i: int) -> tuple[int, int] | None:
    """Smallest short edit (a old ids -> b new ids) after which both sides agree again."""
    # Plain lists: ~100 tiny comparisons are far cheaper without numpy's per-call overhead.
    o = old[i : i + _WINDOW + _ANCHOR].tolist()
    n = new[i : i + _WINDOW + _ANCHOR].tolist()
    for total in range(1, 2 * _WINDOW + 1):
        for a in range(max(0, total - _WINDOW), min(total, _WINDOW) + 1):
            b = total - a
            k = min(_ANCHOR, len(old) - i - a)
            if k <= 0 or i + b + k > len(new):
                continue
            if o[a : a + k] == n[b : b + k]:
                return a, b
    return None


def _find_anchor(hay: np.ndarray, needle: np.ndarray, start: int) -> int | None:
    """First index >= start where `needle` occurs in `hay` (vectorized candidate filter)."""
    if needle.size == 0 or start >= hay.size:
        return None
    cands = np.flatnonzero(hay[start : hay.size - needle.size + 1] == needle[0]) + start
    for c in cands:
        if np.array_equal(hay[c : c + needle.size], needle):
            return int(c)
    return None


def _same_text(t_old: str | None, t_new: str | None) -> str | None:
    if t_old is None or t_new is None:
        return None
    if t_old == t_new:
        return "same text, different token boundaries"
    if "".join(t_old.split()) == "".join(t_new.split()):
        return "only whitespace differs"
    return None


def _tail_retokenized(
    old: np.ndarray, new: np.ndarray, i: int, decode: Decoder | None
) -> str | None:
    """The previous sequence ends inside the edit: does some short prefix of the rest of the
    new prompt spell the same text as the old tail?"""
    t_old = _text(decode, old[i:])
    for b in range(0, _WINDOW + 1):
        if i + b > len(new):
            break
        why = _same_text(t_old, _text(decode, new[i : i + b]))
        if why:
            return f"{why}: {len(old) - i} id(s) at the end re-rendered as {b}"
    return None


def diagnose_break(
    old: np.ndarray,
    new: np.ndarray,
    sampled: np.ndarray,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[int, tuple[int, ...], tuple[int, ...], BreakCause, str]:
    """Classify a prefix break. Returns (position, previous_ids, new_ids, cause, detail)."""
    k = min(len(old), len(new))
    diff = np.flatnonzero(old[:k] != new[:k])
    i = int(diff[0]) if diff.size else k
    assert i < len(old), "an extension is not a break"
    ids_old = tuple(int(x) for x in old[i : i + _WINDOW])
    ids_new = tuple(int(x) for x in new[i : i + _WINDOW])
    cause, detail = _classify(old, new, sampled, i, decode)
    return i, ids_old, ids_new, cause, detail


def _classify(
    old: np.ndarray, new: np.ndarray, sampled: np.ndarray, i: int, decode: Decoder | None
) -> tuple[BreakCause, str]:
    if i == 0:
        return BreakCause.OTHER, "no shared prefix: a new context (sub-agent, reset or new task)"
    if i >= len(new):
        return BreakCause.HISTORY_REWRITTEN, f"prompt stops {len(old) - i} ids short: truncated"
    near_sampled = bool(sampled[max(0, i - 1) : i + 1].any())
    edit = _resync(old, new, i)
    if edit is not None:
        a, b = edit
        why = _same_text(_text(decode, old[i : i + a]), _text(decode, new[i : i + b]))
        if why:
            return BreakCause.BPE_REMERGE, f"{why}: {a} id(s) became {b}"
        if decode is None and a and b and a != b and max(a, b) <= _ANCHOR:
            return BreakCause.BPE_REMERGE, f"{a} id(s) became {b} (short edit, text not checked)"
    elif len(old) - i <= _WINDOW:
        why = _tail_retokenized(old, new, i, decode)
        if why:
            return BreakCause.BPE_REMERGE, why
        if decode is None:
            return BreakCause.OTHER, "differs in the last ids of the sequence; give a decoder"
    # A longer deletion: the new prompt picks the old sequence up again further on.
    anchor = new[i : i + _ANCHOR]
    skip = _find_anchor(old, anchor, i + 1) if len(anchor) == _ANCHOR else None
    if skip is not None and (edit is None or edit[1] == 0):
        dropped = int(sampled[i:skip].sum())
        if dropped:
            return BreakCause.TEMPLATE_ALTERED, f"{dropped} sampled ids dropped (e.g. reasoning)"
        return BreakCause.HISTORY_REWRITTEN, f"{skip - i} context ids removed"
    if near_sampled:
        return BreakCause.TEMPLATE_ALTERED, "sampled content re-rendered differently"
    return BreakCause.HISTORY_REWRITTEN, "earlier context edited"
