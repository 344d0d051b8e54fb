"""Whether a run's figures can be trusted: a busy machine makes every ratio meaningless.

Two signs, both read from the run itself:

- the 1-minute load average when the run started: above the usable CPUs,
  other work already wanted every CPU the run would use (the run's own
  threads come on top);
- the spread of a floor's interleaved rounds: a floor does the same fixed
  work every round, so when its slowest round takes more than
  `SPREAD_LIMIT` times its fastest, something else took the CPUs or the
  memory bus during the run.

The report prints a warning for each, and `--check-targets` refuses to judge.
"""

from __future__ import annotations

from torch_r3.bench.results import BenchResult
from torch_r3.bench.strategies import FLOORS

__all__ = ["BUSY_LOAD_PER_CPU", "SPREAD_LIMIT", "busy_reasons"]

#: Load average per usable CPU, at the start of a run, above which the machine counts as busy.
BUSY_LOAD_PER_CPU = 1.0
#: Slowest over fastest round of a floor above which the machine counts as busy.
SPREAD_LIMIT = 1.5


def busy_reasons(result: BenchResult) -> list[str]:
    """Why `result`'s figures cannot be trusted, one sentence per reason; empty when nothing says so.

    Examples:
        >>> from torch_r3.bench.results import ShapeResult
        >>> main = ShapeResult({}, "", 1, 1, 1, 1, 1, 2, "", [])
        >>> result = BenchResult(main, None, [], None, {"loadavg_1min": 27.8, "usable_cpus": 2.0}, 0, 1.0, None)
        >>> busy_reasons(result)  # doctest: +ELLIPSIS
        ['the load average was 27.80 when the run started, on 2 usable CPUs: ...']
    """
    reasons = []
    load, usable = result.topology.get("loadavg_1min"), result.topology.get("usable_cpus") or 1.0
    if load is not None and load > BUSY_LOAD_PER_CPU * usable:
        reasons.append(
            f"the load average was {load:.2f} when the run started, on {usable:g} usable CPUs: "
            f"other work already wanted every CPU this run uses"
        )
    for floor in (result.main.get(name) for name in FLOORS):
        if floor is None or len(floor.times_s) < 2 or floor.min_s <= 0:
            continue
        spread = floor.max_s / floor.min_s
        if spread > SPREAD_LIMIT:
            reasons.append(
                f"the {floor.name}'s rounds ranged from {floor.min_s * 1e3:.1f} to {floor.max_s * 1e3:.1f} ms "
                f"({spread:.2f}x, more than {SPREAD_LIMIT:g}x): something else used the CPUs or memory meanwhile"
            )
    return reasons
