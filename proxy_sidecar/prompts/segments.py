"""Token-in prompt text → ids through a per-rollout cache, equal to tokenizing each piece whole.

In: the text pieces a `Renderer` tokenizes (the rendered prompt around spliced turns) and the
segments the rollout's previous call used. Out: each piece's ids, exactly those of tokenizing the
piece in one go, and this call's segments (text → ids), which the rollout's next call reuses.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

MAX_BYTES = 256 * 2**20  # segment text and ids kept over all rollouts (256 MiB)
ENTRY_BYTES = 150  # a cached text's cost beyond its characters and id pointers (objects, slot)


def cut_tokens(tokenizer: Tokenizer, template: str) -> tuple[str, ...]:
    """The template's added tokens just before which a text can be cut without changing its ids.

    HF tokenizers first cut a text at the added tokens matched on raw text (`normalized=False`),
    then normalize, pre-tokenize and BPE each span between them on its own. Tokenizing `A` and
    `<t>B` apart thus gives the ids of `A<t>B`, unless the whole text's added-token matching
    differs at the cut: `<t>` (or a longer added token starting with it) taking whitespace on its
    left (`lstrip`) or looking at the character before it (`single_word`), an added token that
    could match across the cut (its tail a prefix of `<t>`, or starting with `<t>`), or a
    `single_word` token ending just before a `<t>` that begins with a word character. Tokens where
    any of these could happen are not cut at.
    """
    if getattr(tokenizer, "encode_special_tokens", False):
        return ()  # special tokens are then tokenized as text, across any cut
    added = list(tokenizer.get_added_tokens_decoder().values())
    out = []
    for token in added:
        text = token.content
        if (
            text
            and text in template
            and not text[0].isspace()
            and not (token.normalized or token.lstrip or token.single_word)
            and not any(_interferes(other, text) for other in added)
            and tokenizer.encode(text, add_special_tokens=False).ids
            == [tokenizer.token_to_id(text)]
        ):
            out.append(text)
    return tuple(sorted(out))


def _interferes(other: AddedToken, text: str) -> bool:
    """Whether added token `other` could match differently across a cut just before `text`."""
    content = other.content
    if content.startswith(text) and (other.lstrip or other.single_word):
        return True
    if other.single_word and (text[0].isalnum() or text[0] == "_"):
        return True
    return any(
        text.startswith(tail) or tail.startswith(text)
        for tail in (content[k:] for k in range(1, len(content)))
    )


class Cutter:
    """Cuts text just before each occurrence of a set of tokens (see `cut_tokens`)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = tuple(tokens)
        self._find = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None

    def cut(self, text: str) -> list[str]:
        """Non-empty segments that join back to `text` (none for an empty text)."""
        if self._find is None or not text:
            return [text] if text else []
        out, last = [], 0
        for found in self._find.finditer(text):
            start = found.start()
            if start > last:
                out.append(text[last:start])
                last = start
        out.append(text[last:])
        return out


Ids = tuple[int, ...]


@dataclass(frozen=True)
class Segments:
    """What one call's text tokenized to: each piece and each segment of the pieces it had to
    cut (text → ids), and about how many bytes they hold."""

    ids: dict[str, Ids]
    nbytes: int


@dataclass
class Plan:
    """One call's pieces, what is known of them, and the segments left to tokenize."""

    pieces: Sequence[str]
    used: dict[str, Ids]  # text → ids, of the pieces and segments known
    cut: dict[str, list[str]]  # the pieces not known, and their segments
    missing: dict[str, None]  # the segments left, in order

    @property
    def missing_chars(self) -> int:
        return sum(map(len, self.missing))


class Tokenize:
    """Text pieces → ids, reusing what the rollout's previous call tokenized."""

    def __init__(self, tokenizer: Tokenizer, cutter: Cutter) -> None:
        self.cutter = cutter
        # The same ids, without the offsets nobody reads (tokenizers >= 0.21).
        self._encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        # Cached ids point at one shared int per vocabulary entry: 8 bytes an id, not 36.
        self._ints = tuple(range(max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1))

    def __call__(
        self, pieces: Sequence[str], known: Mapping[str, Ids] | None
    ) -> tuple[list[Ids], Segments]:
        return self.finish(self.plan(pieces, known))

    def plan(self, pieces: Sequence[str], known: Mapping[str, Ids] | None) -> Plan:
        """What of the pieces is known: a piece the previous call had is reused whole; any other
        is cut into segments, of which those the previous call had are reused. `known` is only
        read: calls may share it across threads."""
        known = known or {}
        plan = Plan(pieces, {}, {}, {})
        for piece in pieces:
            ids = known.get(piece)
            if ids is not None:
                plan.used[piece] = ids
            elif piece not in plan.cut:
                plan.cut[piece] = segments = self.cutter.cut(piece)
                for segment in segments:
                    ids = known.get(segment)
                    if ids is None:
                        plan.missing[segment] = None
                    else:
                        plan.used[segment] = ids
        return plan

    def finish(self, plan: Plan) -> tuple[list[Ids], Segments]:
        """Each piece's ids: the segments left are tokenized, in one batch."""
        used = plan.used
        if plan.missing:
            texts = list(plan.missing)
            for text, encoding in zip(
                texts, self._encode(texts, add_special_tokens=False), strict=True
            ):
                used[text] = self._intern(encoding.ids)
        for piece, segments in plan.cut.items():
            whole: list[int] = []
            for segment in segments:
                whole += used[segment]
            used[piece] = tuple(whole)
        nbytes = sum(len(text) + 8 * len(ids) + ENTRY_BYTES for text, ids in used.items())
        return [used[piece] for piece in plan.pieces], Segments(used, nbytes)

    def _intern(self, ids: list[int]) -> Ids:
        try:
            return tuple(map(self._ints.__getitem__, ids))
        except IndexError:  # an id past the vocabulary (never seen): kept as it is
            return tuple(ids)


class SegmentCache:
    """Per rollout, the segments of its latest prompt.

    An agent loop's next prompt repeats them, so it tokenizes only its new text. Bounded by the
    bytes held: past `max_bytes`, the rollouts used least recently are forgotten (their next call
    tokenizes its whole prompt again). Touched only on the event loop; the segments it hands out
    are never changed afterwards, so render threads may read them.
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.held = 0
        self._rollouts: OrderedDict[str, Segments] = OrderedDict()

    def get(self, rollout_id: str) -> Mapping[str, Ids] | None:
        found = self._rollouts.get(rollout_id)
        if found is None:
            return None
        self._rollouts.move_to_end(rollout_id)
        return found.ids

    def put(self, rollout_id: str, segments: Segments) -> None:
        old = self._rollouts.pop(rollout_id, None)
        self.held += segments.nbytes - (old.nbytes if old is not None else 0)
        self._rollouts[rollout_id] = segments
        while self.held > self.max_bytes and len(self._rollouts) > 1:
            _, dropped = self._rollouts.popitem(last=False)
            self.held -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._rollouts)
