"""The engine-health checks (`torch_r3.health`, on by default at the client) on a real vLLM's routes.

Batched, repeated, greedy-repeated, prefix-sharing and multi-turn requests (`workload`), all
through one shared `RouteHealthCheck` in its default `"raise"` mode: not one finding, every
request checked, and every route equal to the independent `transformers` forward's choice.
"""

from __future__ import annotations

import pytest

from tests.engines.checkpoints import QWEN3
from tests.engines.workload import run_workload
from torch_r3.health.check import RouteHealthCheck

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_real_routes_raise_no_health_finding_over_many_requests(server, reference, agreement):
    health = RouteHealthCheck(moe_layers=range(QWEN3.layers), engine="vllm")  # every layer is MoE: a zero row counts
    served = run_workload(server.url, health)
    assert len(served) == 24
    stats = health.stats.as_dict()
    rows = sum(s.routes.shape[0] for s in served)
    assert stats == {
        "trajectories": 24,
        "rows": rows,
        "zero_rows": 0,
        "constant_layers": 0,
        "stale_rows": 0,
        "replayed_rows": 0,
        "refused": 0,
        "accepted_unhealthy": 0,
        "uninformative": 0,  # 16 experts, top-4: every check carries information
    }
    greedy = [s for s in served if s.kind == "repeated-greedy"]
    assert greedy[0].response == greedy[1].response and (greedy[0].routes == greedy[1].routes).all()
    for s in served:
        agreement.check(s.routes, s.prompt + s.response, reference["qwen3"], start=s.start, what=s.kind)
