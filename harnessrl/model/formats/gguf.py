"""Model stage, shared: a GGUF file's metadata (architecture, shapes, tokenizer) as Python values.

In: an open `gguf.GGUFReader`. Out: its key/value fields; a family's reader turns the tensors
into HF-named arrays (`harnessrl.model.registry.read_gguf`).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
