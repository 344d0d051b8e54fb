"""The tutorial's report figures are those of a real demo run's `torch-r3 report`.

The session's default demo run (tests/conftest.py's `megatron_demo`, the one the tutorial's
table is checked against) also writes a run log. The report is drawn again from it here, and
the tutorial's section on it must say what that report shows:

* the figure set (its first line) is the set `render_report` drew, in page order;
* the committed images, `docs/img/report-<figure>.png`, are exactly those figures, each
  referenced from the tutorial, and each the same kind of plot as the one drawn now (a PNG
  whose size is within `SIZE_FRACTION` of it: the same panels, the same axes). Their pixels are
  not compared: how the bf16 near-ties fall, and so the heat map's colours, depends on the CPU;
* every figure the section's summary block quotes is the run's, by the rules of
  tests/demo_figures.py where a figure is one the demo's table holds too (agreement, log-prob
  gaps, KL; drift within `PERCENT_POINTS`; token counts exact), and expert load (the busiest
  expert over the mean, per layer) within `LOAD_POINTS`.

Regenerate the images and the summary after a change to the demo or the report:

    PYTHONPATH=. python tests/test_tutorial_report.py --write [--run-log RUN.jsonl]

Without `--run-log` it runs the demo (`torch-r3 demo --run-log`) once first.
"""

from __future__ import annotations

import argparse
import math
import re
import struct
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.demo_figures import NUMBER, PERCENT_POINTS, cell_mismatch

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "guides" / "tutorial-rl-step.md"
IMAGES = ROOT / "docs" / "img"
HEADING = "## 6. The report"
BLOCK_ANCHOR = "what the figures plot:"

LOAD_POINTS = 0.08
"""How far a max/mean expert load may move: 8 tokens of the 102 an expert gets on average (measured: 0.02)."""

SIZE_FRACTION = 0.15
"""How far a committed image's width or height may be from the one drawn now."""

RUNS = ("with_replay", "with_replay_filler", "without_replay")  # the demo's runs: table columns 0, 1, 2
# The run log's names for the demo's own figures, and the labels of their rows in the demo's table
# (tests/demo_figures.py sets a figure's tolerance by that label).
ON_OFF = {
    "route_agreement": "route agreement, captured tokens",
    "logprob_abs_diff": "mean |dlogp|, sampled tokens",
    "k3_kl": "k3 KL(rollout || train)",
    "uncaptured_logprob_abs_diff": "mean |dlogp|, uncaptured tokens",
}


def image_path(name: str) -> Path:
    return IMAGES / f"report-{name}.png"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header; refuses what is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def summary(records: Sequence, figures: Sequence[str]) -> str:
    """The numbers each figure of the report plots, one line per panel or bar group."""
    by_run = {str(r.meta.get("run", "")): r.metrics for r in records if r.step == max(x.step for x in records)}
    lines = [f"figures: {', '.join(figures)}"]
    drifted = [run for run, m in by_run.items() if "route_drift/mean" in m]
    for run in drifted:
        m = by_run[run]
        layers = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("route_drift/layer_"))
        lines.append(f"drift, {run}: " + "  ".join(f"layer {i} {_pct(m[f'route_drift/layer_{i}'])}" for i in layers))
    for run in drifted:
        m = by_run[run]
        total = int(m["tokens/captured"] + m["tokens/live"] + m["tokens/filler"])
        uncaptured = (m["tokens/live"] + m["tokens/filler"]) / total
        lines.append(
            f"curves, {run}: mean drift {_pct(m['route_drift/mean'])}, uncaptured {_pct(uncaptured)} of {total} tokens"
        )
    for run in drifted:
        m = by_run[run]
        for source in ("rollout", "trainer"):
            prefix = f"expert_load/{source}/max_over_mean/layer_"
            layers = sorted(int(k.removeprefix(prefix)) for k in m if k.startswith(prefix))
            if layers:
                lines.append(
                    f"load, {run}, {source}: " + "  ".join(f"layer {i} {m[prefix + str(i)]:.2f}" for i in layers)
                )
    for name in ON_OFF:
        cells = [
            f"{run} {_pct(by_run[run][name]) if name == 'route_agreement' else f'{by_run[run][name]:.3e}'}"
            for run in RUNS
            if run in by_run and name in by_run[run]
        ]
        if cells:
            lines.append(f"on_off, {name}: " + "  ".join(cells))
    return "\n".join(lines) + "\n"


def _skeleton(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def number_mismatch(want: str, got: str, line: str, index: int) -> str | None:
    """Why the run's `got` is not the documented `want`, the `index`-th number of summary line `line`."""
    if want.endswith("%") != got.endswith("%"):
        return f"{want} vs {got}"
    kind = line.split(",", 1)[0]
    if kind == "on_off":  # one number per run, in RUNS order: the demo table's rules
        name = line.split(",", 1)[1].split(":", 1)[0].strip()
        runs = re.findall(r"\b(with_replay_filler|with_replay|without_replay) ", line)
        return cell_mismatch(want, got, ON_OFF[name], RUNS.index(runs[index]))
    if kind == "curves" and index == 0 or kind == "drift" and want.endswith("%"):  # drift: bf16 near-ties
        return None if abs(float(want[:-1]) - float(got[:-1])) <= PERCENT_POINTS else f"{want} vs {got} (points)"
    if kind == "load" and "." in want:
        return None if abs(float(want) - float(got)) <= LOAD_POINTS else f"{want} vs {got} (over {LOAD_POINTS})"
    # a layer index, a token count, the uncaptured share (fixed by the demo's shapes)
    return None if want == got else f"{want} vs {got} (exact)"


def summary_mismatches(documented: str, printed: str) -> list[str]:
    """Every way the documented summary differs from the run's beyond the tolerances."""
    doc, run = documented.rstrip("\n").splitlines(), printed.rstrip("\n").splitlines()
    if [_skeleton(x) for x in doc] != [_skeleton(x) for x in run]:
        return [f"the lines or their text differ: documented {doc}, drawn {run}"]
    out = []
    for d, r in zip(doc, run):
        for i, (want, got) in enumerate(zip(NUMBER.findall(d), NUMBER.findall(r))):
            why = number_mismatch(want, got, d, i)
            if why:
                out.append(f"{d.split(':', 1)[0]}: {why}")
    return out


def block_span(text: str) -> tuple[int, int]:
    """Character span of the body of the summary's ``` fence in the tutorial."""
    start = text.index("```", text.index(BLOCK_ANCHOR, text.index(HEADING)))
    body = text.index("\n", start) + 1
    return body, text.index("\n```", body - 1) + 1  # from the opening line's newline: an empty block too


def documented_summary() -> str:
    text = TUTORIAL.read_text()
    start, end = block_span(text)
    return text[start:end]


def referenced_images(text: str) -> list[str]:
    """The report figures the tutorial shows, by name, in page order."""
    return re.findall(r"\]\(\.\./img/report-([a-z_]+)\.png\)", text)


def test_the_committed_report_images_are_referenced_and_named_like_the_report_s_figures():
    from torch_r3.report import FIGURES

    shown = referenced_images(TUTORIAL.read_text())
    committed = sorted(p.name.removeprefix("report-").removesuffix(".png") for p in IMAGES.glob("report-*.png"))
    assert sorted(shown) == committed, "every committed report image is shown once, and only those"
    assert [n for n in FIGURES if n in shown] == shown, "shown in the report's page order"
    first = documented_summary().splitlines()[0]
    assert first == f"figures: {', '.join(shown)}", "the summary names the figures shown"
    for name in shown:
        png_size(image_path(name).read_bytes())


def test_the_summary_tolerances_tell_a_near_run_from_a_changed_one():
    block = documented_summary()
    assert summary_mismatches(block, block) == []
    # What another CPU moves: a flipped route in layer 3's drift, two tokens to another expert,
    # the gap without replay by 20%.
    layer3 = re.search(r"layer 3 (\d+\.\d+)%", block)[1]
    load = re.search(r"rollout: layer 0 (\d+\.\d+)", block)[1]
    gap = re.search(r"logprob_abs_diff: .* without_replay (\S+)", block)[1]
    near = (
        block.replace(f"layer 3 {layer3}%", f"layer 3 {float(layer3) + 0.25:.2f}%")
        .replace(f"rollout: layer 0 {load}", f"rollout: layer 0 {float(load) + 0.02:.2f}")
        .replace(f"without_replay {gap}", f"without_replay {1.2 * float(gap):.3e}")
    )
    assert near != block and summary_mismatches(block, near) == []
    # What a changed demo or report moves: a figure more or less, replay no longer exact, a
    # token count, a load far off, a gap 3x smaller under replay.
    for changed in (
        block.replace("figures: drift, curves, load, on_off", "figures: drift, curves, on_off"),
        block.replace("with_replay 100.00%", "with_replay 99.75%", 1),
        block.replace(" of 420 tokens", " of 421 tokens", 1),
        block.replace(f"rollout: layer 0 {load}", f"rollout: layer 0 {float(load) + 0.5:.2f}"),
        re.sub(r"(logprob_abs_diff: with_replay )(\S+)", lambda m: m[1] + f"{float(m[2]) / 3:.3e}", block),
        block.replace(f"layer 3 {layer3}%", f"layer 3 {float(layer3) + 3:.2f}%"),
        "\n".join(line for line in block.splitlines() if not line.startswith("load, with_replay, trainer")),
    ):
        assert changed != block and summary_mismatches(block, changed) != [], changed


def test_regenerate_rewrites_the_summary_block_only():
    text = TUTORIAL.read_text()
    new = regenerate(text, "figures: drift\n")
    start, end = block_span(new)
    assert new[start:end] == "figures: drift\n"
    assert new[:start] == text[: block_span(text)[0]] and new[end:] == text[block_span(text)[1] :]


def regenerate(text: str, block: str) -> str:
    start, end = block_span(text)
    return text[:start] + block + text[end:]


@pytest.fixture(scope="module")
def drawn(megatron_demo, tmp_path_factory) -> tuple[list, dict[str, bytes]]:
    """The session's demo run log and the report drawn from it now."""
    pytest.importorskip("matplotlib", reason="the bench extra is not installed: pip install 'torch_r3[bench]'")
    from torch_r3.report import render_report
    from torch_r3.runlog import read_run_log

    assert megatron_demo.run_log is not None
    records = read_run_log(megatron_demo.run_log)
    pngs = render_report(records, tmp_path_factory.mktemp("report") / "demo.html")
    return records, pngs


@pytest.mark.slow
def test_the_tutorial_shows_the_figures_the_demo_s_report_draws(drawn):
    _records, pngs = drawn
    assert referenced_images(TUTORIAL.read_text()) == list(pngs)
    for name, data in pngs.items():
        (cw, ch), (w, h) = png_size(image_path(name).read_bytes()), png_size(data)
        assert abs(cw - w) <= SIZE_FRACTION * w and abs(ch - h) <= SIZE_FRACTION * h, (
            f"docs/img/report-{name}.png is {cw}x{ch}, the report draws {w}x{h}: regenerate it "
            "(PYTHONPATH=. python tests/test_tutorial_report.py --write)"
        )


@pytest.mark.slow
def test_the_tutorial_quotes_what_the_demo_s_report_plots(drawn):
    records, pngs = drawn
    assert summary_mismatches(documented_summary(), summary(records, list(pngs))) == [], (
        "the tutorial's report summary is stale: PYTHONPATH=. python tests/test_tutorial_report.py --write"
    )
    # What the tutorial's prose says of these figures, on the run itself.
    by_run = {r.meta["run"]: r.metrics for r in records}
    live = by_run["with_replay"]
    assert all(live[f"expert_load/rollout/max_over_mean/layer_{i}"] < 2 for i in range(4)), "no layer near collapse"
    assert live["expert_load/trainer/max_over_mean/layer_0"] == live["expert_load/rollout/max_over_mean/layer_0"]
    assert not any(math.isnan(v) for v in live.values())


def write(records: Sequence, pngs: dict[str, bytes]) -> None:
    """Rewrite the committed images and the tutorial's summary from this report."""
    for stale in IMAGES.glob("report-*.png"):
        if stale.name.removeprefix("report-").removesuffix(".png") not in pngs:
            stale.unlink()
    for name, data in pngs.items():
        image_path(name).write_bytes(data)
    TUTORIAL.write_text(regenerate(TUTORIAL.read_text(), summary(records, list(pngs))))


def main(argv: list[str] | None = None) -> int:
    from torch_r3.report import render_report
    from torch_r3.runlog import read_run_log

    parser = argparse.ArgumentParser(description="check or regenerate the tutorial's report figures")
    parser.add_argument("--write", action="store_true", help="rewrite the images and the summary in place")
    parser.add_argument("--run-log", metavar="PATH", help="a `torch-r3 demo --run-log` log (default: run the demo)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.run_log) if args.run_log else None
        if log is None:
            from tests.conftest import run_demo

            run = run_demo(Path(tmp), "--run-log", "run.jsonl")
            if run.returncode != 0:
                print(run.stderr[-4000:], file=sys.stderr)
                return 1
            log = run.run_log
        assert log is not None
        records = read_run_log(log)
        pngs = render_report(records, Path(tmp) / "demo.html")
    off = summary_mismatches(documented_summary(), summary(records, list(pngs)))
    if args.write:
        write(records, pngs)
        print(f"rewrote {', '.join(f'docs/img/report-{n}.png' for n in pngs)} and the summary in the tutorial")
        return 0
    print("the tutorial's report summary holds for this run" if not off else "\n".join(off))
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
