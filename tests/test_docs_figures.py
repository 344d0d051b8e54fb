"""The tutorial's figures are those of a real `torch-r3 demo` run, not copied by hand.

One run of `python -m torch_r3.demo --json` (seed 0) gives the printed table and the
figures as JSON. The tutorial's table must be that output; its warning must be the
warning the run gave; and every figure its prose quotes (a percentage, a ratio, a count)
must be what the JSON gives.

What is a property of the product is compared exactly: the table's rows and text, 100.00%
agreement with replay, the token counts. What counts bf16-vs-fp32 near-ties (agreement and
drift without replay, the log-prob gaps and the KL) depends on the last bits of a bf16
matmul, which differ between CPUs and torch builds, so those are compared within stated
tolerances (tests/demo_figures.py, which states them and the spread they were set from:
the tutorial's own figures, written on another x86-64 CPU, against an AMD EPYC with AVX2
and against the same machine running torch's scalar kernels). When the demo itself
changes, regenerate the figures:

    PYTHONPATH=. python tests/test_docs_figures.py --write

The table, the warning's count and the prose figures are rewritten in place from one run.
The demo imports Megatron and generates on the CPU, so those tests are marked slow.

The README's own figures come from the code as well: the memory the default benchmark
needs is the bench's own estimate, and the `DataLoader` configuration it recommends is
the Performance page's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.demo_figures import FACTORS, PERCENT_POINTS, REPLAY_FACTOR, table_mismatches

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "guides" / "tutorial-rl-step.md"
FIGURES_HEADING = "## 5. The figures"
WARNING_PREFIX = "UserWarning: "
Figures = dict[str, dict[str, Any]]


def run_demo(workdir: Path) -> tuple[str, str, Figures]:
    """stdout, stderr and the JSON figures of `python -m torch_r3.demo --json` (seed 0)."""
    path = workdir / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "torch_r3.demo", "--json", str(path), "--quiet"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=workdir,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, done.stderr, json.loads(path.read_text())


def _fenced_after(text: str, anchor: str) -> tuple[int, int]:
    """Character span of the body of the first ``` fence after `anchor`."""
    start = text.index("```", text.index(anchor))
    body = text.index("\n", start) + 1
    return body, text.index("\n```", body) + 1


def table_span(text: str) -> tuple[int, int]:
    return _fenced_after(text, FIGURES_HEADING)


def _collapse(s: str) -> str:
    return " ".join(s.split())


def _ratio_1sig(x: float) -> str:
    return f"{float(f'{x:.1g}'):g}"


# Each figure the prose quotes: a pattern whose group 1 is the figure (words may wrap, so
# any whitespace between them), how the run's JSON renders it (for --write), the run's raw
# value, and how close the quoted figure must be to it ("exact", or a tolerance as in
# tests/demo_figures.py: ("points", p) for a percentage, ("factor", f) for a ratio).
S = r"\s+"
Claim = tuple[str, Callable[[Figures], str], Callable[[Figures], float], Any]
CLAIMS: dict[str, Claim] = {
    "top-2 choices flipped without replay": (
        rf"differences{S}flip{S}about{S}(\d+)%{S}of{S}top-2",
        lambda f: f"{round(100 * (1 - f['without_replay']['route_agreement']))}",
        lambda f: 100 * (1 - f["without_replay"]["route_agreement"]),
        ("points", 0.5 + PERCENT_POINTS),  # quoted as a whole percent
    ),
    "fall of |dlogp| on sampled tokens": (
        rf"falls{S}about{S}([\d.]+)x{S}with{S}replay",
        lambda f: f"{f['without_replay']['logprob_abs_diff'] / f['with_replay']['logprob_abs_diff']:.1f}",
        lambda f: f["without_replay"]["logprob_abs_diff"] / f["with_replay"]["logprob_abs_diff"],
        ("factor", FACTORS["|dlogp|, sampled"] * REPLAY_FACTOR),  # a ratio of two tolerated figures
    ),
    "fall of the k3 KL": (
        rf"p_rollout`\){S}about{S}(\d+)x",
        lambda f: _ratio_1sig(f["without_replay"]["k3_kl"] / f["with_replay"]["k3_kl"]),
        lambda f: f["without_replay"]["k3_kl"] / f["with_replay"]["k3_kl"],
        ("factor", FACTORS["k3 KL"] * REPLAY_FACTOR),
    ),
    "filler routes' |dlogp| on uncaptured tokens": (
        rf"log-prob{S}by{S}about{S}([\d.]+){S}nats",
        lambda f: f"{f['with_replay_filler']['uncaptured_logprob_abs_diff']:.2f}",
        lambda f: f["with_replay_filler"]["uncaptured_logprob_abs_diff"],
        ("factor", FACTORS["|dlogp|, uncaptured"]),
    ),
    "layer-0 drift": (
        rf"exactly{S}that{S}disagreement{S}\(([\d.]+)%\)",
        lambda f: f"{100 * f['with_replay']['stats']['route_drift'][0]:.2f}",
        lambda f: 100 * f["with_replay"]["stats"]["route_drift"][0],
        ("points", PERCENT_POINTS),
    ),
    "real tokens without a captured route": (
        rf"synthetic{S}EOS,{S}(\d+){S}here",
        lambda f: f"{f['with_replay']['stats']['tokens']['live']}",
        lambda f: f["with_replay"]["stats"]["tokens"]["live"],
        "exact",
    ),
}


def claim_holds(quoted: str, value: float, tolerance: Any) -> bool:
    """The prose's figure `quoted` against the run's `value`, within `tolerance`."""
    if tolerance == "exact":
        return float(quoted) == value
    kind, bound = tolerance
    if kind == "points":
        return abs(float(quoted) - value) <= bound
    return value > 0 and 1 / bound <= float(quoted) / value <= bound


def claimed(text: str) -> dict[str, str]:
    """The figure each claim's pattern finds in `text`."""
    found = {}
    for name, (pattern, *_rest) in CLAIMS.items():
        m = re.search(pattern, text)
        assert m, f"the tutorial no longer says the {name} (pattern {pattern!r})"
        found[name] = m[1]
    return found


def regenerate(text: str, stdout: str, figures: Figures) -> str:
    """`text` with the table replaced by `stdout` and every quoted figure by the run's."""
    start, end = table_span(text)
    text = text[:start] + stdout.rstrip("\n") + "\n" + text[end:]
    for pattern, render, *_rest in CLAIMS.values():
        m = re.search(pattern, text)
        assert m, pattern
        text = text[: m.start(1)] + render(figures) + text[m.end(1) :]
    return text


@pytest.fixture(scope="module")
def demo(megatron_demo) -> tuple[str, str, Figures]:
    """The session's one default demo run (tests/conftest.py), which the end-to-end tests also read."""
    return megatron_demo.stdout, megatron_demo.stderr, megatron_demo.figures


@pytest.mark.slow
def test_the_tutorial_table_is_what_the_demo_prints(demo):
    stdout, _stderr, _figures = demo
    text = TUTORIAL.read_text()
    start, end = table_span(text)
    assert table_mismatches(text[start:end], stdout) == [], (
        "the tutorial's table is stale; regenerate it: PYTHONPATH=. python tests/test_docs_figures.py --write"
    )


@pytest.mark.slow
def test_the_default_demo_warns_nothing_and_the_tutorial_quotes_no_warning(demo):
    # Its loss-active tokens without a route are the synthetic EOS it appends on purpose: the
    # table counts them; a warning would be for a sampled token without one.
    stdout, stderr, figures = demo
    assert WARNING_PREFIX not in stderr, stderr[-2000:]
    assert WARNING_PREFIX not in TUTORIAL.read_text()
    n = figures["with_replay"]["uncaptured_tokens"]
    assert n > 0 and f" {n} loss-active tokens predicted from an uncaptured position" in stdout


@pytest.mark.slow
def test_every_figure_the_prose_quotes_is_the_run_s(demo):
    _stdout, _stderr, figures = demo
    quoted = claimed(TUTORIAL.read_text())
    off = {
        name: (quoted[name], value(figures), tolerance)
        for name, (_pattern, _render, value, tolerance) in CLAIMS.items()
        if not claim_holds(quoted[name], value(figures), tolerance)
    }
    assert off == {}, "regenerate the figures: PYTHONPATH=. python tests/test_docs_figures.py --write"
    # What the prose says about these figures, checked on the run itself.
    with_replay, without = figures["with_replay"], figures["without_replay"]
    assert with_replay["stats"]["route_drift"][0] == pytest.approx(1 - without["route_agreement_per_layer"][0])


def test_the_tolerances_still_catch_a_table_that_no_longer_matches_the_demo():
    text = TUTORIAL.read_text()
    start, end = table_span(text)
    table = text[start:end]
    assert table_mismatches(table, table) == []
    # What another CPU moves: a flip in layer 3, the no-replay gaps by 20% and 35%.
    other_cpu = table.replace("96.08%", "95.83%").replace("1.676e-02", "1.990e-02").replace("1.164e-03", "1.550e-03")
    assert table_mismatches(table, other_cpu) == []
    # What a demo that changed would move: replay no longer exact, many more flips, a gap 3x
    # larger, a token count, a row.
    for changed in (
        table.replace("100.00%", "99.75%", 1),
        table.replace("97.55%", "95.55%"),
        table.replace("1.164e-03", "1.164e-02"),
        table.replace("6.231e-03", "3.100e-03"),
        table.replace("408 real tokens", "409 real tokens"),
        table.replace("live 12", "live 13"),
        table.replace("padding 4", "padding 5"),
        "\n".join(line for line in table.splitlines() if "layer 3 " not in line),
        table.replace("k3 KL", "k2 KL"),
    ):
        assert table_mismatches(table, changed) != [], changed


def test_the_prose_tolerances_tell_a_near_figure_from_a_far_one():
    assert claim_holds("2", 1.96, ("points", 1.25)) and not claim_holds("2", 3.5, ("points", 1.25))
    assert claim_holds("2.7", 3.0, ("factor", 1.35)) and not claim_holds("2.7", 4.0, ("factor", 1.35))
    assert claim_holds("40", 50.0, ("factor", 2.0)) and not claim_holds("40", 90.0, ("factor", 2.0))
    assert claim_holds("16", 16, "exact") and not claim_holds("16", 17, "exact")


def test_regenerate_rewrites_the_table_and_every_quoted_figure():
    text = TUTORIAL.read_text()
    figures: Figures = {
        "with_replay": {
            "logprob_abs_diff": 1.0,
            "k3_kl": 1.0,
            "uncaptured_tokens": 7,
            "stats": {"route_drift": [0.1234], "tokens": {"live": 99}},
        },
        "with_replay_filler": {"uncaptured_logprob_abs_diff": 0.987},
        "without_replay": {"route_agreement": 0.9, "logprob_abs_diff": 3.14, "k3_kl": 123.0},
    }
    new = regenerate(text, "a table\nof two lines\n", figures)
    start, end = table_span(new)
    assert new[start:end] == "a table\nof two lines\n"
    assert claimed(new) == {
        "top-2 choices flipped without replay": "10",
        "fall of |dlogp| on sampled tokens": "3.1",
        "fall of the k3 KL": "100",
        "filler routes' |dlogp| on uncaptured tokens": "0.99",
        "layer-0 drift": "12.34",
        "real tokens without a captured route": "99",
    }


def test_the_readme_memory_figure_is_the_bench_s_own_estimate():
    from torch_r3 import bench

    # What `torch-r3 bench` (no options) plans and prints as "needs about ... GiB of memory".
    config = bench.BenchConfig(**bench.PRESETS["default"])
    run_plan = bench.plan(config, strategies=list(bench.STRATEGIES), packed_vs_padded=True, sweep=None)
    estimate = f"{bench.memory_needed(run_plan) / 2**30:.1f} GiB"
    readme = _collapse((ROOT / "README.md").read_text())
    quoted = re.findall(r"\d+(?:\.\d+)? GiB", readme)  # the README's one memory figure is the bench's
    assert quoted == [estimate], f"README quotes {quoted}; the bench's own estimate is {estimate}"


def _num_workers(code: str) -> int:
    """The `num_workers` of the one `DataLoader(...)` call in `code` (0 when not given)."""
    (call,) = re.findall(r"DataLoader\((.*?)\)\n", code, re.DOTALL)
    m = re.search(r"num_workers=(\d+)", call)
    return int(m[1]) if m else 0


def _first_python_block(text: str, anchor: str) -> str:
    start = text.index("```python\n", text.index(anchor)) + len("```python\n")
    return text[start : text.index("\n```", start) + 1]


def test_the_readme_recommends_the_dataloader_configuration_the_performance_page_does():
    readme = _first_python_block((ROOT / "README.md").read_text(), "## Use it")
    performance = _first_python_block((ROOT / "docs" / "performance.md").read_text(), "### Recommended configuration")
    assert _num_workers(readme) == _num_workers(performance) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check or regenerate the tutorial's figures from a demo run")
    parser.add_argument("--write", action="store_true", help="rewrite the tutorial in place")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        stdout, _stderr, figures = run_demo(Path(tmp))
    text = TUTORIAL.read_text()
    new = regenerate(text, stdout, figures)
    if new == text:
        print("the tutorial's figures are those of this run")
        return 0
    if args.write:
        TUTORIAL.write_text(new)
        print(f"rewrote the figures in {TUTORIAL.relative_to(ROOT)}")
        return 0
    print("the tutorial's figures differ from this run; --write rewrites them")
    return 1


if __name__ == "__main__":
    sys.exit(main())
