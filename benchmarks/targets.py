"""The project's speed targets, checked by `torch-r3 bench --check-targets` only.

This file is part of the checkout, not of the installed package: the targets
are the project's yardstick, not something a user's report needs. The CLI
loads it from here (`torch_r3.bench.checkout.load_targets`), so
`--check-targets` works only from a checkout (an editable install included).
Importing it registers the peers (`benchmarks/peers.py`): one target is the
speed-up over the baseline, so `--check-targets` runs them too.

They are set for the default shape (256 trajectories of at most 8192 tokens,
40 layers, top-8, `uint8`, uniform lengths) on a quiet 2-core machine, and
judged on the medians of the interleaved rounds of one run, each beside its
per-round ratios. A run that says the machine was busy
(`torch_r3.bench.trust`) is not judged at all. The floors' buffers are mapped
as the outputs are: where transparent hugepages are off, the targets are
judged against the small-page floors, and the report says so. They are the project's yardstick, not
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

from benchmarks.peers import BASELINE, COMPARE_ORDER
from torch_r3.bench.results import BenchResult, StrategyResult
from torch_r3.bench.strategies import (
    FRESH,
    GATHER,
    MEMCPY,
    PACKED_GATHER,
    PACKED_STEADY,
    STEADY,
)

__all__ = [
    "REQUIRED_STRATEGIES",
    "SPEEDUP_OVER",
    "STRATEGIES",
    "TARGETS",
    "Target",
    "check_targets",
    "format_targets",
    "targets_met",
]

#: The strategies whose medians the targets compare (`baseline` is a peer, `benchmarks/peers.py`).
REQUIRED_STRATEGIES = (BASELINE, FRESH, STEADY, PACKED_STEADY, GATHER, PACKED_GATHER, MEMCPY)
#: What `--check-targets` runs when `--strategies` is not given, and the strategy its speed-ups are over.
STRATEGIES = COMPARE_ORDER
SPEEDUP_OVER = BASELINE


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
    Target("fresh_vs_memcpy", "torch_r3 fresh median / memcpy limit median", "<=", 2.0),
    Target("steady_vs_gather", "torch_r3 steady median / gather floor median", "<=", 1.1),
    Target("packed_steady_vs_packed_gather", "torch_r3 packed steady median / packed gather floor median", "<=", 1.25),
)
# The targets that compare two strategies' medians: (numerator, denominator).
# Their per-round ratios are printed beside the medians.
_PAIRS = {
    "steady_vs_memcpy": (STEADY, MEMCPY),
    "steady_vs_baseline": (BASELINE, STEADY),
    "fresh_vs_memcpy": (FRESH, MEMCPY),
    "steady_vs_gather": (STEADY, GATHER),
    "packed_steady_vs_packed_gather": (PACKED_STEADY, PACKED_GATHER),
}
# Resident memory the steady loop may add beyond its two batches: the
# interpreter's and NumPy's small objects, which the RSS measurement counts.
_BOOKKEEPING = 1 << 20


def _judged_loader(result: BenchResult):
    """The DataLoader row the target judges: `num_workers=0`, `pin_memory` off, recycled collator."""
    return result.dataloader.get(0, False, "recycled") if result.dataloader else None


def _pair(result: BenchResult, name: str) -> tuple[StrategyResult | None, StrategyResult | None]:
    top, bottom = _PAIRS[name]
    return result.main.get(top), result.main.get(bottom)


def _measure(result: BenchResult) -> dict[str, float | None]:
    main = result.main
    steady = main.get(STEADY)
    loader = _judged_loader(result)
    values: dict[str, float | None] = {}
    for name in _PAIRS:
        top, bottom = _pair(result, name)
        values[name] = top.median_s / bottom.median_s if top and bottom else None
    values["dataloader_vs_floor"] = loader.ratio_to_floor if loader else None
    values["steady_peak_memory"] = (
        steady.peak_bytes / (main.input_bytes + 2 * main.padded_bytes + _BOOKKEEPING) if steady else None
    )
    return values


def _rounds(result: BenchResult, name: str) -> list[float] | None:
    """Round-by-round ratios of a two-strategy target (the rounds are interleaved: round r of each)."""
    if name not in _PAIRS:
        return None
    top, bottom = _pair(result, name)
    if top is None or bottom is None:
        return None
    return [a / b for a, b in zip(top.times_s, bottom.times_s)]


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
    table left out) counts as missed. When the run says the machine was busy
    (`result.busy`), no target is judged: each `met` is None, and
    `targets_met` is False.

    Args:
        result: a run of the default shape with `torch_r3 steady`, `baseline`,
            `memcpy limit` and the DataLoader table.

    Returns:
        One dict per target: `name`, `what`, `op`, `threshold`, `value` (None
        when not measured), `met` (None when not judged) and, for a target
        that compares two strategies, `rounds` (the ratio in each interleaved
        round). The DataLoader target, when measured,
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
        met: bool | None = value is not None and (value <= t.threshold if t.op == "<=" else value >= t.threshold)
        if result.busy:
            met = None  # a busy machine's figures judge nothing
        out.append({"name": t.name, "what": t.what, "op": t.op, "threshold": t.threshold, "value": value, "met": met})
        rounds = _rounds(result, t.name)
        if rounds is not None:
            out[-1]["rounds"] = rounds
        if t.name in beside:
            out[-1]["beside"] = beside[t.name]
    return out


def targets_met(checked: list[dict[str, Any]]) -> bool:
    """Whether every target of `check_targets`'s answer is met (the exit status of `--check-targets`).

    False when any was not judged (a busy machine): an unjudged target is not a met one.
    """
    return all(t["met"] is True for t in checked)


def _gap_lines(beside: dict[str, Any]) -> list[str]:
    gather = beside["gather_floor_s"]
    if gather is None:
        return []
    ms = {k: beside[k] * 1e3 for k in ("batch_s", "memcpy_floor_s", "gather_floor_s")}
    return [
        (
            f"         beside it, not judged: {beside['vs_gather_floor']:.2f} against the gather floor (the batch's own "
            f"source arrays copied from where they live)"
        ),
        (
            f"         the gap to the memcpy floor, {ms['batch_s']:.1f} - {ms['memcpy_floor_s']:.1f} ms per batch: "
            f"{ms['gather_floor_s'] - ms['memcpy_floor_s']:+.1f} ms copying the batch's own sources from where they "
            f"live, trajectory by trajectory into the padded layout, rather than one cache-warm buffer (gather floor "
            f"{ms['gather_floor_s']:.1f} ms), "
            f"{ms['batch_s'] - ms['gather_floor_s']:+.1f} ms the collator and DataLoader beyond that copy"
        ),
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
        targets (default shape, quiet 2-core machine, medians of interleaved rounds in one run):
          [MISSED] DataLoader / memcpy floor: 2.40 (target <= 1.5)
                   beside it, not judged: 1.20 against the gather floor (the batch's own source arrays copied
                   from where they live)
                   the gap to the memcpy floor, 12.0 - 5.0 ms per batch: +5.0 ms copying the batch's own sources
                   from where they live, trajectory by trajectory into the padded layout, rather than one cache-warm
                   buffer (gather floor 10.0 ms), +2.0 ms the collator and DataLoader beyond that copy
    """
    judged = all(t["met"] is not None for t in checked)
    lines = [
        "targets (default shape, quiet 2-core machine, medians of interleaved rounds in one run):"
        if judged
        else "targets NOT JUDGED: the machine was busy (see the warnings above); figures for the record only:"
    ]
    for t in checked:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        mark = "not judged" if t["met"] is None else "met" if t["met"] else "MISSED"
        lines.append(f"  [{mark}] {t['what']}: {value} (target {t['op']} {t['threshold']:g})")
        if t.get("rounds"):
            lines.append("         per round: " + ", ".join(f"{r:.2f}" for r in t["rounds"]))
        if "beside" in t:
            lines += _gap_lines(t["beside"])
    return "\n".join(lines)
