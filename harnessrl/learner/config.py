"""Learner stage config: one frozen dataclass for mesh, numerics, objective, optimizer and checkpoints.

In: keyword values (from the train loader's YAML / `--key=value` merge). Out: a validated
`LearnerConfig`. Defaults reproduce the embedded CPU run (SmolLM2-135M, float32, one device).
"""

from __future__ import annotations

import dataclasses
import math

DTYPES = ("float32", "bfloat16")
SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Everything the learner needs besides the model and the packed batches."""

    mesh: str = "dp"  # preset, "data=2,fsdp=-1,tensor=1", or a tpu_configs name / YAML path
    compute_dtype: str = "float32"  # matmul dtype; norms, softmax and logits stay float32
    param_dtype: str = "float32"  # storage dtype of params (optimizer moments follow)
    remat: bool = False  # recompute each layer's activations in the backward pass
    zero3: bool = False  # shard params, gradients and optimizer state over data x fsdp (ZeRO-3)
    # Layers per iteration of the layer scan. None: all of them on CPU hosts, where the unrolled
    # program measured a 13% faster SmolLM2 step for a 1.3x longer compile; 1 on accelerators,
    # where deep models make compile time matter more (not measured there).
    scan_unroll: int | None = None
    # Attention through the C++ CPU kernel (harnessrl.kernels.train_attention) where it applies:
    # a one-device CPU mesh, float32 compute, a Llama/Qwen-style decoder with head_dim a multiple
    # of 64. Elsewhere, and with False, XLA's attention.
    cpu_attention: bool = True
    # Objective (see harnessrl.learner.losses).
    eps_low: float = 0.2
    eps_high: float = 0.28  # asymmetric "clip-higher" keeps low-probability tokens learnable
    tis_cap: float = 2.0  # importance-weight truncation; math.inf disables
    kl_coef: float = 0.0  # k3 KL to the frozen initial policy; 0 skips the reference forward
    entropy_coef: float = 0.0
    # Optimizer (optax AdamW after global-norm clipping).
    learning_rate: float = 1e-5
    schedule: str = "constant"  # constant | cosine (warmup, then cosine to min_lr_ratio)
    warmup_steps: int = 0
    total_steps: int = 1000  # cosine horizon
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # math.inf disables
    # Checkpoints (orbax).
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 3
    checkpoint_every: int = 10
    async_checkpoint: bool = True

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {DTYPES}")
        if self.scan_unroll is not None and (
            isinstance(self.scan_unroll, bool)
            or not isinstance(self.scan_unroll, int)
            or self.scan_unroll < 1
        ):
            raise ValueError(
                f"scan_unroll={self.scan_unroll!r} must be a positive integer or None (automatic)"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate={self.learning_rate!r} must be a positive number")
        positive_ints = ("total_steps", "keep_checkpoints", "checkpoint_every")
        for name in positive_ints:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps!r} must be an integer in [0, total_steps="
                f"{self.total_steps}]"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"b1={self.b1!r} and b2={self.b2!r} must be in [0, 1)")
        if self.weight_decay < 0 or not self.grad_clip_norm > 0:
            raise ValueError(
                f"need weight_decay >= 0 and grad_clip_norm > 0, got {self.weight_decay=}, "
                f"{self.grad_clip_norm=}"
            )

    def replace(self, **changes: object) -> LearnerConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
