"""Token text for the sequence view: the run's own tokenizer, loaded without its weights.

In: a model spec (`smollm2`, `tiny`, a `.gguf` file or an HF folder), or `run` for the
`serve.model` in a run's config.json. Out: an id → text function (cached per id), or None for
ids only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Decode = Callable[[int], str]


def tokenizer_spec(spec: str, runs: str) -> str:
    """The model spec `spec` names ("" when there is none to load)."""
    if spec in ("", "none"):
        return ""
    if spec != "run":
        return spec
    config = Path(runs) / "config.json" if runs else None
    if config is None or not config.is_file():
        return ""
    try:
        model = json.loads(config.read_text()).get("serve", {}).get("model", "")
    except (ValueError, AttributeError):
        return ""
    return str(model) if isinstance(model, str) else ""


def load_tokenizer(spec: str) -> Any:
    """The ChatTokenizer of a model spec, read from the tokenizer files only (no weights)."""
    from harnessrl.model import registry
    from harnessrl.model.formats.load import gguf_tokenizer, smollm2_gguf_path
    from harnessrl.model.tokenizer import ChatTokenizer

    random = spec in registry.RANDOM_SPECS  # random weights around SmolLM2's tokenizer
    path = smollm2_gguf_path() if spec == "smollm2" or random else Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return ChatTokenizer.from_hf_folder(path)
    raise ValueError(
        f"tokenizer {spec!r} is neither smollm2, tiny, a .gguf file nor an HF folder with a "
        "tokenizer.json; give one, or --tokenizer none for token ids only"
    )


def cached_decode(tokenizer: Any) -> Decode:
    """id → its text, from a table of the whole vocabulary decoded once (in one batch: ~0.1 s
    for 50k ids), so a 64k-token sequence costs a list lookup per token."""
    size = int(tokenizer.vocab_size)
    table = list(tokenizer.tokenizer.decode_batch([[i] for i in range(size)], False))

    def decode(token_id: int) -> str:
        # An id outside the vocabulary comes from another model's trace: shown as its number.
        return table[token_id] if 0 <= token_id < size else f"<{token_id}>"

    return decode


def decoder_for(spec: str, runs: str) -> tuple[Decode | None, str]:
    """(decode, a note for the page). An explicit spec that cannot load is a ValueError; the
    default `run` falls back to ids when the run's model has no readable tokenizer."""
    name = tokenizer_spec(spec, runs)
    if not name:
        return None, "token ids (no tokenizer)"
    try:
        return cached_decode(load_tokenizer(name)), f"token text ({name} tokenizer)"
    except (ValueError, OSError) as err:
        if spec != "run":
            raise ValueError(f"--tokenizer {spec}: {err}") from err
        return None, f"token ids (the run's tokenizer {name!r} could not be read: {err})"
