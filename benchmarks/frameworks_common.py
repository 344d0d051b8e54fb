"""What the cases of `benchmarks/frameworks.py` share: the route sizes, the trajectories, timing and tables.

SkyRL's and verl's modules are loaded behind bare parent packages, as the tests
load them (`tests/integrations/frameworks.py`): `load` and `installed` are
theirs. The case modules (`frameworks_skyrl`, `frameworks_verl`) read `L`, `K`,
`EXPERTS` and `rl_lengths` from here when they run, so that a test can shrink them.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from frameworks import installed, load

__all__ = [
    "EXPERTS",
    "K",
    "L",
    "installed",
    "load",
    "megatron_world_of_one",
    "report",
    "report_step",
    "rl_lengths",
    "routes_for",
    "timed",
]

L, K, EXPERTS = 40, 8, 128


def rl_lengths(batch: int, prompt: int, response: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt // 4, prompt + 1, batch).tolist()
    responses = np.clip(rng.lognormal(np.log(response / 3), 0.7, batch), 8, response).astype(int).tolist()
    return prompts, responses


def routes_for(prompts, responses, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, EXPERTS, (p + r - 1, L, K), dtype=np.uint8) for p, r in zip(prompts, responses)]


def timed(cases: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # a warm-up round, not counted (first-touch page faults, pool fills)
        run()
    for _ in range(rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            out = run()
            times[name].append(time.perf_counter() - t0)
            del out
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, medians: dict[str, float], nbytes: int, baseline: str) -> None:
    print(f"\n{title} ({nbytes / 1e6:.0f} MB of routes out)")
    print(f"{'':<52} {'median ms':>10} {'GB/s':>6} {'vs ' + baseline.split(':')[0]:>12}")
    for name, t in medians.items():
        print(f"{name:<52} {t * 1e3:>10.1f} {nbytes / t / 1e9:>6.2f} {medians[baseline] / t:>11.2f}x")


def report_step(medians: dict[str, float], tokens: int, width: int, baseline: str) -> None:
    """The table of a step's cases: per step, per token, and the speed-up over the first case (`baseline`'s)."""
    first = next(iter(medians))
    print(f"{'':<{width}} {'per step ms':>12} {'per token ns':>13} {'vs ' + baseline:>{len(baseline) + 4}}")
    for name, t in medians.items():
        speedup = medians[first] / t
        print(f"{name:<{width}} {t * 1e3:>12.1f} {t / tokens * 1e9:>13.1f} {speedup:>{len(baseline) + 3}.2f}x")


def megatron_world_of_one() -> None:
    """A process group and Megatron's model parallel state of one rank, unless they are set up already."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
