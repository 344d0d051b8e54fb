"""The monitoring page's healthy and unhealthy curves of the uncaptured share, measured with a real `ReplayHook`.

Eight steps of four trajectories whose lengths change from step to step (seeded draws), through
the tiny Qwen3-MoE of tests/transformers and real `R3Collator` batches (left-padded):

* healthy: each trajectory's last sampled token is its only token without a captured route;
* unhealthy: from step 4 on, the server returns no routes for one request of the four.

`live_fraction` and `tokens/live` depend on the batch's masks only, not on any arithmetic, so the
figures the page quotes are compared exactly. The share as it was counted before padding was
counted apart (uncaptured positions, left padding included, over all positions) is drawn beside
it, from the same step's `tokens`: what made the curve swing with the batch's padding.

Regenerate the page's figures and its image after a change to the hooks' counts:

    PYTHONPATH=. python -m tests.test_monitoring_curves --write
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "monitoring.md"
IMAGE = ROOT / "docs" / "img" / "monitoring-uncaptured.png"
ANCHOR = "Measured on eight steps"
STEPS, TRAJECTORIES, BROKEN_FROM = 8, 4, 4
SIZE_FRACTION = 0.15  # how far the committed image's width or height may be from one drawn now


def measure() -> dict[str, list[dict[str, float]]]:
    """Per scenario (`healthy`, `unhealthy`), per step: `live_fraction`, `tokens/live`, `tokens/padding`, real
    tokens, and the share counted with padding in."""
    import torch

    from tests.samples import route_samples
    from tests.transformers.hf_models import build, inputs
    from torch_r3 import R3Collator
    from torch_r3.transformers import ReplayHook

    model = build("qwen3_moe")
    out: dict[str, list[dict[str, float]]] = {"healthy": [], "unhealthy": []}
    with ReplayHook(model) as hook:
        for step in range(STEPS):
            lengths = np.random.default_rng(step).integers(6, 41, TRAJECTORIES).tolist()
            for scenario in out:
                broken = scenario == "unhealthy" and step >= BROKEN_FROM

                def captured(i: int, n: int, broken: bool = broken) -> int:
                    return 0 if broken and i == 0 else n - 1  # request 0 came back without routes

                samples = route_samples(
                    step,
                    lengths,
                    captured=captured,
                    num_layers=hook.num_layers,
                    topk=hook.topk,
                    num_experts=hook.num_experts,
                    token_ids=(3, 64),
                )
                batch = R3Collator(pad_token_id=0)(samples)
                with torch.no_grad(), hook.replay(batch):
                    model(**inputs(batch))
                t = hook.last_stats.tokens
                out[scenario].append(
                    {
                        "live_fraction": hook.last_stats.live_fraction,
                        "tokens/live": t.live,
                        "tokens/padding": t.padding,
                        "real": t.real,
                        "with_padding": (t.live + t.filler + t.padding) / (t.real + t.padding),
                    }
                )
    return out


def summary(figures: dict[str, list[dict[str, float]]]) -> str:
    """The figures the page quotes, one line per scenario and metric."""
    lines = [f"{'step':27}" + " ".join(f"{step:>6}" for step in range(STEPS))]
    for scenario, steps in figures.items():
        for name, fmt in (("live_fraction", "6.1%"), ("tokens/live", "6d"), ("tokens/padding", "6d")):
            lines.append(f"{f'{scenario}, {name}:':27}" + " ".join(f"{s[name]:{fmt}}" for s in steps))
        lines.append(f"{f'{scenario}, with padding in:':27}" + " ".join(f"{s['with_padding']:6.1%}" for s in steps))
    return "\n".join(lines) + "\n"


def draw(figures: dict[str, list[dict[str, float]]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(STEPS)
    fig, (share, per) = plt.subplots(2, 1, figsize=(7, 5), layout="constrained")
    healthy, unhealthy = figures["healthy"], figures["unhealthy"]
    share.plot(steps, [s["live_fraction"] for s in healthy], marker="o", label="healthy: live_fraction")
    share.plot(steps, [s["live_fraction"] for s in unhealthy], marker="o", linestyle="--", label="unhealthy")
    share.plot(
        steps,
        [s["with_padding"] for s in healthy],
        marker=".",
        color="grey",
        linestyle=":",
        label="healthy, counted with padding in (before)",
    )
    share.set_ylabel("uncaptured share")
    share.set_title("share of the step's tokens without a captured route")
    share.set_ylim(0, None)
    share.legend(fontsize="small")
    per.plot(steps, [s["tokens/live"] / TRAJECTORIES for s in healthy], marker="o", label="healthy")
    per.plot(steps, [s["tokens/live"] / TRAJECTORIES for s in unhealthy], marker="o", linestyle="--", label="unhealthy")
    per.set_ylabel("tokens/live per trajectory")
    per.set_title("uncaptured real tokens per trajectory")
    per.set_ylim(0, None)
    per.legend(fontsize="small")
    for ax in (share, per):
        ax.set_xlabel("step")
        ax.set_xticks(list(steps))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def block_span(text: str) -> tuple[int, int]:
    start = text.index("```", text.index(ANCHOR))
    body = text.index("\n", start) + 1
    return body, text.index("\n```", body - 1) + 1


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def figures():
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    return measure()


def test_the_page_quotes_the_measured_curves(figures):
    start, end = block_span(PAGE.read_text())
    assert PAGE.read_text()[start:end] == summary(figures), (
        "regenerate: PYTHONPATH=. python -m tests.test_monitoring_curves --write"
    )


def test_healthy_steps_keep_one_uncaptured_token_per_trajectory_whatever_the_padding(figures):
    healthy, unhealthy = figures["healthy"], figures["unhealthy"]
    assert [s["tokens/live"] for s in healthy] == [TRAJECTORIES] * STEPS
    assert [s["live_fraction"] for s in healthy] == pytest.approx([TRAJECTORIES / s["real"] for s in healthy])
    assert len({s["tokens/padding"] for s in healthy}) > 1  # the padding changes from step to step
    # Unhealthy: the same until the server stops returning routes, then the whole request is live.
    assert unhealthy[:BROKEN_FROM] == healthy[:BROKEN_FROM]
    assert all(u["tokens/live"] > h["tokens/live"] for u, h in zip(unhealthy[BROKEN_FROM:], healthy[BROKEN_FROM:]))
    assert min(u["live_fraction"] for u in unhealthy[BROKEN_FROM:]) > 2 * max(h["live_fraction"] for h in healthy)


def test_the_page_shows_the_image_drawn_from_these_figures(figures):
    pytest.importorskip("matplotlib", reason="the bench extra is not installed")
    assert f"](../img/{IMAGE.name})" in PAGE.read_text()
    (cw, ch), (w, h) = _png_size(IMAGE.read_bytes()), _png_size(draw(figures))
    assert abs(cw - w) <= SIZE_FRACTION * w and abs(ch - h) <= SIZE_FRACTION * h


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check or regenerate the monitoring page's curves")
    parser.add_argument("--write", action="store_true", help="rewrite the page's figures and its image")
    args = parser.parse_args(argv)
    figures = measure()
    text = PAGE.read_text()
    start, end = block_span(text)
    new = text[:start] + summary(figures) + text[end:]
    if args.write:
        PAGE.write_text(new)
        IMAGE.write_bytes(draw(figures))
        print(f"rewrote the figures in {PAGE.relative_to(ROOT)} and {IMAGE.relative_to(ROOT)}")
        return 0
    print("the page's figures are this run's" if new == text else "the page's figures differ; --write rewrites them")
    return 0 if new == text else 1


if __name__ == "__main__":
    sys.exit(main())
