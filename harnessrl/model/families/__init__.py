"""Model stage: one folder per decoder family (config, decoder, HF names), and the one table of
them that `harnessrl.model.registry` serves: a new family is a folder and a row here."""

from __future__ import annotations

from harnessrl.model.families import dense, qwen3_5

FAMILIES = (dense.FAMILY, qwen3_5.FAMILY)
