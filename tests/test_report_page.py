"""What `torch-r3 report` draws, figure by figure: at one step, at two and at hundreds; names
drawn as written; duplicate lines; labels, captions and colour scales.

The figures are real matplotlib figures; `drawn` keeps each one `render_report` saves (a spy
on `Figure.savefig` that then saves as usual), so the tests read their axes, texts and
colour limits instead of their pixels.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.browser import chromium, console_errors
from torch_r3.replay.stats import ReplayStats, StepCounts, TokenCounts
from torch_r3.runlog import RunLog, read_run_log

matplotlib = pytest.importorskip("matplotlib", reason="the bench extra is not installed: pip install 'torch_r3[bench]'")
from matplotlib.figure import Figure

from torch_r3.report import render_report


@pytest.fixture
def drawn(monkeypatch):
    """The figures `render_report` saves, in order."""
    figures: list[Figure] = []
    save = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _stats(drift: float, live: int = 1) -> ReplayStats:
    return ReplayStats(
        microbatches=1,
        route_drift={0: drift, 1: drift / 2},
        live_fraction=live / 100,
        tokens=TokenCounts(100 - live, live, 0),
        counts=StepCounts({0: 1}, {0: 99}),
        rollout_load={0: (30, 30, 20, 20), 1: (40, 20, 20, 20)},
        trainer_load={0: (30, 30, 20, 20), 1: (50, 10, 20, 20)},
    )


def _log(tmp_path, steps: int, *, drift=lambda step: 0.01 * (step % 7), runs=("r3 $5 and $6", "base")):
    path = tmp_path / f"run{steps}.jsonl"
    with RunLog(path, rank=0) as log:
        for step in range(steps):
            log.write(step, {**_stats(drift(step)).as_dict(), "k3_kl": 1e-4}, run=runs[0], replay=True)
            log.write(step, {"k3_kl": 1e-3 + 1e-5 * step}, run=runs[1], replay=False)
    return read_run_log(path)


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


def _plot_axes(fig: Figure) -> list:
    """The figure's axes other than colour bars."""
    bars = {im.colorbar.ax for ax in fig.axes for im in ax.images if im.colorbar is not None}
    return [ax for ax in fig.axes if ax not in bars]


def test_names_with_dollar_signs_are_drawn_as_written_not_as_mathtext(tmp_path, drawn):
    # "$\frac{" is not valid mathtext: parsed, it aborts the report; "$5 and $" would lose its dollars
    records = _log(tmp_path, 3, runs=("cost $5 and $6", r"base $\frac{$"))
    render_report(records, tmp_path / "r.html")
    texts = [t for fig in drawn for t in fig.findobj(matplotlib.text.Text) if "$" in t.get_text()]
    assert {t.get_text() for t in texts} >= {"cost $5 and $6 (R3 on)", r"base $\frac{$ (R3 off)"}
    assert texts and not any(t.get_parse_math() for t in texts)


def test_one_step_draws_bars_and_no_heat_map_or_lone_dot(tmp_path, drawn):
    records = _log(tmp_path, 1)
    pngs = render_report(records, tmp_path / "r.html")
    assert list(pngs) == ["drift", "curves", "load", "on_off"]
    for fig in drawn:
        for ax in _plot_axes(fig):
            assert not ax.images, "a one-step heat map is one column"
            assert not [line for line in ax.lines if len(line.get_xdata()) == 1], "a lone dot"
            assert ax.patches, "bars"
    drift, curves = drawn[0], drawn[1]
    # drift: one bar per layer for the one run with drift, at its value
    assert sorted(round(p.get_height(), 6) for p in _plot_axes(drift)[0].patches) == [0.0, 0.0]
    heights = sorted(round(p.get_height(), 6) for ax in _plot_axes(curves) for p in ax.patches)
    assert heights == [0.0, 0.01]  # mean drift 0.0 at step 0; uncaptured 1 of 100 tokens


def test_many_steps_draw_a_heat_map_and_lines_with_a_readable_step_axis(tmp_path, drawn):
    records = _log(tmp_path, 200)
    render_report(records, tmp_path / "r.html")
    heat = _plot_axes(drawn[0])[0]
    assert heat.images and heat.images[0].get_array().shape == (2, 200)
    drawn[0].canvas.draw()
    labels = [t.get_text() for t in heat.get_xticklabels() if t.get_text()]
    assert 2 <= len(labels) <= 12 and all(0 <= int(x) <= 199 for x in labels)
    for ax in _plot_axes(drawn[1]):
        assert [len(line.get_xdata()) for line in ax.lines] == [200]
        assert ax.get_xlim()[0] >= -20 and ax.get_xlim()[1] <= 220


def test_two_steps_draw_lines_on_whole_steps(tmp_path, drawn):
    render_report(_log(tmp_path, 2), tmp_path / "r.html")
    drawn[1].canvas.draw()
    for ax in _plot_axes(drawn[1]):
        lo, hi = ax.get_xlim()
        shown = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
        assert shown == ["0", "1"], shown
    assert _plot_axes(drawn[0])[0].images[0].get_array().shape == (2, 2)


@pytest.mark.parametrize("steps", [1, 2, 200])
def test_every_panel_has_both_axes_labelled_and_a_readable_title(tmp_path, drawn, steps):
    render_report(_log(tmp_path, steps), tmp_path / "r.html")
    for fig in drawn:
        for ax in _plot_axes(fig):
            assert ax.get_xlabel() and ax.get_ylabel(), _texts(fig)
    on_off = drawn[-1]
    titles = [ax.get_title() for ax in _plot_axes(on_off)]
    assert titles == ["k3 KL(rollout || train)"], titles
    assert [ax.get_ylabel() for ax in _plot_axes(on_off)] == ["k3_kl"]


def test_the_colour_scale_fits_the_drift_it_shows(tmp_path, drawn):
    render_report(_log(tmp_path, 3, drift=lambda step: 0.0), tmp_path / "zero.html")
    render_report(_log(tmp_path, 4, drift=lambda step: 0.1 * step), tmp_path / "some.html")
    zero, some = (_plot_axes(fig)[0].images[0] for fig in (drawn[0], drawn[4]))
    assert zero.get_clim() == (0.0, 1.0)  # drift is a share: no negative drift on the bar
    assert some.get_clim() == pytest.approx((0.0, 0.3))


def test_captions_say_what_the_figures_show(tmp_path):
    render_report(_log(tmp_path, 2), tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "one expert only" not in page
    assert "1.0 is even; it reaches the number of experts when every token goes to one expert" in page
    assert "real tokens" in page and "padding" in page  # the uncaptured share and what it leaves out


def test_duplicate_run_and_step_lines_keep_the_last_with_a_warning(tmp_path):
    path = tmp_path / "twice.jsonl"
    for loss in (0.0049, 0.0):  # the same run appended twice to one log
        with RunLog(path, rank=0) as log:
            log.write(0, {"loss": loss}, run="demo", replay=True)
            log.write(0, {"loss": 1.0}, run="off", replay=False)
    with pytest.warns(UserWarning, match=r"run 'demo', step 0, rank 0: 2 lines; the report keeps the last"):
        render_report(read_run_log(path), tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<td>demo</td><td>0</td><td>loss</td><td>0</td>" in page and "0.00245" not in page
    assert "2 lines; the report keeps the last" in page


def test_lines_of_several_ranks_for_one_step_are_averaged_and_the_page_says_so(tmp_path):
    for rank, loss in ((0, 1.0), (1, 3.0)):
        with RunLog(tmp_path / "run-{rank}.jsonl", rank=rank) as log:
            log.write(0, {"loss": loss}, run="r")
    records = read_run_log(tmp_path / "run-0.jsonl") + read_run_log(tmp_path / "run-1.jsonl")
    render_report(records, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<td>r</td><td>0</td><td>loss</td><td>2</td>" in page and "averaged over ranks 0, 1" in page


def test_a_non_finite_metric_is_tabled_and_left_out_of_the_plots(tmp_path, drawn):
    path = tmp_path / "inf.jsonl"
    with RunLog(path, rank=0) as log:
        for step in range(3):
            log.write(step, {"k3_kl": math.inf if step == 1 else 0.1}, run="on", replay=True)
            log.write(step, {"k3_kl": 0.2}, run="off", replay=False)
    render_report(read_run_log(path), tmp_path / "r.html")
    (ax,) = _plot_axes(drawn[0])
    assert all(math.isfinite(y) or math.isnan(y) for line in ax.lines for y in line.get_ydata())
    assert all(math.isfinite(v) for v in ax.get_ylim())


needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed")


@needs_chromium
@pytest.mark.parametrize("steps", [1, 2, 200])
def test_the_page_opens_in_headless_chromium_at_one_two_and_two_hundred_steps(tmp_path, steps):
    render_report(_log(tmp_path, steps), tmp_path / "r.html")
    assert console_errors(tmp_path / "r.html") == []


def _two_ranks(tmp_path, values):
    """One step per pair of values: rank 0 logs the first, rank 1 the second (run "on"); run "off" logs 0.2."""
    for rank in (0, 1):
        with RunLog(tmp_path / "run-{rank}.jsonl", rank=rank) as log:
            for step, pair in enumerate(values):
                log.write(step, {"k3_kl": pair[rank], "route_drift/mean": 0.1}, run="on", replay=True)
                log.write(step, {"k3_kl": 0.2, "route_drift/mean": 0.1}, run="off", replay=False)
    return [tmp_path / "run-0.jsonl", tmp_path / "run-1.jsonl"]


def _cell(page, run, step, metric):
    return re.search(rf"<td>{run}</td><td>{step}</td><td>{metric}</td><td>([^<]*)</td>", page)[1]


@pytest.mark.parametrize(
    "last, mean",
    [
        ((math.inf, -math.inf), "nan"),  # inf + -inf has no value: the mean is NaN
        ((math.inf, 1.0), "inf"),
        ((1e308, 1e308), "1e+308"),  # the sum overflows, the mean does not
        ((-1e308, -1.7e308), "-1.35e+308"),
        ((1e308, -1e308), "0"),
    ],
)
def test_ranks_whose_sum_is_not_finite_are_averaged_and_the_page_is_drawn(tmp_path, drawn, capsys, last, mean):
    from torch_r3.cli import main

    paths = _two_ranks(tmp_path, [(0.1, 0.3), last])
    records = read_run_log(paths[0]) + read_run_log(paths[1])
    pngs = render_report(records, tmp_path / "r.html")
    assert set(pngs) == {"curves", "on_off"}
    page = (tmp_path / "r.html").read_text()
    assert _cell(page, "on", 1, "k3_kl") == mean and _cell(page, "off", 1, "k3_kl") == "0.2"
    # the on/off panel of k3_kl: step 0 is the ranks' mean; a non-finite mean is left out of the plot
    (ax,) = _plot_axes(drawn[-1])
    (on,) = [line for line in ax.lines if "on" in line.get_label() and "off" not in line.get_label()]
    ys = list(on.get_ydata())
    assert ys[0] == pytest.approx(0.2)
    assert ys[1] == float(mean) if math.isfinite(float(mean)) else math.isnan(ys[1])
    assert all(math.isfinite(v) for v in ax.get_ylim())
    # and the command draws the page too (it exited 2 on inf/-inf and 1 on 1e308 before)
    assert main(["report", str(paths[0]), str(paths[1]), "-o", str(tmp_path / "cli.html")]) == 0
    assert _cell((tmp_path / "cli.html").read_text(), "on", 1, "k3_kl") == mean
