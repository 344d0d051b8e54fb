"""The report of a run: the terminal tables and the `--plot` chart.

Units scale with the values (one unit per column), and a shape whose floor is
too fast to time says so instead of printing ratios of timer noise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch_r3.bench.results import BenchResult, DataLoaderResult, ShapeResult
from torch_r3.bench.strategies import MEMCPY, registered
from torch_r3.bench.units import format_bytes, format_gib, format_rate, format_ratio, number, time_unit

__all__ = [
    "GATHER_FLOOR_LABEL",
    "MEMCPY_FLOOR_LABEL",
    "TOO_SMALL_BYTES",
    "format_dataloader_table",
    "format_legend",
    "format_report",
    "format_table",
    "plot_sweep",
]

#: Below this many bytes of padded output a call takes well under a millisecond
#: here, its fixed costs (Python, thread hand-offs) swamp its copying, and ratios
#: between strategies say little about the memory system.
TOO_SMALL_BYTES = 32 * 10**6


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = []
    for k, r in enumerate([head, *rows]):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(shape: ShapeResult) -> str:
    """The strategies of one batch as an aligned text table (times and sizes in scaled units).

    The speed-up column, `vs <strategy>`, is there when the shape has a
    `speedup_over` strategy (`torch_r3.bench.run_shape`), and left out when not.

    Args:
        shape: one batch's results.

    Returns:
        The table, header first.
    """
    strategies = shape.strategies
    over = shape.speedup_over
    t_name, t_scale = time_unit([s.min_s for s in strategies])
    head = (
        "strategy",
        f"median {t_name}",
        f"min {t_name}",
        f"max {t_name}",
        "throughput",
        *([f"vs {over}"] if over else []),
        "vs memcpy",
        "vs gather",
        "peak memory",
        "peak/(in+out)",
        "checked",
    )
    rows = []
    for s in strategies:
        check = "-" if s.name == MEMCPY else ("reference" if s.checked_against is None else "identical")
        peak = format_bytes(s.peak_bytes) + (f" ({s.loop_calls} calls)" if s.loop_calls > 1 else "")
        rows.append(
            (
                s.name,
                number(s.median_s / t_scale),
                number(s.min_s / t_scale),
                number(s.max_s / t_scale),
                format_rate(s.gb_per_s * 1e9),
                *([format_ratio(s.speedup)] if over else []),
                format_ratio(s.ratio_to_memcpy),
                format_ratio(s.ratio_to_gather),
                peak,
                format_ratio(s.peak_ratio),
                check,
            )
        )
    return _table(head, rows)


def format_legend(shape: ShapeResult) -> list[str]:
    """One line per strategy of `shape`: what it is (its `Strategy.description`; empty for one not registered)."""
    known = registered()
    width = max(len(s.name) for s in shape.strategies)
    return [f"  {s.name:<{width}}  {known[s.name].description if s.name in known else ''}" for s in shape.strategies]


def _columns_line(shape: ShapeResult) -> str:
    over = f"vs {shape.speedup_over}: its median over each strategy's (the speed-up); " if shape.speedup_over else ""
    return (
        f"{over}vs gather: against the gather floor of the same layout; "
        f"peak = input + resident memory the call added ({shape.peak_method})"
    )


def _memory_line(result: BenchResult) -> str:
    mode = result.thp_mode
    if mode in ("madvise", "always"):
        how = "fresh outputs and the floors' buffers are hugepage-advised alike"
    elif mode == "never":
        how = "off: fresh outputs and the floors are on 4 KiB pages, so every ratio is to the small-page floor"
    else:
        how = "unknown here: outputs and floors use the OS's default pages alike"
    return f"transparent hugepages: {mode or 'unknown'} ({how})"


def _busy_lines(result: BenchResult) -> list[str]:
    if not result.busy:
        return []
    return [f"WARNING: the machine was busy: {reason}" for reason in result.busy] + [
        "WARNING: the figures below say more about the other work than about collation; rerun on a quiet machine"
    ]


def _describe(shape: ShapeResult) -> str:
    return (
        f"{shape.label}: T={shape.T}, {shape.tokens:,} tokens; input {format_bytes(shape.input_bytes)}, "
        f"padded output {format_bytes(shape.padded_bytes)}, packed output {format_bytes(shape.packed_bytes)}; "
        f"{shape.workers} pool workers"
    )


def _too_small(shape: ShapeResult) -> list[str]:
    if shape.padded_bytes >= TOO_SMALL_BYTES:
        return []
    return [
        (
            f"note: this shape is too small to time: its padded output is {format_bytes(shape.padded_bytes)}, "
            f"under {format_bytes(TOO_SMALL_BYTES)}, so fixed per-call costs dominate and the ratios say little; "
            f"use a larger shape (the default writes 688 MB)"
        )
    ]


#: Row labels of the two floors in the DataLoader table.
MEMCPY_FLOOR_LABEL = "memcpy floor (cache-warm contiguous copy)"
GATHER_FLOOR_LABEL = "gather floor (each batch's own sources)"


def format_dataloader_table(loader: DataLoaderResult) -> str:
    """The `--dataloader` configurations as an aligned text table, both floors beside them.

    Every row carries its ratio to the memcpy floor (a cache-warm contiguous
    copy of as many bytes as a batch) and to the gather floor (each batch's own
    source arrays copied from where they live); a result without a gather
    floor shows `-` there.

    Args:
        loader: the DataLoader results.

    Returns:
        The table, header first, the two floors last, then one line per skipped configuration.

    Examples:
        >>> from torch_r3.bench.results import DataLoaderResult, DataLoaderRow
        >>> row = DataLoaderRow(0, False, "recycled", batch_times_s=[0.012], batch_s=0.012, batch_min_s=0.011,
        ...                     batch_max_s=0.02, epoch_times_s=[0.1], epoch_s=0.1, ratio_to_floor=2.4,
        ...                     ratio_to_gather_floor=1.2)
        >>> table = format_dataloader_table(DataLoaderResult(32, 8, 86_000_000, 0.005, 0.04, 3, [row], 0.01, 0.08))
        >>> print(table.splitlines()[2])  # doctest: +NORMALIZE_WHITESPACE
        0 off recycled 12.0 11.0 20.0 2.40x 1.20x 100
    """
    done = [r for r in loader.rows if r.skipped is None]
    gather = loader.gather_floor_batch_s
    t_name, t_scale = time_unit(
        [r.batch_min_s for r in done] + [loader.floor_batch_s] + ([gather] if gather is not None else [])
    )
    e_name, e_scale = time_unit([r.epoch_s for r in done] + [loader.floor_epoch_s])
    head = (
        "num_workers",
        "pin_memory",
        "collator",
        f"per batch {t_name}",
        f"min {t_name}",
        f"max {t_name}",
        "vs memcpy floor",
        "vs gather floor",
        f"epoch {e_name}",
    )
    rows = [
        (
            str(r.num_workers),
            "on" if r.pin_memory else "off",
            r.collator,
            number(r.batch_s / t_scale),
            number(r.batch_min_s / t_scale),
            number(r.batch_max_s / t_scale),
            format_ratio(r.ratio_to_floor),
            format_ratio(r.ratio_to_gather_floor),
            number(r.epoch_s / e_scale),
        )
        for r in done
    ]
    rows.append(
        (
            MEMCPY_FLOOR_LABEL,
            "",
            "",
            number(loader.floor_batch_s / t_scale),
            "",
            "",
            "1.00x",
            format_ratio(loader.floor_batch_s / gather) if gather else "-",
            number(loader.floor_epoch_s / e_scale),
        )
    )
    if gather is not None:
        rows.append(
            (
                GATHER_FLOOR_LABEL,
                "",
                "",
                number(gather / t_scale),
                "",
                "",
                format_ratio(gather / loader.floor_batch_s),
                "1.00x",
                number(loader.gather_floor_epoch_s / e_scale),
            )
        )
    skipped = [
        f"skipped: num_workers={r.num_workers}, pin_memory={'on' if r.pin_memory else 'off'}, {r.collator}: {r.skipped}"
        for r in loader.rows
        if r.skipped is not None
    ]
    return "\n".join([_table(head, rows), *skipped])


def _floors_note(loader: DataLoaderResult) -> list[str]:
    lines = [
        (
            "memcpy floor: per batch, one contiguous copy of as many bytes as its output, the same warm source "
            "and destination every batch (where the last-level cache holds them, it never reaches memory)"
        )
    ]
    if loader.gather_floor_batch_s is not None:
        lines.append(
            "gather floor: per batch, its own route and token arrays, in their own memory as the DataLoader "
            "hands them over, copied into a warm buffer in the padded layout, padding from a small "
            "template: the least a collator can cost for these bytes from where they live"
        )
    return lines


def format_report(result: BenchResult) -> str:
    """The terminal report of a run (what `torch-r3 bench` prints on stdout).

    Args:
        result: the run.

    Returns:
        The report, without a trailing newline.
    """
    t = result.topology
    c = result.main.config
    load = "load average unknown" if t["loadavg_1min"] is None else f"load average {t['loadavg_1min']:.2f}"
    lines = [
        (
            f"torch-r3 bench  ({c['repeats']} repeats after {c['warmup']} warm-up, medians; seed {c['seed']}; "
            f"torch_r3 {result.versions.get('torch_r3', '?')}, torch {result.versions.get('torch', '?')})"
        ),
        f"CPU: usable {t['usable_cpus']:g} (affinity {t['affinity_cpus']}, cgroup limit "
        f"{t['cgroup_cpu_limit'] if t['cgroup_cpu_limit'] is not None else 'none'}), pool workers "
        f"{t['pool_workers']}, torch threads {t['torch_num_threads']}, "
        f"OMP_NUM_THREADS={t['OMP_NUM_THREADS'] or 'unset'}, {load}"
        + ("" if result.load_after is None else f" at the start, {result.load_after:.2f} at the end"),
        _memory_line(result),
        *_busy_lines(result),
        "",
        _describe(result.main),
        format_table(result.main),
        "",
        *format_legend(result.main),
        _columns_line(result.main),
        *_too_small(result.main),
    ]
    pair = result.packed_vs_padded
    if pair is not None and pair is not result.main:
        lines += ["", "packed vs padded on typical_rl:", _describe(pair), format_table(pair)]
    if result.dataloader is not None:
        d = result.dataloader
        lines += [
            "",
            (
                f"DataLoader: {d.num_batches} batches of {d.batch_size} trajectories per epoch "
                f"(about {format_bytes(d.batch_bytes)} per batch), median of {d.epochs} timed epochs after one warm-up:"
            ),
            format_dataloader_table(d),
            *_floors_note(d),
        ]
    lines += [
        "",
        (
            f"wall {result.wall_s:.1f} s, process peak RSS "
            f"{format_gib(result.peak_rss_bytes) if result.peak_rss_bytes else '?'}"
        ),
    ]
    return "\n".join(lines)


def plot_sweep(result: BenchResult, path: str | os.PathLike) -> None:
    """Write a PNG chart: median time per strategy across the `num_sequences` sweep.

    Args:
        result: a run with a sweep (falls back to the main shape alone).
        path: the PNG to write.
    """
    import matplotlib  # lazy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result.sweep or [result.main]
    xs = [p.config["num_sequences"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name in [s.name for s in points[0].strategies]:
        ys = [p.get(name).median_s * 1e3 for p in points]
        lo = [y - p.get(name).min_s * 1e3 for y, p in zip(ys, points)]
        hi = [p.get(name).max_s * 1e3 - y for y, p in zip(ys, points)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("num_sequences")
    ax.set_ylabel("time per batch, ms (median, bars: min-max)")
    c = result.main.config
    ax.set_title(
        f"route collation: max {c['max_seqlen']} tokens, {c['num_layers']} layers, topk {c['topk']}, "
        f"{c['dtype']}, {c['distribution']}\n{result.topology['usable_cpus']:g} usable CPUs, "
        f"{result.main.workers} pool workers",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
