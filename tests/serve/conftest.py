"""The serving tests import their test doubles from this directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer and chat template, read from the GGUF of the shipped model package."""
    from gguf import GGUFReader

    from harnessrl.model.gguf_import import read_metadata
    from harnessrl.model.load import smollm2_gguf_path
    from harnessrl.model.tokenizer import ChatTokenizer

    try:
        path = smollm2_gguf_path()
    except ValueError as err:
        pytest.skip(f"needs the shipped SmolLM2 model: {err}")
    return ChatTokenizer.from_gguf_metadata(read_metadata(GGUFReader(path)))
