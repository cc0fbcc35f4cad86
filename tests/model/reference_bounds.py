"""Float32 error bounds for the model tests, derived from numerics rather than from one machine.

Two kinds of comparison, two yardsticks:

* Against another implementation (transformers' PyTorch model): the reference is also run in
  float64, which gives the exact logits up to ~1e-16 relative, and the reference's *own* float32
  error against them is the yardstick. It grows with the model (SmolLM2's residual stream reaches
  ~2.5e4, so its float32 rounding reaches the logits at ~1e-4) and with how a backend orders its
  sums; measuring it in the same test on the same input moves with both.
* Between two of our own float32 evaluations of the same function that differ only in how sums
  are ordered or blocked (a KV-cache step vs the full forward, a packed row vs the sequence alone,
  attention over 8 vs 16 cache positions): a random-walk rounding model of the reductions.
"""

from __future__ import annotations

import math

import numpy as np

from harnessrl.model.families.dense.config import ModelConfig

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: one float32 rounding is at most EPS32/2 relative

# Our float32 error may be this many times the reference's own. Both implementations round the
# same operations once each; they differ in summation order (blocked FMA accumulators of different
# widths: a sequential run of K/b terms errs ~sqrt(K/b)*eps, so block sizes 4x apart give 2x) and
# in their vectorized exp/rsqrt (a few ulp apart). So the two errors are of the same order and
# their maxima over thousands of logits scatter around a ratio of 1: 3 covers a 2x blocking
# difference plus that scatter, while a real bug (wrong RoPE, a missing norm, a shifted mask)
# moves logits by 1e-2..1e1, hundreds of times the bound.
ERROR_RATIO = 3.0
# A floor, in ulps of the largest exact logit, so a reference that happens to round very little
# on some input cannot make the bound smaller than float32 can represent the logits themselves.
FLOOR_ULPS = 4.0


# Gradients go through the backward pass of every layer: each layer's reductions (weight gradients
# summed over tokens, activation gradients over features) round in their own order in each
# implementation, and those differences compound layer by layer instead of meeting once at the
# logits. So the two implementations' errors scatter further apart: on an Intel AVX-512 host, our
# float32 weight gradients of the tiny Qwen3.5 hybrid were 4-8.5x the reference's own error, with
# no parameter further off. 16 keeps the bound below 1e-4 relative on those gradients, while a
# real bug (a wrong mask, a missed norm or gate) moves them by 1e-2 relative or more.
GRADIENT_ERROR_RATIO = 16.0


def reference_bounds(
    ref32: np.ndarray, ref64: np.ndarray, ratio: float = ERROR_RATIO
) -> tuple[float, float, float]:
    """(reference's own float32 error, bound on ours vs float64, bound on ours vs reference fp32).

    Ours vs the float64 values: `ratio` times the reference's error, plus the floor. Ours vs the
    reference's float32 values: by the triangle inequality each is within its own error of the
    exact values, so they differ by at most the sum, (`ratio` + 1) times that error.
    """
    exact = np.asarray(ref64, np.float64)
    ref_error = float(np.abs(np.asarray(ref32, np.float64) - exact).max())
    floor = FLOOR_ULPS * EPS32 * float(np.abs(exact).max())
    return ref_error, ratio * ref_error + floor, (ratio + 1.0) * ref_error + floor


def assert_logits_match_reference(
    ours: np.ndarray, ref32: np.ndarray, ref64: np.ndarray, label: object = ""
) -> dict[str, float]:
    """Our float32 logits against a reference run in float32 and float64 on the same input.

    Also checks the argmax wherever the exact top-2 gap exceeds twice the bound (there no error
    within the bound can reorder them), and that such positions are the majority, so the check
    is not vacuous. Returns the measured errors for the caller's messages.
    """
    ours64, exact = np.asarray(ours, np.float64), np.asarray(ref64, np.float64)
    ref_error, vs_exact, vs_ref = reference_bounds(ref32, ref64)
    measured = {
        "ours_vs_float64": float(np.abs(ours64 - exact).max()),
        "ours_vs_reference_float32": float(np.abs(ours64 - np.asarray(ref32, np.float64)).max()),
        "reference_float32_error": ref_error,
        "bound_vs_float64": vs_exact,
        "bound_vs_reference": vs_ref,
    }
    assert measured["ours_vs_float64"] <= vs_exact, (label, measured)
    assert measured["ours_vs_reference_float32"] <= vs_ref, (label, measured)
    top2 = np.sort(exact, axis=-1)[..., -2:]
    decided = (top2[..., 1] - top2[..., 0]) > 2 * vs_exact
    assert decided.mean() > 0.5, (label, "too few positions with a clear argmax", decided.mean())
    np.testing.assert_array_equal(ours64.argmax(-1)[decided], exact.argmax(-1)[decided])
    return measured


def reorder_tolerance(cfg: ModelConfig, scale: float, length: int) -> float:
    """Largest difference between two float32 evaluations that differ only in summation order.

    Random-walk model: an n-term float32 sum errs by ~sqrt(n)*eps relative to its terms' scale;
    here n is the longest reduction (hidden, MLP or attention length), and each layer adds its
    error to the residual stream, so the logits err by ~L*sqrt(n)*eps*scale. Two evaluations
    differ by at most the sum of their errors (x2), and the model is a typical-case estimate, so
    allow another x2: 4*L*sqrt(n)*eps*scale. `scale` is the largest |logit| (or the largest
    magnitude of whatever is compared). For the tiny test config (L=2, n=64) that is 64 ulps of
    the scale; a decoding bug (a stale cache entry, a shifted position) moves logits by ~10% of it.
    """
    n = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, length)
    return 4.0 * cfg.num_layers * math.sqrt(n) * EPS32 * scale


def logprob_reorder_tolerance(cfg: ModelConfig, logit_scale: float, length: int) -> float:
    """`reorder_tolerance` carried through log_softmax, for logprobs of the same tokens.

    logprob = logit - logsumexp(logits): each of the two terms moves by at most the logits'
    reordering error, and the sum over the vocabulary itself rounds by ~sqrt(V) ulps (relative,
    hence absolute in its log) in each of the two evaluations.
    """
    logits = reorder_tolerance(cfg, logit_scale, length)
    return 2.0 * logits + 2.0 * math.sqrt(cfg.vocab_size) * EPS32


def assert_reordered_close(
    got: np.ndarray, want: np.ndarray, cfg: ModelConfig, length: int, scale: float | None = None
) -> None:
    """`got` equals `want` within `reorder_tolerance` of `scale` (default: max |want|)."""
    want64 = np.asarray(want, np.float64)
    scale = float(np.abs(want64).max()) if scale is None else scale
    tol = reorder_tolerance(cfg, scale, length)
    diff = float(np.abs(np.asarray(got, np.float64) - want64).max())
    assert diff <= tol, f"max |diff| {diff:.3g} > {tol:.3g} (4*L*sqrt(n) ulps of {scale:.3g})"
