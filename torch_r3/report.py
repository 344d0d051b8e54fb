"""`torch-r3 report RUN.jsonl`: one self-contained HTML page of a run log's R3 figures.

The page holds its figures as inlined PNGs (no script, no server, no network), and
optionally writes them beside it as files. Figures, where the log has what they need:

* `drift`: route drift per layer over steps (a heat map), one panel per run;
* `curves`: mean drift and the uncaptured fraction (live + filler tokens) over steps;
* `load`: expert load per layer at the last step: the busiest expert over the mean, from
  the rollout's routes and from the trainer's own choice (`ReplayHook(expert_load=True)`);
* `on_off`: R3 on vs off: every other metric the runs share (a loss, a log-prob gap), for
  the runs whose `replay` meta is true against those where it is false.

A run is the `run` meta of a line (one unnamed run without it). Lines of several ranks
for one step are averaged (write one rank's line after `reduce_stats` for exact figures).
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

from torch_r3._extras import require
from torch_r3.runlog import RunRecord

__all__ = ["FIGURES", "render_report"]

#: The figures a page can hold, in page order.
FIGURES = ("drift", "curves", "load", "on_off")

_LAYER = re.compile(r"^route_drift/layer_(\d+)$")
_LOAD = re.compile(r"^expert_load/(rollout|trainer)/max_over_mean/layer_(\d+)$")
_R3_PREFIXES = ("route_drift/", "tokens/", "expert_load/", "live_fraction", "dropped_fraction")

Series = dict[str, dict[int, dict[str, float]]]  # run -> step -> metrics (mean over ranks)


def _runs(records: Sequence[RunRecord]) -> tuple[Series, dict[str, Any]]:
    sums: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    replay: dict[str, Any] = {}
    for r in records:
        run = str(r.meta.get("run", ""))
        replay.setdefault(run, r.meta.get("replay"))
        for k, v in r.metrics.items():
            sums[run][r.step][k].append(v)
    series: Series = {
        run: {step: {k: math.fsum(v) / len(v) for k, v in metrics.items()} for step, metrics in sorted(steps.items())}
        for run, steps in sums.items()
    }
    return series, replay


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _drift_figure(plt: Any, series: Series) -> Any | None:
    runs = [run for run, steps in series.items() if any(_LAYER.match(k) for m in steps.values() for k in m)]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.6 * len(runs)), squeeze=False, layout="constrained")
    for ax, run in zip(axes[:, 0], runs):
        steps = sorted(series[run])
        layers = sorted({int(m.group(1)) for s in steps for k in series[run][s] if (m := _LAYER.match(k))})
        grid = [[series[run][s].get(f"route_drift/layer_{layer}", math.nan) for s in steps] for layer in layers]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xticks(range(len(steps)), [str(s) for s in steps])
        ax.set_ylabel("layer")
        ax.set_title(f"route drift per layer{f' ({run})' if run else ''}")
        fig.colorbar(image, ax=ax, label="drift")
    axes[-1, 0].set_xlabel("step")
    return fig


def _curves_figure(plt: Any, series: Series) -> Any | None:
    runs = [run for run, steps in series.items() if any("route_drift/mean" in m for m in steps.values())]
    if not runs:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, layout="constrained")
    for run in runs:
        steps = sorted(series[run])
        label = run or "run"
        top.plot(steps, [series[run][s].get("route_drift/mean", math.nan) for s in steps], marker="o", label=label)
        uncaptured = []
        for s in steps:
            m = series[run][s]
            total = m.get("tokens/captured", 0) + m.get("tokens/live", 0) + m.get("tokens/filler", 0)
            uncaptured.append((m.get("tokens/live", 0) + m.get("tokens/filler", 0)) / total if total else math.nan)
        bottom.plot(steps, uncaptured, marker="o", label=label)
    top.set_ylabel("mean route drift")
    bottom.set_ylabel("uncaptured fraction")
    bottom.set_xlabel("step")
    top.legend(fontsize="small")
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
            ax.bar(xs, [found.get((source, layer), math.nan) for layer in layers], width=0.4, label=source)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_ylabel("max / mean load")
        ax.set_title(f"expert load per layer, step {step}{f' ({run})' if run else ''}")
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("layer")
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
    fig, axes = plt.subplots(len(shared), 1, figsize=(7, 2.4 * len(shared)), squeeze=False, layout="constrained")
    for ax, name in zip(axes[:, 0], shared):
        one_step = all(len(series[run]) == 1 for run in on + off)
        for i, run in enumerate(on + off):
            steps = sorted(series[run])
            label = f"{run or 'run'} (R3 {'on' if run in on else 'off'})"
            values = [series[run][s].get(name, math.nan) for s in steps]
            if one_step:
                ax.bar([i], values, label=label, color=f"C{i}", hatch="" if run in on else "//")
            else:
                ax.plot(steps, values, marker="o", label=label, linestyle="-" if run in on else "--")
        if one_step:
            ax.set_xticks(range(len(on + off)), [run or "run" for run in on + off])
        ax.set_title(name)
        if not one_step:
            ax.legend(fontsize="small")
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

    Raises:
        ValueError: When `records` is empty.
        MissingExtraError: When matplotlib is not installed.
    """
    if not records:
        raise ValueError("render_report: the run log holds no step")
    matplotlib = require("matplotlib", "bench")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "bench")
    series, replay = _runs(records)
    builders = {
        "drift": lambda: _drift_figure(plt, series),
        "curves": lambda: _curves_figure(plt, series),
        "load": lambda: _load_figure(plt, series),
        "on_off": lambda: _on_off_figure(plt, series, replay),
    }
    captions = {
        "drift": "Route drift per layer over steps: the share of captured tokens whose own top-k differs from the replayed one.",
        "curves": "Mean route drift and the share of tokens without a captured route, over steps.",
        "load": "Expert load per layer at the last step (1.0 is even; the number of experts is one expert only).",
        "on_off": "R3 on against R3 off: the other metrics both kinds of run logged.",
    }
    pngs: dict[str, bytes] = {}
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
        "img{max-width:100%}td,th{padding:0 .6em;text-align:left}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(records)} log lines, steps {steps[0]} to {steps[-1]}, runs: "
        f"{html.escape(', '.join(run or '(unnamed)' for run in series))}.</p>",
    ]
    if not pngs:
        parts.append("<p>The log holds no R3 metric to draw.</p>")
    for name, data in pngs.items():
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{encoded}">')
        parts.append(f"<figcaption>{html.escape(captions[name])}</figcaption></figure>")
    parts.append("<h2>Last step</h2><table><tr><th>run</th><th>metric</th><th>value</th></tr>")
    for run, by_step in series.items():
        if by_step:
            for k, v in sorted(by_step[max(by_step)].items()):
                parts.append(f"<tr><td>{html.escape(run)}</td><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>")
    parts.append("</table></body></html>")
    Path(output).write_text("\n".join(parts) + "\n", encoding="utf-8")
    return pngs
