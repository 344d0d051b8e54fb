"""The whole path, as a user runs it: torch_r3.demo (also `torch-r3 demo`).

Rollouts on a bf16 Megatron model behind the loopback server, a DataLoader with
R3Collator and two worker processes, and an fp32 training step through
Megatron's schedule with and without ReplayHook. Each run is its own process:
the demo sets up its own gloo world and Megatron parallel state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from torch_r3.testing import LoopbackServer, TinyMoELM

REPO = Path(__file__).resolve().parents[2]


def run_demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch_r3.demo", "--quiet", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_replay_makes_training_routes_equal_the_rollouts_and_cuts_the_logprob_gap(tmp_path):
    out = tmp_path / "figures.json"
    proc = run_demo("--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures) == {"with_replay", "without_replay"}
    for side in figures.values():
        assert set(side) == {"route_agreement", "logprob_abs_diff", "k3_kl"}
    with_r, without = figures["with_replay"], figures["without_replay"]
    # Every real token's training-side experts are the rollout's...
    assert with_r["route_agreement"] == 1.0
    # ...while bf16-vs-fp32 numerics really flip some near-tie choices without replay.
    assert 0.9 < without["route_agreement"] < 1.0
    assert with_r["logprob_abs_diff"] < without["logprob_abs_diff"]
    assert with_r["k3_kl"] < without["k3_kl"]
    # The synthetic EOS of trajectory 0 is loss-active in an uncaptured tail: warned, with a count.
    assert "1 loss-active token(s)" in proc.stderr
    assert "route agreement" in proc.stdout


def test_unreachable_server_stops_with_a_clear_message():
    with LoopbackServer() as srv:
        url = srv.url  # a port that refuses connections once the server is gone
    # Through the command line this time: `torch-r3 demo` runs the same example.
    proc = subprocess.run(
        [sys.executable, "-m", "torch_r3", "demo", "--quiet", "--server-url", url, "--retries", "2"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert f"the inference server at {url} is unreachable" in proc.stderr
    assert "after 3 attempt(s)" in proc.stderr


def test_server_with_another_model_shape_is_refused_before_training():
    with LoopbackServer(TinyMoELM(num_layers=2, num_experts=8, topk=2)) as srv:
        proc = run_demo("--server-url", srv.url, timeout=120)
    assert proc.returncode == 2
    assert "does not match the trainer's (num_layers: server 2, trainer 4)" in proc.stderr
    assert "fp32 training" not in proc.stderr
