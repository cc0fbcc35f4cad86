"""Benchmark: traces -> packed micro-batches on synthetic agent-like rollouts.

Each run makes 1-40 calls whose prompts grow by heavy-tailed tool outputs and completions
(sequences of 100 to 32k tokens, some runs break into several sequences). Measures packing
efficiency (real tokens / array slots) against padding every sequence to the step's longest,
host throughput of `build_step` (merge, advantages, weights, split, pack; tokens per CPU-second
of the single-threaded pipeline, with wall-clock alongside), and the number of
distinct array shapes over all steps. Last line: `packing: efficiency=... shapes=...`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from harnessrl.data.pipeline import DataConfig, StepTraces, build_step
from harnessrl.traces.schema import CallRecord, Choice, EndpointKind, RolloutRecord, RolloutState

BUCKETS = ((16, 2048), (8, 4096), (4, 8192), (2, 16384), (1, 32768))  # 32k slots each
MAX_LEN = 32768


def _heavy(rng: np.random.Generator, median: float, lo: int, hi: int) -> int:
    """Log-normal with a wide sigma: mostly short, sometimes very long."""
    return int(np.clip(rng.lognormal(np.log(median), 1.3), lo, hi))


def _run_calls(rng: np.random.Generator, rollout_id: str) -> list[CallRecord]:
    target = _heavy(rng, 3000, 100, MAX_LEN)  # this run's context length
    n_calls = int(rng.integers(1, 41))
    context = np.zeros(0, np.int64)
    calls = []
    for seq in range(n_calls):
        if context.size and rng.random() < 0.08:
            context = context[: len(context) // 2]  # the harness compacts its history: a break
        room = target - len(context)
        if room < 4 and context.size:
            break
        share = max(2, room // max(1, n_calls - seq))
        delta = min(max(1, room // 2), _heavy(rng, share * 0.6, 1, MAX_LEN))
        comp = max(1, min(room - delta, _heavy(rng, share * 0.4, 1, 4096)))
        prompt_ids = np.concatenate([context, rng.integers(3, 49152, delta)])
        completion_ids = rng.integers(3, 49152, comp)
        # Fresh int objects per call, as a store yields after parsing: no shared-object shortcuts.
        prompt, completion = tuple(prompt_ids.tolist()), tuple(completion_ids.tolist())
        logprobs = tuple((-rng.random(comp)).tolist())
        calls.append(
            CallRecord(
                rollout_id, seq, 0.0, 0.0, EndpointKind.CHAT, {}, {}, prompt,
                (Choice(0, completion, logprobs, "stop"),), 0, "bench", 0.0, 200,
            )
        )  # fmt: skip
        context = np.concatenate([prompt_ids, completion_ids])
    return calls


def make_step(rng: np.random.Generator, step: int, groups: int, group_size: int) -> StepTraces:
    runs: list[RolloutRecord] = []
    calls: dict[str, list[CallRecord]] = {}
    for g in range(groups):
        for k in range(group_size):
            rid = f"s{step}-g{g}-r{k}"
            reward = float(rng.random() < 0.4)
            runs.append(
                RolloutRecord(
                    rid, f"t{g}", f"s{step}-g{g}", state=RolloutState.SUCCEEDED, reward=reward
                )
            )
            calls[rid] = _run_calls(rng, rid)
    return StepTraces(runs, calls)


def padmax_slots(lengths: Sequence[int]) -> int:
    """Slots when every sequence gets its own row padded to the step's longest sequence."""
    return len(lengths) * max(lengths) if lengths else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = DataConfig(
        buckets=BUCKETS, max_segments_per_row=256, split_overlap=1024, drop_zero_variance=False
    )
    rng = np.random.default_rng(args.seed)
    real = slots = pad_slots = 0
    elapsed = cpu = 0.0
    shapes: set[tuple[int, int]] = set()
    pad_shapes: set[tuple[int, int]] = set()
    micro = 0
    for step in range(args.steps):
        traces = make_step(rng, step, args.groups, args.group_size)
        t0, c0 = time.perf_counter(), time.process_time()
        batch = build_step(step, traces, cfg)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        real += batch.stats.real_tokens
        slots += batch.stats.slots
        micro += len(batch.micro_batches)
        shapes |= {b.shape for b in batch.micro_batches}
        lengths = [int(n) for b in batch.micro_batches for n in _segment_lengths(b.segment_ids)]
        pad_slots += padmax_slots(lengths)
        pad_shapes.add((len(lengths), max(lengths, default=0)))
    eff = real / slots
    pad_eff = real / pad_slots
    # CPU seconds of this (single-threaded) process: on a shared machine wall time also counts
    # other processes' turns; on an idle core the two agree.
    tps = real / cpu
    print(f"steps={args.steps} runs/step={args.groups * args.group_size} buckets={list(BUCKETS)}")
    print(f"tokens/step={real / args.steps:,.0f} micro-batches/step={micro / args.steps:.1f}")
    print(f"bucket packing : efficiency {eff:.3f}, {len(shapes)} distinct shapes")
    print(f"pad-to-max     : efficiency {pad_eff:.3f}, {len(pad_shapes)} distinct shapes")
    print(f"ratio          : {pad_slots / slots:.2f}x fewer array slots than pad-to-max")
    print(
        f"host throughput: {tps:,.0f} tokens per CPU-second (merge+advantages+weights+split+pack)"
    )
    print(
        f"                 {real / elapsed:,.0f} tokens per wall-second on this machine right now"
    )
    print(
        f"packing: efficiency={eff:.3f} padmax_efficiency={pad_eff:.3f} tokens_per_s={tps:.0f} shapes={len(shapes)}"
    )


def _segment_lengths(segment_ids: np.ndarray) -> np.ndarray:
    """Lengths of all segments of a micro-batch (vectorized over rows)."""
    flat = segment_ids + (np.arange(segment_ids.shape[0])[:, None] * (segment_ids.max() + 1))
    flat = flat[segment_ids > 0]
    return np.unique(flat, return_counts=True)[1]


if __name__ == "__main__":
    main()
