"""`torch-r3 report RUN.jsonl`: one self-contained HTML page of a run log's R3 figures.

The page holds its figures as inlined PNGs (no script, no server, no network), and
optionally writes them beside it as files. Figures, where the log has what they need:

* `drift`: route drift per layer over steps (a heat map), one panel per run;
* `curves`: mean drift and the uncaptured share (real tokens routed live or given filler
  routes, over all real tokens; padding is not counted) over steps;
* `load`: expert load per layer at the last step: the busiest expert over the mean, from
  the rollout's routes and from the trainer's own choice (`ReplayHook(expert_load=True)`);
* `on_off`: R3 on vs off: every other metric the runs share (a loss, a log-prob gap), for
  the runs whose `replay` meta is true against those where it is false.

A log of one step (one demo run) is drawn as bars, not as one-column heat maps and lone
dots; a long one as heat maps and lines whose step axis keeps a readable number of ticks.
Names (runs, metrics) are drawn as written: a `$` is a dollar sign, never matplotlib's
mathtext. A NaN or infinite value is left out of the plots and shown in the table.

A run is the `run` meta of a line (one unnamed run without it). Lines of several ranks
for one step are averaged, and the page says so (write one rank's line after
`reduce_stats` for exact figures); the mean of `inf` and `-inf` is NaN, and finite values whose
sum overflows still have their finite mean. Two lines of one run, step and rank (a run appended to
a log twice) are not averaged: the last is kept, with a `UserWarning` and a note on the page.
Needs matplotlib (`pip install 'torch_r3[bench]'`).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_r3._deprecation import warn_external
from torch_r3._extras import require
from torch_r3.runlog import RunRecord

__all__ = ["FIGURES", "render_report"]

#: The figures a page can hold, in page order.
FIGURES = ("drift", "curves", "load", "on_off")

_LAYER = re.compile(r"^route_drift/layer_(\d+)$")
_LOAD = re.compile(r"^expert_load/(rollout|trainer)/max_over_mean/layer_(\d+)$")
_R3_PREFIXES = ("route_drift/", "tokens/", "expert_load/", "live_fraction", "dropped_fraction")
_MARKERS_UP_TO = 30  # steps per line drawn with a marker on each; more would be a smear
_TITLES = {  # the on/off panels' titles for the metrics the demo logs (the demo table's row labels)
    "route_agreement": "route agreement, captured tokens",
    "logprob_abs_diff": "mean |dlogp|, sampled tokens",
    "k3_kl": "k3 KL(rollout || train)",
    "uncaptured_logprob_abs_diff": "mean |dlogp|, uncaptured tokens",
}
_CAPTIONS = {
    "drift": "Route drift per layer: the share of captured tokens whose own top-k differs from the replayed one.",
    "curves": "Mean route drift, and the uncaptured share: real tokens without a captured route (routed live or "
    "given filler routes) over all real tokens; padding is not counted.",
    "load": "Expert load per layer at the last step: the busiest expert's tokens over the mean per expert "
    "(1.0 is even; it reaches the number of experts when every token goes to one expert).",
    "on_off": "R3 on against R3 off: the other metrics both kinds of run logged.",
}

Series = dict[str, dict[int, dict[str, float]]]  # run -> step -> metrics (mean over ranks)


def _runs(records: Sequence[RunRecord]) -> tuple[Series, dict[str, Any], list[str]]:
    """The runs' metrics by step (ranks averaged, duplicates kept last), their `replay` flags, and notes for the page."""
    last: dict[tuple[str, int, int], RunRecord] = {}
    lines: dict[tuple[str, int, int], int] = defaultdict(int)
    for r in records:
        key = (str(r.meta.get("run", "")), r.step, r.rank)
        last[key] = r  # a later line of the same run, step and rank replaces the earlier
        lines[key] += 1
    notes = []
    duplicated = [(key, n) for key, n in lines.items() if n > 1]
    if duplicated:
        (run, step, rank), n = duplicated[0]
        more = f" (and {len(duplicated) - 1} more run, step and rank with several lines)" if len(duplicated) > 1 else ""
        notes.append(
            f"run {run!r}, step {step}, rank {rank}: {n} lines; the report keeps the last{more}. "
            "Was a run appended to the log twice? Give each run its own `run=` name."
        )
        warn_external(notes[-1], UserWarning)
    sums: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    ranks: dict[str, set[int]] = defaultdict(set)
    averaged: set[str] = set()
    replay: dict[str, Any] = {}
    for (run, step, rank), r in last.items():
        replay.setdefault(run, r.meta.get("replay"))
        ranks[run].add(rank)
        if len({k for k in last if k[:2] == (run, step)}) > 1:
            averaged.add(run)
        for k, v in r.metrics.items():
            sums[run][step][k].append(v)
    for run in sorted(averaged):
        notes.append(
            f"run {run!r}: each step is averaged over ranks {', '.join(map(str, sorted(ranks[run])))} "
            "(write one line per step after reduce_stats for exact figures)."
        )
    series: Series = {
        run: {step: {k: _mean(v) for k, v in metrics.items()} for step, metrics in sorted(steps.items())}
        for run, steps in sums.items()
    }
    if any(not math.isfinite(v) for steps in series.values() for m in steps.values() for v in m.values()):
        notes.append("Some values are NaN or infinite: the plots leave them out; the table shows them.")
    return series, replay, notes


def _mean(values: Sequence[float]) -> float:
    """The ranks' mean of one metric: NaN with a NaN or with both infinities, the infinity with one.

    Finite values whose sum overflows (two ranks at 1e308) are averaged as shares of the
    sum, which cannot overflow: their mean lies between their least and greatest value.
    """
    if any(math.isnan(v) for v in values) or (math.inf in values and -math.inf in values):
        return math.nan
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.nan


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _label(run: str) -> str:
    return run or "run"


def _step_axis(ax: Any, steps: Sequence[int] | None = None) -> None:
    """Whole-step ticks, a readable number of them; `steps` maps a heat map's column index to its step."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    if steps is not None:
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda x, _pos: str(steps[int(x)]) if x == int(x) and 0 <= x < len(steps) else "")
        )
    ax.set_xlabel("step")


def _labelled_bars(ax: Any, bars: Any) -> None:
    """Each bar's value written on it: a zero is a bar of no height, and reads as "0"."""
    ax.bar_label(bars, fmt="{:.3g}", fontsize="small", padding=2)


def _share_axis(ax: Any, values: Sequence[float]) -> None:
    """A share of tokens runs from 0 up: to a little above the largest (to 1 when all are 0)."""
    top = max((v for v in values if math.isfinite(v)), default=0.0)
    ax.set_ylim(0.0, top * 1.2 if top > 0 else 1.0)


def _run_bars(ax: Any, runs: Sequence[str], values: Sequence[float], **kwargs: Any) -> None:
    bars = ax.bar(range(len(runs)), [_finite(v) for v in values], color=[f"C{i}" for i in range(len(runs))], **kwargs)
    _labelled_bars(ax, bars)
    ax.margins(y=0.18)  # room for the tallest bar's label under the title
    long = max(len(_label(run)) for run in runs) > 12
    ax.set_xticks(
        range(len(runs)), [_label(run) for run in runs], rotation=20 if long else 0, ha="right" if long else "center"
    )
    ax.set_xlabel("run")


def _drift_layers(series: Series, run: str) -> list[int]:
    return sorted({int(m.group(1)) for metrics in series[run].values() for k in metrics if (m := _LAYER.match(k))})


def _drift_figure(plt: Any, series: Series) -> Any | None:
    runs = [run for run in series if _drift_layers(series, run)]
    if not runs:
        return None
    if all(len(series[run]) == 1 for run in runs):  # one step: bars per layer, the runs side by side
        fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
        layers = sorted({layer for run in runs for layer in _drift_layers(series, run)})
        width = 0.8 / len(runs)
        shares: list[float] = []
        for i, run in enumerate(runs):
            (metrics,) = series[run].values()
            xs = [x + (i - (len(runs) - 1) / 2) * width for x in range(len(layers))]
            values = [_finite(metrics.get(f"route_drift/layer_{layer}", math.nan)) for layer in layers]
            _labelled_bars(ax, ax.bar(xs, values, width=width, label=_label(run)))
            shares += values
        ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        _share_axis(ax, shares)
        ax.set_ylabel("route drift (share)")
        ax.set_title(f"route drift per layer, step {next(iter(series[runs[0]]))}")
        ax.legend(fontsize="small")
        return fig
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.6 * len(runs)), squeeze=False, layout="constrained")
    for ax, run in zip(axes[:, 0], runs):
        steps = sorted(series[run])
        layers = _drift_layers(series, run)
        grid = [
            [_finite(series[run][s].get(f"route_drift/layer_{layer}", math.nan)) for s in steps] for layer in layers
        ]
        top = max((v for row in grid for v in row if not math.isnan(v)), default=0.0)
        # Drift is a share of tokens: the scale starts at 0 and ends at the largest drift (at 1 when all are 0).
        image = ax.imshow(
            grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest", vmin=0.0, vmax=top or 1.0
        )
        if len(layers) <= 16:
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        _step_axis(ax, steps)
        ax.set_ylabel("layer")
        ax.set_title(f"route drift per layer{f' ({run})' if run else ''}")
        fig.colorbar(image, ax=ax, label="drift (share)")
    return fig


def _uncaptured(metrics: dict[str, float]) -> float:
    captured, live, filler = (metrics.get(f"tokens/{k}", 0) for k in ("captured", "live", "filler"))
    total = captured + live + filler  # real tokens: padding is counted apart (tokens/padding)
    return (live + filler) / total if total else math.nan


def _curves_figure(plt: Any, series: Series) -> Any | None:
    runs = [run for run, steps in series.items() if any("route_drift/mean" in m for m in steps.values())]
    if not runs:
        return None
    panels = (("mean route drift", lambda m: m.get("route_drift/mean", math.nan)), ("uncaptured share", _uncaptured))
    if all(len(series[run]) == 1 for run in runs):  # one step: a bar per run
        fig, axes = plt.subplots(1, 2, figsize=(7, 3), layout="constrained")
        for ax, (name, value) in zip(axes, panels):
            values = [value(next(iter(series[run].values()))) for run in runs]
            _run_bars(ax, runs, values)
            _share_axis(ax, values)
            ax.set_ylabel(name)
            ax.set_title(f"{name}, step {next(iter(series[runs[0]]))}")
        return fig
    fig, axes = plt.subplots(2, 1, figsize=(7, 5), layout="constrained")
    for ax, (name, value) in zip(axes, panels):
        shares: list[float] = []
        for run in runs:
            steps = sorted(series[run])
            marker = "o" if len(steps) <= _MARKERS_UP_TO else None
            values = [_finite(value(series[run][s])) for s in steps]
            ax.plot(steps, values, marker=marker, label=_label(run))
            shares += values
        _step_axis(ax)
        _share_axis(ax, shares)
        ax.set_ylabel(name)
        ax.set_title(f"{name} over steps")
    axes[0].legend(fontsize="small")
    return fig


def _load_figure(plt: Any, series: Series) -> Any | None:
    panels = []
    for run, steps in series.items():
        if steps:
            last = steps[max(steps)]
            found = {(m.group(1), int(m.group(2))): v for k, v in last.items() if (m := _LOAD.match(k))}
            if found:
                panels.append((run, max(steps), found))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), squeeze=False, layout="constrained")
    for ax, (run, step, found) in zip(axes[:, 0], panels):
        layers = sorted({layer for _, layer in found})
        for i, source in enumerate(("rollout", "trainer")):
            xs = [x + (i - 0.5) * 0.4 for x in range(len(layers))]
            values = [_finite(found.get((source, layer), math.nan)) for layer in layers]
            _labelled_bars(ax, ax.bar(xs, values, width=0.4, label=source))
        ax.margins(y=0.15)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("max / mean load")
        ax.set_title(f"expert load per layer, step {step}{f' ({run})' if run else ''}")
        ax.legend(fontsize="small")
    return fig


def _on_off_figure(plt: Any, series: Series, replay: dict[str, Any]) -> Any | None:
    on = [run for run, flag in replay.items() if flag is True]
    off = [run for run, flag in replay.items() if flag is False]
    if not on or not off:
        return None
    shared = sorted({k for run in on + off for m in series[run].values() for k in m if not k.startswith(_R3_PREFIXES)})
    shared = [k for k in shared if all(any(k in m for m in series[run].values()) for run in on + off)]
    if not shared:
        return None
    fig, axes = plt.subplots(len(shared), 1, figsize=(7, 2.6 * len(shared)), squeeze=False, layout="constrained")
    one_step = all(len(series[run]) == 1 for run in on + off)
    for ax, name in zip(axes[:, 0], shared):
        if one_step:
            _run_bars(ax, on + off, [next(iter(series[run].values())).get(name, math.nan) for run in on + off])
            for bar, run in zip(ax.patches, on + off):
                bar.set_hatch("" if run in on else "//")
        else:
            for run in on + off:
                steps = sorted(series[run])
                values = [_finite(series[run][s].get(name, math.nan)) for s in steps]
                label = f"{_label(run)} (R3 {'on' if run in on else 'off'})"
                marker = "o" if len(steps) <= _MARKERS_UP_TO else None
                ax.plot(steps, values, marker=marker, label=label, linestyle="-" if run in on else "--")
            _step_axis(ax)
            ax.legend(fontsize="small")
        ax.set_ylabel(name)
        ax.set_title(_TITLES.get(name, name.replace("_", " ")))
    return fig


def render_report(
    records: Sequence[RunRecord],
    output: str | os.PathLike[str],
    *,
    png_dir: str | os.PathLike[str] | None = None,
    title: str = "torch_r3 run report",
) -> dict[str, bytes]:
    """Write the HTML page for these run-log records; returns the PNG bytes of each figure drawn, by name.

    Args:
        records: What `read_run_log` returned (one or several logs, concatenated).
        output: The HTML file to write.
        png_dir: Also write each figure there as `<name>.png`.
        title: The page's title.

    Warns:
        UserWarning: When several lines share a run, step and rank (the last is kept).

    Raises:
        ValueError: When `records` is empty.
        MissingExtraError: When matplotlib is not installed.
    """
    if not records:
        raise ValueError("render_report: the run log holds no step")
    matplotlib = require("matplotlib", "bench")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "bench")
    series, replay, notes = _runs(records)
    builders = {
        "drift": lambda: _drift_figure(plt, series),
        "curves": lambda: _curves_figure(plt, series),
        "load": lambda: _load_figure(plt, series),
        "on_off": lambda: _on_off_figure(plt, series, replay),
    }
    pngs: dict[str, bytes] = {}
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):  # names drawn as written
        for name in FIGURES:
            fig = builders[name]()
            if fig is not None:
                pngs[name] = _png(fig)
                plt.close(fig)
    if png_dir is not None:
        Path(png_dir).mkdir(parents=True, exist_ok=True)
        for name, data in pngs.items():
            (Path(png_dir) / f"{name}.png").write_bytes(data)
    steps = sorted({r.step for r in records})
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<link rel="icon" href="data:,">',  # no favicon request
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "img{max-width:100%}td,th{padding:0 .6em;text-align:left}.note{color:#8a4b00}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(records)} log lines, {'step' if len(steps) == 1 else 'steps'} "
        f"{steps[0] if len(steps) == 1 else f'{steps[0]} to {steps[-1]}'}, runs: "
        f"{html.escape(', '.join(run or '(unnamed)' for run in series))}.</p>",
    ]
    parts += [f'<p class="note">{html.escape(note)}</p>' for note in notes]
    if not pngs:
        parts.append("<p>The log holds no R3 metric to draw.</p>")
    for name, data in pngs.items():
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{encoded}">')
        parts.append(f"<figcaption>{html.escape(_CAPTIONS[name])}</figcaption></figure>")
    parts.append("<h2>Last step</h2><table><tr><th>run</th><th>step</th><th>metric</th><th>value</th></tr>")
    for run, by_step in series.items():
        if by_step:
            step = max(by_step)
            for k, v in sorted(by_step[step].items()):
                parts.append(
                    f"<tr><td>{html.escape(run)}</td><td>{step}</td><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>"
                )
    parts.append("</table></body></html>")
    Path(output).write_text("\n".join(parts) + "\n", encoding="utf-8")
    return pngs
