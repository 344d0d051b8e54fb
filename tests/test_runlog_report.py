"""The run log (writer and reader), `torch-r3 report`, and the page in a real headless Chromium."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.browser import MISSING, chromium, console_errors
from torch_r3.cli import main
from torch_r3.replay.stats import ReplayStats, StepCounts, TokenCounts
from torch_r3.report import render_report
from torch_r3.runlog import RunLog, read_routing_trace, read_run_log


def _stats(drift0: float) -> ReplayStats:
    return ReplayStats(
        microbatches=1,
        route_drift={0: drift0, 1: None},
        live_fraction=0.25,
        tokens=TokenCounts(3, 1, 0),
        counts=StepCounts({0: 1}, {0: 3}),
        rollout_load={0: (3, 2, 1, 0)},
        trainer_load={0: (2, 2, 1, 1)},
    )


def test_a_line_per_step_round_trips_with_nan_as_null(tmp_path):
    path = tmp_path / "run-{rank}.jsonl"
    with RunLog(path, rank=1) as log:
        log.write(0, _stats(0.5), run="r3", replay=True, loss=1.5)
        log.write(1, {"route_drift/mean": float("nan"), "tokens/captured": 7})
    text = (tmp_path / "run-1.jsonl").read_text()
    assert "NaN" not in text and json.loads(text.splitlines()[0])["metrics"]["route_drift/layer_1"] is None
    first, second = read_run_log(tmp_path / "run-1.jsonl")
    assert (first.step, first.rank, first.meta) == (0, 1, {"run": "r3", "replay": True, "loss": 1.5})
    assert first.metrics["route_drift/layer_0"] == 0.5 and math.isnan(first.metrics["route_drift/layer_1"])
    assert first.metrics["expert_load/rollout/max_over_mean/layer_0"] == 2.0
    assert math.isnan(second.metrics["route_drift/mean"]) and second.metrics["tokens/captured"] == 7


def test_without_rank_in_the_path_only_rank_zero_writes(tmp_path):
    RunLog(tmp_path / "run.jsonl", rank=1).write(0, {"a": 1.0})
    assert not (tmp_path / "run.jsonl").exists()
    with RunLog(tmp_path / "run.jsonl", rank=0) as log:
        log.write(0, {"a": 1.0})
    assert len(read_run_log(tmp_path / "run.jsonl")) == 1


def test_the_writer_refuses_what_is_no_metric_or_no_json_scalar(tmp_path):
    log = RunLog(tmp_path / "r.jsonl", rank=0)
    with pytest.raises(TypeError, match=r"metrics\['a'\]: expected a number, got str 'x'"):
        log.write(0, {"a": "x"})
    with pytest.raises(TypeError, match=r"meta 'cfg': expected a str, number, bool or None, got dict"):
        log.write(0, {}, cfg={})
    with pytest.raises(ValueError, match=r"step: expected >= 0, got -1"):
        log.write(-1, {})
    assert not (tmp_path / "r.jsonl").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", r"r.jsonl:1: not a JSON line"),
        ("[1]", r"r.jsonl:1: expected a JSON object, got list"),
        ('{"rank": 0, "metrics": {}}', r"r.jsonl:1: 'step' must be an int >= 0, got None"),
        ('{"step": 0, "rank": 0, "metrics": {"a": "1"}}', r"r.jsonl:1: metric 'a' must be a number or null"),
        ('{"step": 0, "rank": 0, "metrics": []}', r"r.jsonl:1: 'metrics' must be an object of numbers, got list"),
    ],
)
def test_the_reader_names_the_line_and_the_field_it_refuses(tmp_path, line, match):
    (tmp_path / "r.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        read_run_log(tmp_path / "r.jsonl")


def test_a_trace_line_whose_ids_do_not_match_its_counts_is_refused(tmp_path):
    path = tmp_path / "router_trace_rank0.jsonl"
    path.write_text(
        '{"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, '
        '"num_tokens": 2, "topk": 2, "top_indices": [[0, 1], [2]]}\n'
    )
    with pytest.raises(ValueError, match=r"router_trace_rank0.jsonl:1: top_indices row 1 must hold topk=2 ids"):
        read_routing_trace(path)


def _two_runs(tmp_path) -> Path:
    path = tmp_path / "run.jsonl"
    with RunLog(path, rank=0) as log:
        for step in range(3):
            log.write(step, {**_stats(0.1 * step).as_dict(), "loss": 1.0 / (step + 1)}, run="r3", replay=True)
            log.write(step, {"loss": 2.0 / (step + 1)}, run="baseline", replay=False)
    return path


def test_the_page_holds_each_figure_inline_and_beside_it(tmp_path):
    records = read_run_log(_two_runs(tmp_path))
    pngs = render_report(records, tmp_path / "r.html", png_dir=tmp_path / "png")
    assert list(pngs) == ["drift", "curves", "load", "on_off"]
    page = (tmp_path / "r.html").read_text()
    for name, data in pngs.items():
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "png" / f"{name}.png").read_bytes() == data
        assert f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,' in page
    # self-contained: every source is inline data, and no script
    assert re.findall(r'(?:src|href)="([a-z]+):', page) == ["data"] * (len(pngs) + 1) and "<script" not in page


def test_figures_are_drawn_only_from_what_the_log_holds(tmp_path):
    path = tmp_path / "plain.jsonl"
    with RunLog(path, rank=0) as log:
        log.write(0, ReplayStats(1, {0: 0.5}, 0.0, TokenCounts(4, 0, 0)))  # no expert load, no on/off
    assert list(render_report(read_run_log(path), tmp_path / "p.html")) == ["drift", "curves"]
    with pytest.raises(ValueError, match=r"no step"):
        render_report([], tmp_path / "e.html")


def test_report_command_writes_the_page_next_to_the_log(tmp_path, capsys):
    path = _two_runs(tmp_path)
    assert main(["report", str(path), "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "run.html").exists()
    assert json.loads((tmp_path / "r.json").read_text())["figures"] == ["drift", "curves", "load", "on_off"]
    out = capsys.readouterr()
    assert "figures: drift, curves, load, on_off" in out.out and "wrote" in out.err
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "missing.jsonl")])
    assert "no such file" in capsys.readouterr().err


needs_chromium = pytest.mark.skipif(chromium() is None, reason=MISSING)


@needs_chromium
def test_the_browser_check_sees_console_errors_and_failed_loads(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><script>console.error("boom")</script><img src="missing.png"></body></html>')
    errors = console_errors(bad)
    assert "console: boom" in errors
    assert any("ERR_FILE_NOT_FOUND" in e and "missing.png" in e for e in errors)


@pytest.mark.slow
@needs_chromium
def test_a_demo_runs_report_opens_in_headless_chromium_without_console_errors(megatron_demo, tmp_path):
    # the session's demo run (tests/conftest.py), which also wrote a run log
    log = megatron_demo.run_log
    assert log is not None
    records = read_run_log(log)
    assert [(r.meta["run"], r.meta["replay"]) for r in records] == [
        ("with_replay", True),
        ("with_replay_filler", True),
        ("without_replay", False),
    ]
    assert "expert_load/rollout/entropy/layer_3" in records[0].metrics
    assert "route_drift/mean" not in records[2].metrics and "k3_kl" in records[2].metrics
    page = tmp_path / "demo.html"
    assert main(["report", str(log), "-o", str(page)]) == 0
    assert console_errors(page) == []


def test_non_finite_values_are_written_and_read_back_as_the_floats_they_were(tmp_path):
    # A NaN or inf loss is what a diverging run logs: the writer records it, inside the
    # training loop, instead of raising; the reader gives back the same floats.
    path = tmp_path / "run.jsonl"
    with RunLog(path, rank=0) as log:
        log.write(0, {"loss": float("inf"), "grad": float("-inf"), "kl": float("nan")}, loss=float("nan"), lr=1e-4)
        log.write(1, {"loss": 2.0}, loss=float("-inf"), run="inf")  # a run named "inf" stays a string
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # strict JSON: no NaN/Infinity literals
    assert lines[0]["metrics"] == {"loss": "inf", "grad": "-inf", "kl": None}
    assert lines[0]["meta"] == {"loss": "nan", "lr": 1e-4} and lines[0]["nonfinite_meta"] == ["loss"]
    first, second = read_run_log(path)
    assert first.metrics["loss"] == math.inf and first.metrics["grad"] == -math.inf and math.isnan(first.metrics["kl"])
    assert math.isnan(first.meta["loss"]) and first.meta["lr"] == 1e-4
    assert second.meta == {"loss": -math.inf, "run": "inf"}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"step": 0, "rank": 0, "metrics": {"a": "Infinity"}}', r"r.jsonl:1: metric 'a' must be a number or null"),
        (
            '{"step": 0, "rank": 0, "metrics": {}, "meta": {"loss": "big"}, "nonfinite_meta": ["loss"]}',
            r"r.jsonl:1: meta 'loss' is listed in 'nonfinite_meta' but holds 'big'",
        ),
        (
            '{"step": 0, "rank": 0, "metrics": {}, "meta": {}, "nonfinite_meta": ["loss"]}',
            r"r.jsonl:1: meta 'loss' is listed in 'nonfinite_meta' but holds None",
        ),
    ],
)
def test_the_reader_refuses_a_non_finite_spelling_it_did_not_write(tmp_path, line, match):
    (tmp_path / "r.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        read_run_log(tmp_path / "r.jsonl")
