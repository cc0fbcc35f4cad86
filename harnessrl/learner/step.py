"""Learner stage: the sharded train step.

In: a Flax NNX decoder, a `LearnerConfig`, and per step a list of `PackedBatch`es (the one batch
contract, `harnessrl.data.pack`; any count, shapes from a fixed bucket set). Out: updated,
sharded params and optimizer state, step metrics, checkpoints and HF exports.

One jitted micro-step adds the gradient of `sum(token_weights * per_token_loss)` into donated
accumulators; one jitted apply clips, runs AdamW and zeroes the accumulators in place. Compiles
are bounded by the number of bucket shapes plus one, whatever a step's sample count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harnessrl.data.pack import PackedBatch
from harnessrl.kernels import train_attention as kernel_attention
from harnessrl.learner import losses
from harnessrl.learner.checkpoint import Checkpointer
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.mesh import batch_sharding, logical_axis_rules, make_mesh, use_mesh
from harnessrl.learner.optimizer import make_optimizer, make_schedule, opt_state_shardings
from harnessrl.learner.params import (
    abstract_like,
    gather_to_host,
    param_shardings,
    place,
    split_model,
)
from harnessrl.model import registry
from harnessrl.model.formats import export
from harnessrl.model.hooks import SegmentAttention


def scan_unroll(cfg: LearnerConfig, model: nnx.Module) -> int | None:
    """The configured layer-scan unroll, or the automatic one: every layer on CPU, else 1."""
    if cfg.scan_unroll is not None:
        return cfg.scan_unroll
    model_cfg = getattr(model, "cfg", None)
    layers = getattr(model_cfg, "num_layers", None)
    if layers is None:
        return None  # not one of our decoders: leave its graph alone
    family = registry.find_decoder(model)
    if family is not None and not family.unroll_layers_on_cpu:
        return 1
    return layers if jax.default_backend() == "cpu" else 1


def train_attention(cfg: LearnerConfig, model: nnx.Module, mesh: Mesh) -> SegmentAttention | None:
    """The CPU attention kernel where it applies to this model and mesh, else None (XLA's).

    One device only: the kernel is an opaque custom call, which XLA's partitioner would run on
    gathered, replicated operands rather than on each device's rows.
    """
    family = registry.find_decoder(model)
    takes_kernel = family is not None and family.segment_attention
    if not cfg.cpu_attention or not takes_kernel or mesh.devices.size != 1:
        return None
    platform = mesh.devices.flat[0].platform
    decoder: Any = model  # a family's decoder (checked above)
    if not kernel_attention.usable(decoder.cfg.head_dim, cfg.compute_dtype, platform):
        return None
    return kernel_attention.segment_attention


class Learner:
    """Owns the mesh, the sharded train state and the compiled programs of one policy."""

    def __init__(
        self, model: nnx.Module, cfg: LearnerConfig | None = None, mesh: Mesh | None = None
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"model must be a Flax NNX module (e.g. load_model(...).model), got {type(model).__name__}"
            )
        self.cfg = cfg = cfg if cfg is not None else LearnerConfig()
        if not isinstance(cfg, LearnerConfig):
            raise TypeError(f"cfg must be a LearnerConfig, got {type(cfg).__name__}")
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
        self.attention = train_attention(cfg, model, self.mesh)
        self.parts, params = split_model(
            model, cfg.compute_dtype, cfg.param_dtype, cfg.remat, scan_unroll(cfg, model)
        )
        # Gradient accumulators and optimizer moments take these shardings too (below).
        self.rules = logical_axis_rules(cfg.zero3)
        self.param_shardings = param_shardings(self.parts, params, self.mesh, self.rules)
        self.optimizer = make_optimizer(cfg)
        self._schedule = make_schedule(cfg)
        abstract_params = abstract_like(params, self.param_shardings)
        self.opt_shardings = opt_state_shardings(
            self.optimizer, abstract_params, self.param_shardings, self.mesh
        )
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._batch_sharding = batch_sharding(self.mesh)
        self._batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.traces: dict[str, int] = {"micro_step": 0, "apply": 0}
        self._token_loss = losses.make_token_loss(
            cfg.eps_low, cfg.eps_high, cfg.tis_cap, cfg.kl_coef, cfg.entropy_coef
        )
        # A model loaded under this mesh hands its arrays over as they are; the first step
        # donates them, so such a model is spent once it has trained.
        self.params = place(params, self.param_shardings)
        # The frozen reference is held only when its KL term is on (chosen here, not in jit); a
        # copy, as the params' buffers are donated.
        self.ref_params = jax.tree.map(jnp.copy, self.params) if cfg.kl_coef else None
        with use_mesh(self.mesh, self.rules):
            self.opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(
                self.params
            )
        self._build_programs()
        self._grads = self._zeros(self.params)
        self._sums = jax.device_put(losses.zero_metrics(), self._replicated)
        self.step = 0
        self.checkpointer = (
            Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, cfg.async_checkpoint)
            if cfg.checkpoint_dir
            else None
        )

    # ---- compiled programs -------------------------------------------------------------------

    def _build_programs(self) -> None:
        # One sharding for the whole batch dict: jit takes it as a prefix of the batch's tree.
        ps, rep, bs = self.param_shardings, self._replicated, self._batch_sharding
        ref_s = ps if self.ref_params is not None else None
        self._zeros = jax.jit(
            lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), out_shardings=ps
        )
        self._micro = jax.jit(
            self._micro_step,
            in_shardings=(ps, ref_s, ps, rep, bs),
            out_shardings=(ps, rep),
            donate_argnums=(2, 3),
        )
        self._apply = jax.jit(
            self._apply_update,
            in_shardings=(ps, self.opt_shardings, ps, rep),
            out_shardings=(ps, self.opt_shardings, ps, rep),
            donate_argnums=(0, 1, 2),
        )

    def _logits(self, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
        model = self.parts.merge(params)
        if self.attention is None:  # other model families take no `attention`
            return model(batch["tokens"], batch["positions"], batch["segment_ids"])
        return model(
            batch["tokens"], batch["positions"], batch["segment_ids"], attention=self.attention
        )

    def _micro_step(
        self, params: Any, ref_params: Any, grads: Any, sums: Any, batch: Any
    ) -> tuple[Any, Any]:
        self.traces["micro_step"] += 1  # runs once per trace, i.e. once per compiled shape
        ref_logits = None
        if ref_params is not None:
            ref_logits = jax.lax.stop_gradient(self._logits(ref_params, batch))

        def loss(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            return self._token_loss(self._logits(p, batch), batch, ref_logits)

        (_, metrics), g = jax.value_and_grad(loss, has_aux=True)(params)
        grads = jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), grads, g)
        sums = {k: sums[k] + metrics[k] for k in sums}
        return grads, sums

    def _apply_update(
        self, params: Any, opt_state: Any, grads: Any, step: jax.Array
    ) -> tuple[Any, Any, Any, Any]:
        self.traces["apply"] += 1
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        stats = {
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(new_params),
            "lr": jnp.asarray(self._schedule(step), jnp.float32),
        }
        return new_params, opt_state, jax.tree.map(jnp.zeros_like, grads), stats

    @property
    def compile_count(self) -> int:
        """Programs traced (hence compiled) for training so far: micro-step shapes + apply."""
        return self.traces["micro_step"] + self.traces["apply"]

    # ---- host-facing API ---------------------------------------------------------------------

    def _put(self, batch: PackedBatch) -> dict[str, jax.Array]:
        """This process's rows of one micro-batch → global arrays sharded over (data, fsdp)."""
        return {
            name: jax.make_array_from_process_local_data(self._batch_sharding, array)
            for name, array in batch.as_dict().items()
        }

    def _check(self, batch: object) -> PackedBatch:
        if not isinstance(batch, PackedBatch):
            raise TypeError(
                f"a micro-batch must be a harnessrl.data.pack.PackedBatch, got {type(batch).__name__}"
            )
        rows = batch.shape[0] * jax.process_count()
        if rows % self._batch_shards:
            raise ValueError(
                f"micro-batch has {rows} rows in all, not a multiple of data*fsdp="
                f"{self._batch_shards} of mesh {dict(self.mesh.shape)}; choose bucket rows accordingly"
            )
        return batch

    def train_step(self, batches: Sequence[PackedBatch]) -> dict[str, float]:
        """One optimizer step over any number of micro-batches; returns step metrics."""
        if not batches:
            raise ValueError("a step needs at least one micro-batch, got an empty list")
        # Check every micro-batch before the first one touches the accumulators, so a bad one
        # cannot leave half a step's gradient behind for the next step.
        checked = [self._check(batch) for batch in batches]
        with use_mesh(self.mesh, self.rules):
            for batch in checked:
                self._grads, self._sums = self._micro(
                    self.params, self.ref_params, self._grads, self._sums, self._put(batch)
                )
            sums = jax.device_get(self._sums)
            self._sums = jax.device_put(losses.zero_metrics(), self._replicated)
            step = jnp.asarray(self.step, jnp.int32)
            self.params, self.opt_state, self._grads, stats = self._apply(
                self.params, self.opt_state, self._grads, step
            )
        self.step += 1
        out = losses.finalize_metrics(sums)
        out.update({k: float(v) for k, v in jax.device_get(stats).items()})
        out.update(
            step=float(self.step),
            micro_batches=float(len(batches)),
            compiles=float(self.compile_count),
        )
        return out

    # ---- checkpoints and export --------------------------------------------------------------

    def save(self, data_position: Any = None) -> None:
        """Checkpoint the current step (async when configured); `data_position` is JSON."""
        if self.checkpointer is None:
            raise ValueError("save() needs LearnerConfig.checkpoint_dir to be set")
        self.checkpointer.save(self.step, self.params, self.opt_state, data_position)

    def restore(self, step: int | None = None) -> Any:
        """Load the latest (or given) checkpoint in place; returns its data position."""
        if self.checkpointer is None:
            raise ValueError("restore() needs LearnerConfig.checkpoint_dir to be set")
        restored = self.checkpointer.restore(
            abstract_like(self.params, self.param_shardings),
            abstract_like(self.opt_state, self.opt_shardings),
            step,
        )
        self.params, self.opt_state = restored.params, restored.opt_state
        self.step = restored.step
        return restored.data_position

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    def params_state(self) -> nnx.State:
        """Current weights as the model's `nnx.State` of Params (host numpy arrays)."""
        return self.parts.params_state(gather_to_host(self.params))

    def export_hf(self, out_dir: str | Path, tokenizer: Any = None) -> Path:
        """Write the current weights (and `tokenizer`, if given) as an HF safetensors folder.

        Every process gathers the weights; process 0 writes.
        """
        model: Any = self.parts.merge(gather_to_host(self.params))  # export_hf checks its type
        if jax.process_index() == 0:
            export.export_hf(model, out_dir, tokenizer=tokenizer)
        return Path(out_dir)
