"""`benchmarks/route_tax.py` end to end on a tiny step: every stage runs and the routes arrive as they were sent.

No timing is asserted: the figures of a run this small mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _route_tax():
    spec = importlib.util.spec_from_file_location("route_tax_bench", ROOT / "benchmarks" / "route_tax.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["route_tax_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_a_tiny_step_goes_through_every_stage_and_each_rank_collates_its_samples():
    bench = _route_tax()
    args = argparse.Namespace(trajectories=6, tokens=96, layers=5, experts=64, topk=4, dp=2, micro_batch=2)
    rng = np.random.default_rng(0)
    base = bench.router_like(rng, args.tokens - 1, args.layers, args.experts, args.topk)
    spent = bench.one_step(args, base, rng)  # asserts each trace holds its body's routes, every sample collated
    assert set(spent) == {*bench.STAGES, "memcpy"} and all(v >= 0 for v in spent.values())
