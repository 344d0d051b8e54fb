"""The whole path, as a user runs it: torch_r3.demo (also `torch-r3 demo`).

Rollouts on a bf16 Megatron model behind the loopback server, a DataLoader with
R3Collator and two worker processes, and an fp32 training step through
Megatron's schedule with ReplayHook (uncaptured="live", the default, and
"replay") and without it. Each run is its own process, started in a temporary
folder: the demo sets up its own gloo world and Megatron parallel state. The
default run is the session's `megatron_demo` (tests/conftest.py), shared with
the tutorial's figure checks; the error paths start their own.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from torch_r3.demo import DemoConfig
from torch_r3.testing import LoopbackServer, TinyMoELM

pytestmark = pytest.mark.slow


def run_demo(*args: str, cwd, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch_r3.demo", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def demo(megatron_demo):
    """The session's one default `torch-r3 demo` run (tests/conftest.py; the tutorial's figure
    checks read the same run): (the run, with its stdout and stderr; its --json figures)."""
    return megatron_demo, megatron_demo.figures


def test_replay_makes_training_routes_equal_the_rollouts_and_cuts_the_logprob_gap(demo):
    proc, figures = demo
    assert set(figures) == {"with_replay", "with_replay_filler", "without_replay"}
    live, filler, without = figures["with_replay"], figures["with_replay_filler"], figures["without_replay"]
    # Every captured token's training-side experts are the rollout's, in both modes...
    assert live["route_agreement"] == 1.0 and filler["route_agreement"] == 1.0
    # ...while bf16-vs-fp32 numerics really flip some near-tie choices without replay.
    assert 0.9 < without["route_agreement"] < 1.0
    assert live["logprob_abs_diff"] < without["logprob_abs_diff"]
    assert live["k3_kl"] < without["k3_kl"]
    assert "route agreement, captured tokens" in proc.stdout


def test_live_routing_at_uncaptured_positions_tracks_the_inference_model_far_better_than_filler_routes(demo):
    proc, figures = demo
    live, filler = figures["with_replay"], figures["with_replay_filler"]
    # One synthetic EOS per configured trajectory, predicted from the never-evaluated last sampled token.
    assert live["uncaptured_tokens"] == len(DemoConfig().synthetic_eos)
    assert live["uncaptured_logprob_abs_diff"] < filler["uncaptured_logprob_abs_diff"]
    # Live routing leaves only numerics: the same order as the gap on sampled tokens.
    assert live["uncaptured_logprob_abs_diff"] < 10 * live["logprob_abs_diff"]
    # Sampled (captured) tokens do not depend on the mode.
    assert live["logprob_abs_diff"] == filler["logprob_abs_diff"]


def test_route_drift_is_nonzero_per_layer_and_of_the_order_of_the_disagreement_without_replay(demo):
    proc, figures = demo
    drift = figures["with_replay"]["stats"]["route_drift"]
    disagreement = [1 - a for a in figures["without_replay"]["route_agreement_per_layer"]]
    assert len(drift) == len(disagreement) == DemoConfig().num_layers
    assert all(d > 0 for d in drift)
    # The first router sees the same hidden states with or without replay, so
    # its drift is exactly the no-replay disagreement; deeper layers see the
    # replayed (inference-like) history, and stay within a small factor of it.
    assert drift[0] == pytest.approx(disagreement[0])
    for d, x in zip(drift, disagreement):
        assert x / 4 <= d <= 4 * x
    # Drift compares each router's own choice with the captured route: it does not depend on the mode.
    assert figures["with_replay_filler"]["stats"]["route_drift"] == drift


def test_last_stats_count_live_and_filler_tokens_and_the_demo_prints_them(demo):
    proc, figures = demo
    live, filler = figures["with_replay"]["stats"], figures["with_replay_filler"]["stats"]
    captured = figures["with_replay"]["tokens"]
    assert live["tokens"]["captured"] == filler["tokens"]["captured"] == captured
    assert live["tokens"]["live"] > 0 and live["tokens"]["filler"] == 0
    assert filler["tokens"]["live"] == 0 and filler["tokens"]["filler"] == live["tokens"]["live"]
    assert live["live_fraction"] == pytest.approx(live["tokens"]["live"] / (captured + live["tokens"]["live"]))
    assert filler["live_fraction"] == 0.0
    # Fixed by the rollout shape: each trajectory's last sampled token and each synthetic EOS
    # have no route; the left padding of the shorter rows is no real token, counted apart.
    cfg = DemoConfig()
    assert live["tokens"]["live"] == cfg.trajectories + len(cfg.synthetic_eos)
    rows = range(cfg.trajectories)
    padding = 0
    for start in range(0, cfg.trajectories, cfg.micro_batch_size):
        extra = [int(i in cfg.synthetic_eos) for i in rows[start : start + cfg.micro_batch_size]]
        padding += sum(max(extra) - e for e in extra)
    assert live["tokens"]["padding"] == filler["tokens"]["padding"] == padding > 0
    for mode in ("live", "replay"):
        assert f'hook.last_stats with uncaptured="{mode}":' in proc.stdout
    assert "route_drift     layer 0" in proc.stdout


def test_demo_warns_nothing_by_default_and_hides_megatrons_fallback_notices(demo):
    proc, _ = demo
    n = len(DemoConfig().synthetic_eos)  # the synthetic EOS it appends: counted in its table, not warned about
    assert f" {n} loss-active tokens predicted from an uncaptured position" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
    for notice in ("Apex", "Transformer Engine", "moe_ffn_hidden_size", "full scope is deprecated", "absl"):
        assert notice not in proc.stderr


def test_unreachable_server_stops_with_a_clear_message(tmp_path):
    with LoopbackServer() as srv:
        url = srv.url  # a port that refuses connections once the server is gone
    # Through the command line this time: `torch-r3 demo` runs the same example.
    proc = subprocess.run(
        [sys.executable, "-m", "torch_r3", "demo", "--quiet", "--server-url", url, "--retries", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"the inference server at {url} is unreachable" in proc.stderr
    assert "after 3 attempt(s)" in proc.stderr


def test_server_with_another_model_shape_is_refused_before_training(tmp_path):
    with LoopbackServer(TinyMoELM(num_layers=2, num_experts=8, topk=2)) as srv:
        proc = run_demo("--server-url", srv.url, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "does not match the trainer's (num_layers: server 2, trainer 4)" in proc.stderr
    assert "fp32 training" not in proc.stderr
