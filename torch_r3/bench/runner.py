"""Running the benchmark: check every strategy once, then time them in interleaved rounds.

`run_shape` times the strategies on one batch; `run` adds the `typical_rl`
packed-vs-padded pair, the optional `--plot` sweep and the optional
`--dataloader` table, after checking that the largest of them fits in memory.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_choice
from torch_r3.bench.config import BenchConfig, make_batch
from torch_r3.bench.dataloader import configurations, run_dataloader
from torch_r3.bench.memory import PeakRss, check_memory, collector_paused, estimate_memory, process_peak_rss
from torch_r3.bench.reference import Reference
from torch_r3.bench.results import BenchResult, ShapeResult, StrategyResult
from torch_r3.bench.strategies import (
    FRESH,
    GATHER,
    MEMCPY,
    PACKED,
    PACKED_GATHER,
    SERIAL,
    STRATEGIES,
    Context,
    get_strategy,
    registered,
)
from torch_r3.bench.trust import busy_reasons
from torch_r3.cpu import cpu_topology, loadavg_1min, pool_workers

__all__ = ["PAIR_STRATEGIES", "Plan", "Progress", "default_sweep", "memory_needed", "plan", "run", "run_shape"]


class Progress:
    """A one-line progress bar on stderr (only on a terminal, unless forced).

    Args:
        total: steps in the whole run.
        enabled: draw it (default: when `stream` is a terminal).
        stream: where to draw (default `sys.stderr`).
    """

    def __init__(self, total: int, enabled: bool | None = None, stream: Any = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()

    def step(self, label: str) -> None:
        """Count one step done and redraw."""
        self.done += 1
        if not self.enabled:
            return
        width = 28
        filled = int(width * min(self.done, self.total) / self.total)
        elapsed = time.perf_counter() - self.t0
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s  {label[:40]:<40}"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _steps(config: BenchConfig, strategies: Sequence[str]) -> int:
    return sum(get_strategy(s).loop_calls - 1 for s in strategies) + len(strategies) * (config.warmup + config.repeats)


@dataclass
class _Checked:
    """What the checked warm-up call of each strategy found."""

    peak_extra: dict[str, int]
    checked_against: dict[str, str | None]
    method: str


def _warm_up(ctx: Context, strategies: Sequence[str], warmup: int, progress: Progress | None) -> _Checked:
    """Run each strategy `warmup` times; its first call (or loop of calls) is measured and checked, never timed."""
    reference = Reference(ctx.batch.token_counts)
    peak_extra: dict[str, int] = {}
    method = ""
    for name in strategies:
        strategy = get_strategy(name)
        with PeakRss() as peak:
            out = strategy.call(ctx)
            for _ in range(strategy.loop_calls - 1):
                # As in `for batch in loader`: the previous batch is still
                # held while the next is made, and goes when `out` is rebound.
                out = strategy.call(ctx)
                if progress:
                    progress.step(f"{name} loop")
        # Checked outside the measured block: the check's own copies (the
        # packed reference) are not the strategy's memory. In a loop the last
        # output is checked, the one written into a recycled buffer.
        reference.check(strategy, out)
        del out
        peak_extra[name], method = peak.extra, peak.method
        for _ in range(1, warmup):
            strategy.call(ctx)
        if progress:
            progress.step(f"{name} warm-up")
    checked = dict(reference.checked_against)
    reference.release()
    return _Checked(peak_extra, checked, method)


def _time_rounds(
    ctx: Context, strategies: Sequence[str], repeats: int, progress: Progress | None
) -> dict[str, list[float]]:
    """`repeats` rounds, each timing every strategy once (interleaved, so load from elsewhere hits all alike)."""
    times: dict[str, list[float]] = {s: [] for s in strategies}
    calls = [(name, get_strategy(name).call) for name in strategies]
    with collector_paused():
        for r in range(repeats):
            for name, call in calls:
                t0 = time.perf_counter()
                out = call(ctx)
                times[name].append(time.perf_counter() - t0)
                del out  # freed outside the timed region
                if progress:
                    progress.step(f"{name} {r + 1}/{repeats}")
    return times


def _summarise(
    config: BenchConfig,
    ctx: Context,
    strategies: Sequence[str],
    times: dict[str, list[float]],
    checked: _Checked,
    speedup_over: str | None,
) -> ShapeResult:
    batch = ctx.batch
    results = []
    for name in strategies:
        strategy = get_strategy(name)
        ts = times[name]
        med = float(np.median(ts))
        written = batch.packed_bytes if strategy.layout == "packed" else batch.padded_bytes
        out_bytes = written if strategy.layout is not None else 0
        peak_bytes = batch.input_bytes + checked.peak_extra[name]
        results.append(
            StrategyResult(
                name=name,
                times_s=ts,
                median_s=med,
                min_s=min(ts),
                max_s=max(ts),
                bytes_written=written,
                gb_per_s=written / med / 1e9,
                peak_extra_bytes=checked.peak_extra[name],
                peak_bytes=peak_bytes,
                peak_ratio=peak_bytes / (batch.input_bytes + out_bytes) if out_bytes else None,
                loop_calls=strategy.loop_calls,
                checked_against=checked.checked_against.get(name),
            )
        )
    by_name = {s.name: s for s in results}
    over = by_name.get(speedup_over or "")
    for s in results:
        layout = get_strategy(s.name).layout
        if over is not None:
            s.speedup = over.median_s / s.median_s
        if MEMCPY in by_name:
            s.ratio_to_memcpy = s.median_s / by_name[MEMCPY].median_s
        gather = by_name.get(GATHER if layout == "padded" else PACKED_GATHER if layout == "packed" else "")
        if gather is not None:
            s.ratio_to_gather = s.median_s / gather.median_s
    return ShapeResult(
        config=dataclasses.asdict(config),
        label=config.label,
        T=batch.T,
        tokens=sum(batch.token_counts),
        input_bytes=batch.input_bytes,
        padded_bytes=batch.padded_bytes,
        packed_bytes=batch.packed_bytes,
        workers=ctx.workers,
        peak_method=checked.method,
        strategies=results,
        speedup_over=over.name if over is not None else None,
    )


def _check_strategies(strategies: Sequence[str], speedup_over: str | None) -> None:
    known = tuple(registered())
    unknown = [s for s in strategies if s not in known]
    if unknown or not strategies:
        raise ValueError(f"strategies must be a non-empty selection of {known}, got {list(strategies)}")
    if speedup_over is not None:
        check_choice(speedup_over, "speedup_over", known)


def run_shape(
    config: BenchConfig,
    strategies: Sequence[str] = STRATEGIES,
    progress: Progress | None = None,
    speedup_over: str | None = SERIAL,
) -> ShapeResult:
    """Time `strategies` on the batch of `config`, all in this process.

    Phase 1 (warm-up): each strategy runs `config.warmup` times; its first call
    is the checked one (output compared with `torch.equal` to the first
    strategy's of the same layout, and peak memory measured). Phase 2:
    `config.repeats` rounds, each timing every strategy once, interleaved so
    that a burst of load from elsewhere on the machine hits all strategies alike.

    Args:
        config: the shape.
        strategies: names from `torch_r3.bench.strategies.registered()`
            (`STRATEGIES` and any registered since), in run order. The first
            one that produces an output of a layout is that layout's reference.
        progress: where to report each call.
        speedup_over: the strategy whose median each one's speed-up is taken
            over (`StrategyResult.speedup`); when it is not among `strategies`,
            or None, no speed-up is computed.

    Returns:
        The `ShapeResult`.

    Raises:
        ValueError: `strategies` is empty or names an unknown strategy, or
            `speedup_over` is not a registered strategy.
        AssertionError: a strategy's output differs from the reference.
    """
    _check_strategies(strategies, speedup_over)
    ctx = Context(make_batch(config), config.workers or pool_workers(), strategies)
    try:
        checked = _warm_up(ctx, strategies, config.warmup, progress)
        times = _time_rounds(ctx, strategies, config.repeats, progress)
        return _summarise(config, ctx, strategies, times, checked, speedup_over)
    finally:
        ctx.close()


def default_sweep(num_sequences: int) -> list[int]:
    """The `num_sequences` points of the `--plot` sweep: n/8, n/4, n/2, n.

    Examples:
        >>> default_sweep(256), default_sweep(2)
        ([32, 64, 128, 256], [1, 2])
    """
    return sorted({max(1, num_sequences // d) for d in (8, 4, 2, 1)})


@dataclass(frozen=True)
class Plan:
    """Every shape a run times: the main one, the packed-vs-padded pair, the sweep points.

    `pair_is_main` marks a main shape that is itself the pair (a `typical_rl`
    batch timed with both `torch_r3 fresh` and `torch_r3 packed`); `sweep` is
    empty when no sweep was asked for; `speedup_over` is the strategy the
    speed-ups are taken over (see `run_shape`).
    """

    config: BenchConfig
    strategies: tuple[str, ...]
    pair: BenchConfig | None
    pair_is_main: bool
    sweep: tuple[int, ...]
    speedup_over: str | None = SERIAL

    @property
    def sweep_shapes(self) -> list[BenchConfig]:
        """The sweep's shapes other than the main one."""
        return [dataclasses.replace(self.config, num_sequences=n) for n in self.sweep if n != self.config.num_sequences]

    @property
    def shapes(self) -> list[BenchConfig]:
        """Every shape, the main one first."""
        return [self.config, *([self.pair] if self.pair else []), *self.sweep_shapes]


#: The strategies of the packed-vs-padded comparison.
PAIR_STRATEGIES = (FRESH, PACKED)


def plan(
    config: BenchConfig,
    *,
    strategies: Sequence[str] = STRATEGIES,
    packed_vs_padded: bool = True,
    sweep: Sequence[int] | None = None,
    speedup_over: str | None = SERIAL,
) -> Plan:
    """The shapes `run` will time for these arguments.

    Args:
        config: the main shape.
        strategies: which strategies to time on it (and on the sweep).
        packed_vs_padded: also time `torch_r3 fresh` against `torch_r3 packed`
            on a `typical_rl` batch of the same size.
        sweep: `num_sequences` values to repeat the main run at (for the chart).
        speedup_over: the strategy the speed-up column is taken over (default
            `single-write serial`, torch_r3's kernel on one thread); the column
            is left out of a shape that does not run it.

    Returns:
        The `Plan`.

    Raises:
        ValueError: `strategies` is empty or names an unknown strategy, or
            `speedup_over` is not a registered strategy.
    """
    _check_strategies(strategies, speedup_over)
    pair_is_main = (
        packed_vs_padded and config.distribution == "typical_rl" and FRESH in strategies and PACKED in strategies
    )
    pair = dataclasses.replace(config, distribution="typical_rl") if packed_vs_padded and not pair_is_main else None
    return Plan(config, tuple(strategies), pair, pair_is_main, tuple(sweep or ()), speedup_over)


def memory_needed(run_plan: Plan) -> int:
    """Bytes the run of `run_plan` needs: its largest shape's `estimate_memory`."""
    return max(estimate_memory(c) for c in run_plan.shapes)


def run(
    run_plan: Plan,
    *,
    dataloader_batch_size: int | None = None,
    progress: bool | None = None,
    memory_probe: Callable[[], dict[str, Any]] | None = None,
) -> BenchResult:
    """The whole benchmark: the main shape, the packed-vs-padded pair, the sweep, the DataLoader table.

    The memory check comes first: `InsufficientMemoryError` is raised before
    anything is allocated.

    Args:
        run_plan: from `plan`.
        dataloader_batch_size: also time the DataLoader table on the main
            shape's trajectories, this many per batch
            (`torch_r3.bench.dataloader.run_dataloader`); None to skip it.
        progress: show a progress bar (default: when stderr is a terminal).
        memory_probe: returns `torch_r3.bench.memory.available_memory`'s dict;
            injectable for tests.

    Returns:
        The `BenchResult`.

    Raises:
        InsufficientMemoryError: the largest shape does not fit the memory available.
    """
    t0 = time.perf_counter()
    topology = cpu_topology()  # before the run, so that the load average is other work's
    need = memory_needed(run_plan)
    check_memory(need, run_plan.config.label, memory_probe)
    config, strategies = run_plan.config, run_plan.strategies
    total = _steps(config, strategies) + (_steps(config, PAIR_STRATEGIES) if run_plan.pair else 0)
    total += sum(_steps(c, strategies) for c in run_plan.sweep_shapes)
    total += len(list(configurations())) if dataloader_batch_size else 0
    bar = Progress(total, progress)
    try:
        over = run_plan.speedup_over
        main = run_shape(config, strategies, bar, over)
        pair = run_shape(run_plan.pair, PAIR_STRATEGIES, bar, over) if run_plan.pair else None
        if run_plan.pair_is_main:
            pair = main
        swept = [run_shape(c, strategies, bar, over) for c in run_plan.sweep_shapes]
        loader = run_dataloader(config, dataloader_batch_size, bar) if dataloader_batch_size else None
    finally:
        bar.close()
    points = sorted(swept + [main], key=lambda r: r.config["num_sequences"]) if run_plan.sweep else []
    from torch_r3 import __version__
    from torch_r3.collate._memory import thp_mode

    result = BenchResult(
        main=main,
        packed_vs_padded=pair,
        sweep=points,
        dataloader=loader,
        topology=topology,
        memory_needed_bytes=need,
        wall_s=time.perf_counter() - t0,
        peak_rss_bytes=process_peak_rss() or None,
        versions={
            "torch_r3": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": sys.version.split()[0],
        },
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_after=loadavg_1min(),
        thp_mode=thp_mode(),
    )
    result.busy = busy_reasons(result)
    return result
