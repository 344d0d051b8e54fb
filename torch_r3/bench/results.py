"""What a benchmark run found, as plain dataclasses (the `--json` schema).

Times are in seconds and sizes in bytes throughout; the report chooses units.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchResult", "DataLoaderResult", "DataLoaderRow", "ShapeResult", "StrategyResult"]

#: Version of the `--json` layout; bumped when a field changes meaning or goes away.
SCHEMA_VERSION = 4


@dataclass
class StrategyResult:
    """One strategy's figures on one batch.

    `peak_bytes` is the input plus the resident memory the call added at its
    peak (over `loop_calls` consecutive calls); `peak_ratio` is `peak_bytes /
    (input + output)`, None for a strategy that writes no batch. `speedup` is
    the median of the shape's `speedup_over` strategy over this one's (None
    when that strategy did not run).
    """

    name: str
    times_s: list[float]
    median_s: float
    min_s: float
    max_s: float
    bytes_written: int
    gb_per_s: float
    peak_extra_bytes: int
    peak_bytes: int
    peak_ratio: float | None
    loop_calls: int = 1
    speedup: float | None = None
    ratio_to_memcpy: float | None = None
    checked_against: str | None = None
    #: median over the gather floor of the same layout (`gather floor` or `packed gather floor`).
    ratio_to_gather: float | None = None


@dataclass
class ShapeResult:
    """Every strategy's figures on one batch.

    `speedup_over` names the strategy the `speedup` figures are taken over
    (None when none was: the report then leaves that column out).
    """

    config: dict[str, Any]
    label: str
    T: int
    tokens: int
    input_bytes: int
    padded_bytes: int
    packed_bytes: int
    workers: int
    peak_method: str
    strategies: list[StrategyResult]
    speedup_over: str | None = None

    def get(self, name: str) -> StrategyResult | None:
        """The result of strategy `name`, or None if it did not run."""
        return next((s for s in self.strategies if s.name == name), None)


@dataclass
class DataLoaderRow:
    """One `DataLoader` configuration: batches as a `for batch in loader` loop receives them.

    `batch_s` is the median wait for one batch over the timed epochs, `epoch_s`
    the median wall time of a whole epoch; `ratio_to_floor` compares `batch_s`
    with the memcpy floor (a cache-warm contiguous copy of as many bytes as a
    batch), `ratio_to_gather_floor` with the gather floor (each batch's own
    source arrays copied from where they live into a warm buffer, see
    `torch_r3.bench.dataloader.GatherFloor`). `skipped` says why a
    configuration did not run (e.g. `pin_memory` without an accelerator); its
    figures are then None.
    """

    num_workers: int
    pin_memory: bool
    collator: str
    skipped: str | None = None
    batch_times_s: list[float] = field(default_factory=list)
    batch_s: float | None = None
    batch_min_s: float | None = None
    batch_max_s: float | None = None
    epoch_times_s: list[float] = field(default_factory=list)
    epoch_s: float | None = None
    ratio_to_floor: float | None = None
    ratio_to_gather_floor: float | None = None


@dataclass
class DataLoaderResult:
    """The `--dataloader` table: every configuration on the same dataset, and the two floors beside them.

    `floor_batch_s` and `floor_epoch_s` are the memcpy floor: per batch, one
    contiguous copy of as many bytes as the batch's output from the same warm
    source into the same warm destination, which a large last-level cache
    holds. `gather_floor_batch_s` and `gather_floor_epoch_s` are the gather
    floor: per batch, that batch's own source arrays, in their own memory,
    copied into a warm destination in the padded layout (None when not
    measured). Both run on as many threads as the collator's pool.
    """

    batch_size: int
    num_batches: int
    batch_bytes: int
    floor_batch_s: float
    floor_epoch_s: float
    epochs: int
    rows: list[DataLoaderRow]
    gather_floor_batch_s: float | None = None
    gather_floor_epoch_s: float | None = None

    def get(self, num_workers: int, pin_memory: bool, collator: str) -> DataLoaderRow | None:
        """The row of one configuration, or None if it was not part of the run."""
        return next(
            (r for r in self.rows if (r.num_workers, r.pin_memory, r.collator) == (num_workers, pin_memory, collator)),
            None,
        )


@dataclass
class BenchResult:
    """A full run: the main shape, the `typical_rl` packed-vs-padded pair, the sweep, the DataLoader table.

    `load_after` is the 1-minute load average when the run ended (the run's own
    threads included), `thp_mode` the transparent-hugepage mode its outputs and
    floors were mapped under, and `busy` why its figures cannot be trusted
    (`torch_r3.bench.trust.busy_reasons`; empty when nothing says so).
    """

    main: ShapeResult
    packed_vs_padded: ShapeResult | None
    sweep: list[ShapeResult]
    dataloader: DataLoaderResult | None
    topology: dict[str, Any]
    memory_needed_bytes: int
    wall_s: float
    peak_rss_bytes: int | None
    versions: dict[str, str] = field(default_factory=dict)
    timestamp: str = ""
    load_after: float | None = None
    thp_mode: str | None = None
    busy: list[str] = field(default_factory=list)

    def to_json(self, targets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A JSON-serialisable dict (the `--json` layout); `targets` only when they were checked."""
        out = {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}
        if targets is not None:
            out["targets"] = targets
        return out
