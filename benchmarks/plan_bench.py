"""How long `torch_r3.plan_microbatches` takes for one rank's step, at 1024 and 8192 samples.

Every rank plans the step itself, every step, so the planner's time is paid by every
rank. Three shapes: trajectories just over half the token cap (each micro-batch holds one:
the planner's worst case), one sample per micro-batch, and RL-like lengths under both a
sample and a token cap. Prints the median of `--rounds` runs per point (the rounds of the
points interleaved, so a busy machine slows all of them alike).

    PYTHONPATH=. python benchmarks/plan_bench.py [--samples 1024,8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from torch_r3 import plan_microbatches


def shapes(n: int) -> dict[str, tuple[list[int], dict[str, int]]]:
    rng = np.random.default_rng(0)
    return {
        "just over half the token cap": (
            (4097 + rng.integers(0, 400, n)).tolist(),
            {"max_tokens_per_microbatch": 8192},
        ),
        "micro_batch_size=1": (rng.integers(100, 8192, n).tolist(), {"micro_batch_size": 1}),
        "RL lengths, 8 samples / 32k tokens": (
            rng.integers(200, 16384, n).tolist(),
            {"micro_batch_size": 8, "max_tokens_per_microbatch": 32768},
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="1024,8192", help="samples per step, comma-separated")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks (1: the whole step on one rank)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    points = [
        (n, name, counts, limits)
        for n in map(int, args.samples.split(","))
        for name, (counts, limits) in shapes(n).items()
    ]
    times: dict[tuple[int, str], list[float]] = {(n, name): [] for n, name, _, _ in points}
    for _ in range(args.rounds):
        for n, name, counts, limits in points:
            t0 = time.perf_counter()
            plan = plan_microbatches(counts, dp_size=args.dp_size, **limits)
            times[(n, name)].append(time.perf_counter() - t0)
            assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(n))
    print(
        f"{'samples':>8}  {'shape':<36} {'median ms':>10} {'min ms':>8}   (dp_size={args.dp_size}, {args.rounds} rounds)"
    )
    for (n, name), ts in times.items():
        print(f"{n:>8}  {name:<36} {1e3 * statistics.median(ts):>10.1f} {1e3 * min(ts):>8.1f}")


if __name__ == "__main__":
    main()
