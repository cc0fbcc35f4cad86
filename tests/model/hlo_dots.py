"""The matrix products of a lowered program, read from its StableHLO text.

A float32 product whose precision is left to the backend runs as TF32 on NVIDIA GPUs and as one
bfloat16 pass on TPU; the model states HIGHEST on each one instead (`attention.PRECISION`). These
helpers let a test check that on CPU, where both spellings compute the same numbers.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

_OPS = ("stablehlo.dot_general", "stablehlo.dot ", "stablehlo.convolution")
_PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")
_OPERANDS = re.compile(r": \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")


class Dot(NamedTuple):
    precision: tuple[str, str]  # ("DEFAULT", "DEFAULT") where the program states none
    operands: tuple[str, str]  # element types, e.g. ("f32", "bf16")
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    line: str


def _type(tensor: str) -> tuple[tuple[int, ...], str]:
    *dims, element = tensor.split("x")
    return tuple(int(d) for d in dims), element


def dots(lowered: jax.stages.Lowered) -> list[Dot]:
    """Every dot_general (and any dot or convolution) of `lowered`, in program order."""
    found = []
    for line in lowered.as_text().splitlines():
        if not any(op in line for op in _OPS):
            continue
        operands = _OPERANDS.search(line)
        assert operands, f"unparsed product: {line.strip()}"
        (lhs_shape, lhs), (rhs_shape, rhs) = _type(operands[1]), _type(operands[2])
        precision = _PRECISION.search(line)
        stated = (precision[1], precision[2]) if precision else ("DEFAULT", "DEFAULT")
        found.append(Dot(stated, (lhs, rhs), (lhs_shape, rhs_shape), line.strip()))
    return found


def assert_all_highest(found: list[Dot]) -> None:
    """Some products, each stating HIGHEST for both operands."""
    assert found, "the program has no matrix products: nothing was checked"
    loose = [d.line for d in found if d.precision != ("HIGHEST", "HIGHEST")]
    assert not loose, f"{len(loose)} of {len(found)} products leave precision to the backend:\n" + (
        "\n".join(loose[:5])
    )
