"""The project's speed targets, checked by `torch-r3 bench --check-targets` only.

They are set for the default shape (256 trajectories of at most 8192 tokens,
40 layers, top-8, `uint8`, uniform lengths) on a quiet 2-core machine, and
judged on the medians of one run. They are the project's yardstick, not
something a user's report needs, so the default report does not print them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_r3.bench.results import BenchResult
from torch_r3.bench.strategies import BASELINE, MEMCPY, STEADY

__all__ = ["TARGETS", "Target", "check_targets", "format_targets", "targets_met"]


@dataclass(frozen=True)
class Target:
    """One target: the measured figure called `name` must satisfy `figure op threshold`."""

    name: str
    what: str
    op: str
    threshold: float


#: Every target, in the order they are printed.
TARGETS = (
    Target("steady_vs_memcpy", "torch_r3 steady median / memcpy limit median", "<=", 1.25),
    Target("steady_vs_baseline", "torch_r3 steady speed-up over baseline (medians)", ">=", 7.0),
    Target("dataloader_vs_floor", "DataLoader num_workers=0, recycled collator, pin_memory off: "
           "median per batch / memcpy floor per batch", "<=", 1.5),
    Target("steady_peak_memory", "peak memory of the steady loop / (input + 2 batches + 1 MiB)", "<=", 1.0),
)
# Resident memory the steady loop may add beyond its two batches: the
# interpreter's and NumPy's small objects, which the RSS measurement counts.
_BOOKKEEPING = 1 << 20


def _measure(result: BenchResult) -> dict[str, float | None]:
    main = result.main
    steady, base, floor = main.get(STEADY), main.get(BASELINE), main.get(MEMCPY)
    loader = result.dataloader.get(0, False, "recycled") if result.dataloader else None
    return {
        "steady_vs_memcpy": steady.median_s / floor.median_s if steady and floor else None,
        "steady_vs_baseline": base.median_s / steady.median_s if steady and base else None,
        "dataloader_vs_floor": loader.ratio_to_floor if loader else None,
        "steady_peak_memory": (steady.peak_bytes / (main.input_bytes + 2 * main.padded_bytes + _BOOKKEEPING)
                               if steady else None),
    }


def check_targets(result: BenchResult) -> list[dict[str, Any]]:
    """Judge every target on `result`.

    A target whose figure the run did not measure (a strategy or the DataLoader
    table left out) counts as missed.

    Args:
        result: a run of the default shape with `torch_r3 steady`, `baseline`,
            `memcpy limit` and the DataLoader table.

    Returns:
        One dict per target: `name`, `what`, `op`, `threshold`, `value` (None
        when not measured) and `met`.
    """
    values = _measure(result)
    out = []
    for t in TARGETS:
        value = values[t.name]
        met = value is not None and (value <= t.threshold if t.op == "<=" else value >= t.threshold)
        out.append({"name": t.name, "what": t.what, "op": t.op, "threshold": t.threshold, "value": value,
                    "met": met})
    return out


def targets_met(checked: list[dict[str, Any]]) -> bool:
    """Whether every target of `check_targets`'s answer is met (the exit status of `--check-targets`)."""
    return all(t["met"] for t in checked)


def format_targets(checked: list[dict[str, Any]]) -> str:
    """The targets as report lines, one per target, `met` or `MISSED` first."""
    lines = ["targets (default shape, quiet 2-core machine, medians of one run):"]
    for t in checked:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['what']}: {value} (target {t['op']} "
                     f"{t['threshold']:g})")
    return "\n".join(lines)
