"""Remote serving: each pushed version is a complete HF export before any server sees it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flax import nnx

from harnessrl.fleet.serving import RemoteServing
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.formats.export import export_hf


def test_remote_serving_exports_each_version_and_keeps_the_last_two(tmp_path: Path) -> None:
    model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    pushed: list[tuple[str, int]] = []

    class Sync:
        def push(self, folder: Any, version: int) -> None:
            assert (folder / "config.json").is_file()  # complete before any server sees it
            pushed.append((folder.name, version))

    serving = RemoteServing("http://vllm:8000", Sync(), tmp_path / "weights", tokenizer=None)
    learner = SimpleNamespace(export_hf=lambda out, tok: export_hf(model, out, tok))
    for version in (1, 2, 3):
        serving.push(learner, version)
    assert pushed == [("v000001", 1), ("v000002", 2), ("v000003", 3)]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002", "v000003"]
