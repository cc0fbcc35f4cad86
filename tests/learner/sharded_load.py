"""Load policies straight into the learner's shards on 8 simulated devices (run by
test_sharded_load.py as `sharded_load.py FOLDER LOADS`): exported HF folders (dense, Qwen3.5),
SmolLM2's GGUF and random policies onto fsdp=8 and ZeRO-3 data=2,fsdp=4, and `train`: the loop's
load with rollout.servers set. Prints one JSON report: per load, the params whose sharding is not
the learner's, every moment a whole split param sat on one device, and the params that differ
from a load without a mesh. A control (whole on device 0, then moved) must be caught by the
same watch.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGUFReader

from harnessrl.learner.mesh import logical_axis_rules, make_mesh, use_mesh
from harnessrl.learner.params import param_shardings, place, split_model
from harnessrl.model.families.dense.config import ModelConfig
from harnessrl.model.families.dense.decoder import Decoder
from harnessrl.model.families.qwen3_5 import Qwen35Config, Qwen35Decoder
from harnessrl.model.formats import load
from harnessrl.model.formats.export import export_hf
from harnessrl.model.formats.gguf import read_metadata
from harnessrl.model.tokenizer import ChatTokenizer


class Watch:
    """Every array whole on one device with the shape of a param the target sharding splits,
    seen at each shard callback, each placement call and after each load."""

    def __init__(self, split_shapes: set[tuple[int, ...]]) -> None:
        self.split_shapes = split_shapes
        self.seen: list[str] = []
        self.samples = 0

    def look(self, where: str, extra: Any = None) -> None:
        self.samples += 1
        arrays = [*jax.live_arrays(), *([extra] if isinstance(extra, jax.Array) else [])]
        for a in arrays:
            if len(a.sharding.device_set) == 1 and tuple(a.shape) in self.split_shapes:
                self.seen.append(f"{where}: {a.shape} on {a.sharding}")

    @contextmanager
    def on(self) -> Iterator[None]:
        """Wrap the calls that put arrays on devices, so each one is looked at."""
        originals = {
            (jax, "make_array_from_callback"): jax.make_array_from_callback,
            (jax, "device_put"): jax.device_put,
            (jnp, "asarray"): jnp.asarray,
            (jnp, "array"): jnp.array,
        }

        def wrapped(name: str, fn: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                if name == "make_array_from_callback":
                    inner = args[2]

                    def callback(index: Any) -> Any:
                        self.look("shard callback")
                        return inner(index)

                    args = (*args[:2], callback, *args[3:])
                out = fn(*args, **kwargs)
                self.look(name, out)
                return out

            return call

        for (module, name), fn in originals.items():
            setattr(module, name, wrapped(name, fn))
        try:
            yield
        finally:
            for (module, name), fn in originals.items():
                setattr(module, name, fn)


def split_shapes(model: nnx.Module, mesh: Any, rules: Any) -> set[tuple[int, ...]]:
    parts, params = split_model(model)
    shardings = param_shardings(parts, params, mesh, rules)
    return {
        tuple(x.shape)
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
        if not s.is_fully_replicated
    }


def check(name: str, make: Callable[[], nnx.Module], mesh_spec: str, zero3: bool) -> dict:
    reference = make()  # no mesh: the single-device load the CPU run makes
    mesh, rules = make_mesh(mesh_spec), logical_axis_rules(zero3)
    watch = Watch(split_shapes(reference, mesh, rules))
    # Copies: on CPU np.asarray shares the device buffer, which would keep it alive.
    ref_leaves = [np.array(x, copy=True) for x in jax.tree.leaves(split_model(reference)[1])]
    del reference  # off the devices before the watched load
    gc.collect()
    with use_mesh(mesh, rules), watch.on():
        model = make()
    watch.look("after load")
    parts, params = split_model(model)
    targets = param_shardings(parts, params, mesh, rules)
    flat = list(zip(jax.tree.leaves(params), jax.tree.leaves(targets), strict=True))
    wrong = [str(x.shape) for x, s in flat if not x.sharding.is_equivalent_to(s, x.ndim)]
    kept = place(params, targets)  # what the Learner does: arrays laid out right are kept
    copied = sum(
        a is not b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(params), strict=True)
    )
    differ, ulps = [], 0
    for x, r in zip(jax.tree.leaves(params), ref_leaves, strict=True):
        if not np.array_equal(np.asarray(x), r):
            differ.append(str(x.shape))
            ulps = max(ulps, int(np.max(np.abs(np.asarray(x).view(np.int32) - r.view(np.int32)))))
    return {
        "name": f"{name} on {mesh_spec} zero3={zero3}",
        "split": len(watch.split_shapes),
        "samples": watch.samples,
        "wrong_sharding": wrong,
        "whole_on_one_device": watch.seen[:5],
        "copied_by_place": copied,
        "differ": differ,
        "max_ulps": ulps,
    }


def check_train(folder: str, cfg: ModelConfig, host: Any) -> dict:
    """`python -m harnessrl.train`'s load with rollout.servers set: policy and learner."""
    from harnessrl import train

    run_cfg = train.parse_args(
        [f"serve.model={folder}", "learner.mesh=data=2,fsdp=4", "learner.zero3=true",
         "rollout.servers=http://127.0.0.1:9/v1", f"run.out_dir={Path(folder).parent / 'run'}"]
    )  # fmt: skip
    mesh, rules = make_mesh("data=2,fsdp=4"), logical_axis_rules(True)
    watch = Watch(split_shapes(load.build_decoder(cfg, host), mesh, rules))
    gc.collect()
    with watch.on():
        model, _, learner = train.load_learner(run_cfg, sharded=bool(run_cfg.rollout.servers))
    watch.look("after the learner")
    leaves = jax.tree.leaves(learner.params)
    targets = jax.tree.leaves(learner.param_shardings)
    model_leaves = jax.tree.leaves(split_model(model)[1])
    return {
        "name": "train with rollout.servers",
        "split": len(watch.split_shapes),
        "samples": watch.samples,
        "wrong_sharding": [
            str(x.shape) for x, t in zip(leaves, targets, strict=True) if x.sharding != t
        ],
        "whole_on_one_device": watch.seen[:5],
        "copied_by_place": sum(a is not b for a, b in zip(leaves, model_leaves, strict=True)),
        "differ": [
            str(x.shape)
            for x, r in zip(leaves, jax.tree.leaves(host), strict=True)
            if not np.array_equal(np.asarray(x), r)
        ],
        "max_ulps": 0,
    }


def main(folder: str) -> None:
    names = sys.argv[2].split(",")
    cfg = ModelConfig.tiny()
    # Weights drawn on the host: an eager random init compiles one program per shape.
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(3)
    host = jax.tree.map(lambda s: rng.normal(0, 0.02, s.shape).astype(s.dtype), shapes)
    # The loop's load wants a tokenizer beside the weights: SmolLM2's, as `tiny` has.
    tokenizer = None
    if "train" in names:
        gguf = GGUFReader(load.smollm2_gguf_path())
        tokenizer = ChatTokenizer.from_gguf_metadata(read_metadata(gguf))
    export_hf(load.build_decoder(cfg, host), Path(folder), tokenizer=tokenizer)
    qwen = Path(folder).with_name("qwen3_5")
    if "hf-qwen3_5" in names:
        export_hf(Qwen35Decoder(Qwen35Config.tiny(), rngs=nnx.Rngs(3)), qwen)
    loads = {
        "hf": lambda: load.load_model(folder).model,
        "hf-qwen3_5": lambda: load.load_model(qwen).model,
        "smollm2": lambda: load.load_model("smollm2").model,  # GGUF, dequantized on the host
        "tiny": lambda: load.load_policy("tiny", seed=1)[0],
        "tiny-qwen3_5": lambda: load.load_policy("tiny-qwen3_5", seed=1)[0],
    }
    reports = []
    for name in (n for n in names if n != "train"):
        for mesh, zero3 in (("fsdp", False), ("data=2,fsdp=4", True)):
            start = time.perf_counter()
            reports.append(check(name, loads[name], mesh, zero3))
            reports[-1]["seconds"] = round(time.perf_counter() - start, 2)
    if "train" in names:  # the loop's own load for a run with remote servers
        reports.append(check_train(folder, cfg, host))
    # The control: the old way, whole on device 0 and then moved, must be caught.
    mesh, rules = make_mesh("fsdp"), logical_axis_rules(False)
    watch = Watch(split_shapes(load.build_decoder(cfg, host), mesh, rules))
    with watch.on():
        parts, params = split_model(load.build_decoder(cfg, host))
        with use_mesh(mesh, rules):
            place(params, param_shardings(parts, params, mesh, rules))
    print(json.dumps({"loads": reports, "control_caught": len(watch.seen)}))


if __name__ == "__main__":
    main(sys.argv[1])
