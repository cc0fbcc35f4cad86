"""Benchmark: engine decode tokens/s with the decode matmul kernel against XLA's dots, same run.

For each weight precision, two engines serve the same model, one with `cpu_kernels` on and one
off; rounds of 8 concurrent requests alternate between them (so a change in the host's load hits
both), and each engine's tokens/s is the median over the rounds. No HTTP: this isolates the
engine's steps (prefill and decode) from the server around them.
Last line: `matvec: speedup=<lowest median ratio> tokens_per_s_kernel_<dtype>=<x>
tokens_per_s_xla_<dtype>=<y> speedup_<dtype>=<z> ...`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from harnessrl.benchmarks.device import CONCURRENCY, decode_round
from harnessrl.engine import cpu_kernels
from harnessrl.engine.decode import Engine
from harnessrl.serve.config import ServeConfig


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.benchmarks.cpu_kernels", description=__doc__
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | HF folder | .gguf | tiny")
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weight-dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.weight_dtypes.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--weight-dtypes takes float32 and/or bfloat16, got {args.weight_dtypes!r}")
    if args.rounds < 1 or args.prompt < 1 or args.tokens < 1:
        parser.error("--rounds, --prompt and --tokens must be at least 1")
    if not cpu_kernels.load():
        raise SystemExit("cpu_kernels: the kernels cannot run here (see the log line above)")
    from harnessrl.model.formats.load import load_policy

    model, _ = load_policy(args.model)
    eos = [] if model.cfg.eos_token_id is None else [model.cfg.eos_token_id]
    vocab = model.cfg.vocab_size
    fields, speedups = [], []
    for dtype in dtypes:
        rates: dict[bool, list[float]] = {True: [], False: []}
        engines = {}
        for kernel in (True, False):
            config = ServeConfig(
                num_slots=CONCURRENCY,
                max_model_len=1024,
                weight_dtype=dtype,
                cpu_kernels=kernel,
            )
            engines[kernel] = Engine(model, eos, config)
            engines[kernel].warm_up()
            engines[kernel].start()
            decode_round(engines[kernel], args.prompt, 4, vocab)  # first-use costs
        try:
            for i in range(args.rounds):
                for kernel in (True, False) if i % 2 == 0 else (False, True):
                    rate = decode_round(engines[kernel], args.prompt, args.tokens, vocab)
                    rates[kernel].append(rate)
                print(
                    f" {dtype} round {i + 1}: kernel {rates[True][-1]:.1f} tok/s, "
                    f"XLA dots {rates[False][-1]:.1f} tok/s"
                )
        finally:
            for engine in engines.values():
                engine.stop()
        ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
        speedup = statistics.median(ratios)
        speedups.append(speedup)
        fields.append(
            f"tokens_per_s_kernel_{dtype}={statistics.median(rates[True]):.1f} "
            f"tokens_per_s_xla_{dtype}={statistics.median(rates[False]):.1f} "
            f"speedup_{dtype}={speedup:.2f}"
        )
    print(f"cpu_kernels: speedup={min(speedups):.2f} {' '.join(fields)}")


if __name__ == "__main__":
    main()
