"""`torch-r3 demo --trainer transformers`, as a user runs it, in a process where Megatron cannot be imported.

A bf16 transformers Qwen3-MoE model behind the loopback server, multi-turn
rollouts through the client, a DataLoader with R3Collator (main process, the default), and
an fp32 training step with ReplayHook (live and filler) and without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo_figures import table_mismatches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(transformers_demo):
    """The session's one `torch-r3 demo --trainer transformers` run, Megatron blocked (tests/conftest.py)."""
    return transformers_demo, transformers_demo.figures


def test_replay_makes_every_captured_token_use_the_rollouts_experts_and_cuts_the_logprob_gap(demo):
    proc, figures = demo
    live, filler, without = figures["with_replay"], figures["with_replay_filler"], figures["without_replay"]
    assert live["route_agreement"] == 1.0 and filler["route_agreement"] == 1.0
    assert 0.9 < without["route_agreement"] < 1.0  # bf16 vs fp32 really flips near-ties without replay
    assert live["logprob_abs_diff"] < without["logprob_abs_diff"]
    assert live["k3_kl"] < without["k3_kl"] / 5
    assert "route agreement, captured tokens" in proc.stdout


def test_the_hooks_stats_count_the_tokens_the_report_counts(demo):
    _, figures = demo
    live, filler = figures["with_replay"], figures["with_replay_filler"]
    assert live["stats"]["tokens"]["captured"] == live["tokens"]
    assert live["stats"]["tokens"]["filler"] == 0 and live["stats"]["tokens"]["live"] > 0
    assert filler["stats"]["tokens"]["live"] == 0
    assert filler["stats"]["tokens"]["filler"] == live["stats"]["tokens"]["live"]
    assert max(live["stats"]["route_drift"]) > 0  # the routers would have drifted without replay
    # Live routing at the uncaptured tail tracks the inference model; filler routes there do not.
    assert live["uncaptured_logprob_abs_diff"] < filler["uncaptured_logprob_abs_diff"]


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "transformers.md"


def test_the_guide_table_is_what_the_demo_prints_within_the_stated_tolerances(demo):
    proc, _figures = demo
    text = GUIDE.read_text()
    start = text.index("```text\n", text.index("## The demo")) + len("```text\n")
    documented = text[start : text.index("```", start)]
    assert "  layer 3 " in documented and "hook.last_stats" in documented  # the per-layer rows too
    assert table_mismatches(documented, proc.stdout) == [], "regenerate the table in docs/guides/transformers.md"
