"""`benchmarks/frameworks.py` calls only `torch_r3`'s current API (issue 44.6).

Its cases run here at toy sizes (2 layers, top-2 of 8 experts, a few short
trajectories), every one of `torch_r3`'s deprecation warnings an error: a
deprecated keyword anywhere in the benchmark's calls fails the run. No timing is
looked at; the benchmark's own equality checks (its outputs against SkyRL's and
verl's) run as they do at full size.
"""

from __future__ import annotations

import argparse
import warnings
from importlib.metadata import version

import pytest

from tests.integrations.frameworks import installed, requires

pytestmark = [requires("skyrl")]

pytest.importorskip("megatron.core.transformer.moe.router_replay")


def test_the_frameworks_benchmark_runs_with_torch_r3s_deprecations_as_errors(world_of_one, monkeypatch):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from benchmarks import frameworks as bench, frameworks_common as common

    monkeypatch.setattr(RouterReplay, "global_router_replay_instances", [])  # the benchmark sets its own
    # The case modules read the sizes from `frameworks_common` when they run: patched there, they shrink.
    monkeypatch.setattr(common, "L", 2)
    monkeypatch.setattr(common, "K", 2)
    monkeypatch.setattr(common, "EXPERTS", 8)
    lengths = common.rl_lengths
    monkeypatch.setattr(common, "rl_lengths", lambda batch, prompt, response, seed=0: lengths(batch, 12, 20, seed))
    args = argparse.Namespace(batch=4, micro_batch=2, step_batch=3, verl_micro_batch=2, rounds=1, torch_threads=1)
    args.skyrl = version("skyrl")
    cases = [bench.skyrl, bench.skyrl_worker_step]
    if installed("verl"):
        args.verl = version("verl")
        cases += [bench.verl, bench.verl_agent_loop_step, bench.verl_engine_step]
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=r".*(is deprecated[:;] use | moved to torch_r3\.)", category=DeprecationWarning
        )
        for case in cases:
            case(args)
