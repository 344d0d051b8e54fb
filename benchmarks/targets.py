"""The project's speed targets, checked by `torch-r3 bench --check-targets` only.

This file is part of the checkout, not of the installed package: the targets
are the project's yardstick, not something a user's report needs. The CLI
loads it from here (`torch_r3.bench.checkout.load_targets`), so
`--check-targets` works only from a checkout (an editable install included).

They are set for the default shape (256 trajectories of at most 8192 tokens,
40 layers, top-8, `uint8`, uniform lengths) on a quiet 2-core machine, and
judged on the medians of one run. They are the project's yardstick, not
something a user's report needs, so the default report does not print them.

The DataLoader target is judged against the memcpy floor, as set. Beside it,
not instead of it, `--check-targets` prints the same batch time against the
gather floor (each batch's own source arrays copied from where they live, see
`torch_r3.bench.dataloader.GatherFloor`) and what the gap is made of: what
copying the batch's own sources into the padded layout costs beyond one
cache-warm contiguous copy, and what the collator and the `DataLoader` add
beyond copying those sources.
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
    Target(
        "dataloader_vs_floor",
        "DataLoader num_workers=0, recycled collator, pin_memory off: median per batch / memcpy floor per batch",
        "<=",
        1.5,
    ),
    Target("steady_peak_memory", "peak memory of the steady loop / (input + 2 batches + 1 MiB)", "<=", 1.0),
)
# Resident memory the steady loop may add beyond its two batches: the
# interpreter's and NumPy's small objects, which the RSS measurement counts.
_BOOKKEEPING = 1 << 20


def _judged_loader(result: BenchResult):
    """The DataLoader row the target judges: `num_workers=0`, `pin_memory` off, recycled collator."""
    return result.dataloader.get(0, False, "recycled") if result.dataloader else None


def _measure(result: BenchResult) -> dict[str, float | None]:
    main = result.main
    steady, base, floor = main.get(STEADY), main.get(BASELINE), main.get(MEMCPY)
    loader = _judged_loader(result)
    return {
        "steady_vs_memcpy": steady.median_s / floor.median_s if steady and floor else None,
        "steady_vs_baseline": base.median_s / steady.median_s if steady and base else None,
        "dataloader_vs_floor": loader.ratio_to_floor if loader else None,
        "steady_peak_memory": (
            steady.peak_bytes / (main.input_bytes + 2 * main.padded_bytes + _BOOKKEEPING) if steady else None
        ),
    }


def _beside(result: BenchResult) -> dict[str, dict[str, Any]]:
    """Figures printed beside a target, never judged: the DataLoader batch against the gather floor."""
    d = result.dataloader
    loader = _judged_loader(result)
    if loader is None or loader.batch_s is None:
        return {}
    return {
        "dataloader_vs_floor": {
            "vs_gather_floor": loader.ratio_to_gather_floor,
            "batch_s": loader.batch_s,
            "memcpy_floor_s": d.floor_batch_s,
            "gather_floor_s": d.gather_floor_batch_s,
        }
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
        when not measured) and `met`. The DataLoader target, when measured,
        also carries `beside`: `vs_gather_floor` (the same median per batch
        over the gather floor; None without one), `batch_s`, `memcpy_floor_s`
        and `gather_floor_s`. They are context only: `met` depends on `value`
        alone.
    """
    values = _measure(result)
    beside = _beside(result)
    out = []
    for t in TARGETS:
        value = values[t.name]
        met = value is not None and (value <= t.threshold if t.op == "<=" else value >= t.threshold)
        out.append({"name": t.name, "what": t.what, "op": t.op, "threshold": t.threshold, "value": value, "met": met})
        if t.name in beside:
            out[-1]["beside"] = beside[t.name]
    return out


def targets_met(checked: list[dict[str, Any]]) -> bool:
    """Whether every target of `check_targets`'s answer is met (the exit status of `--check-targets`)."""
    return all(t["met"] for t in checked)


def _gap_lines(beside: dict[str, Any]) -> list[str]:
    gather = beside["gather_floor_s"]
    if gather is None:
        return []
    ms = {k: beside[k] * 1e3 for k in ("batch_s", "memcpy_floor_s", "gather_floor_s")}
    return [
        f"         beside it, not judged: {beside['vs_gather_floor']:.2f} against the gather floor (the batch's own "
        f"source arrays copied from where they live)",
        f"         the gap to the memcpy floor, {ms['batch_s']:.1f} - {ms['memcpy_floor_s']:.1f} ms per batch: "
        f"{ms['gather_floor_s'] - ms['memcpy_floor_s']:+.1f} ms copying the batch's own sources from where they "
        f"live, trajectory by trajectory into the padded layout, rather than one cache-warm buffer (gather floor "
        f"{ms['gather_floor_s']:.1f} ms), "
        f"{ms['batch_s'] - ms['gather_floor_s']:+.1f} ms the collator and DataLoader beyond that copy",
    ]


def format_targets(checked: list[dict[str, Any]]) -> str:
    """The targets as report lines, one per target, `met` or `MISSED` first.

    Under the DataLoader target, when its result carries a gather floor, two
    more lines: its ratio to the gather floor, and what the gap to the memcpy
    floor is made of. They do not change whether the target is met.

    Examples:
        >>> checked = [{"name": "dataloader_vs_floor", "what": "DataLoader / memcpy floor", "op": "<=",
        ...             "threshold": 1.5, "value": 2.4, "met": False,
        ...             "beside": {"vs_gather_floor": 1.2, "batch_s": 0.012, "memcpy_floor_s": 0.005,
        ...                        "gather_floor_s": 0.01}}]
        >>> print(format_targets(checked))  # doctest: +NORMALIZE_WHITESPACE
        targets (default shape, quiet 2-core machine, medians of one run):
          [MISSED] DataLoader / memcpy floor: 2.40 (target <= 1.5)
                   beside it, not judged: 1.20 against the gather floor (the batch's own source arrays copied
                   from where they live)
                   the gap to the memcpy floor, 12.0 - 5.0 ms per batch: +5.0 ms copying the batch's own sources
                   from where they live, trajectory by trajectory into the padded layout, rather than one cache-warm
                   buffer (gather floor 10.0 ms), +2.0 ms the collator and DataLoader beyond that copy
    """
    lines = ["targets (default shape, quiet 2-core machine, medians of one run):"]
    for t in checked:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(
            f"  [{'met' if t['met'] else 'MISSED'}] {t['what']}: {value} (target {t['op']} {t['threshold']:g})"
        )
        if "beside" in t:
            lines += _gap_lines(t["beside"])
    return "\n".join(lines)
