"""The engine-health checks on routes a real vLLM returned (`fixtures/vllm_served_routes.json`).

`fixtures/make_vllm_served_fixtures.py` ran vLLM 0.30.0's OpenAI server over the tiny seeded
Qwen3-MoE checkpoint of `tests.engines.checkpoints` and recorded 24 requests: batched, one
prompt repeated (sampled and greedy), prompts sharing a 140-token prefix (prefix-cache hits),
two three-turn conversations with prompt starts. Here the checkpoint is rebuilt from its seed
and the routes are checked against its `transformers` forward first (so they are the model's
real choices), then: healthy as recorded, and each capture-bug signature found when the
recorded rows are broken the way an engine broke them.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from torch_r3.health.check import RouteHealthCheck, RouteHealthError

pytest.importorskip(
    "transformers", reason="the reference forward needs transformers: pip install 'torch_r3[transformers]'"
)

from tests.engines.checkpoints import QWEN3, load, reference_routes, sorted_rows

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_served_routes.json").read_text())
REQUESTS = [
    {**r, "routes": np.load(io.BytesIO(base64.b64decode(r["routes"])), allow_pickle=False)} for r in FIXTURE["requests"]
]
LAYERS = range(QWEN3.layers)


def tokens_of(r: dict) -> list[int]:
    """The token at each row's position: row j is token start + j of prompt + response."""
    ids = r["prompt"] + r["response"]
    return ids[r["start"] : len(ids) - 1]


def test_the_fixture_holds_the_models_own_choices(tmp_path):
    assert FIXTURE["vllm"] == "0.30.0"
    assert FIXTURE["checkpoint"]["seed"] == QWEN3.seed and FIXTURE["checkpoint"]["num_experts"] == QWEN3.num_experts
    model = load(QWEN3.write(tmp_path / "qwen3"))
    pairs = 0
    for r in REQUESTS:
        assert r["routes"].dtype == np.uint8 and r["routes"].shape[1:] == (QWEN3.layers, QWEN3.topk)
        ref, _ = reference_routes(model, (r["prompt"] + r["response"])[:-1])
        np.testing.assert_array_equal(sorted_rows(r["routes"]), ref[r["start"] :])
        pairs += r["routes"].shape[0] * r["routes"].shape[1]
    assert pairs > 6000
    assert {r["kind"] for r in REQUESTS} == {"batched", "repeated", "repeated-greedy", "shared-prefix", "multi-turn"}


def test_real_routes_raise_no_finding_in_one_shared_check():
    check = RouteHealthCheck(moe_layers=LAYERS, engine="vllm")
    for i, r in enumerate(REQUESTS):
        assert check.check(r["routes"], trajectory=f"request {i}", token_ids=tokens_of(r)) == ()
    assert check.stats.trajectories == len(REQUESTS) == 24
    assert check.stats.refused == 0


def longest() -> tuple[int, dict]:
    return max(enumerate(REQUESTS), key=lambda ir: ir[1]["routes"].shape[0])


def test_a_responses_rows_behind_other_tokens_are_a_replay():
    """The slot-reuse bug: a later request's rows are an earlier request's rows."""
    check = RouteHealthCheck(moe_layers=LAYERS, engine="vllm")
    i, donor = longest()
    check.check(donor["routes"], trajectory="donor", token_ids=tokens_of(donor))
    victim = next(r for r in REQUESTS if r["kind"] == "batched" and r["routes"].shape[0] >= 40 and r is not donor)
    rows = victim["routes"].shape[0]
    with pytest.raises(RouteHealthError, match="replayed_rows"):
        check.check(donor["routes"][:rows].copy(), trajectory="victim", token_ids=tokens_of(victim))


def test_a_zero_layer_and_a_stale_run_in_real_routes_are_found():
    _, r = longest()
    zeroed = r["routes"].copy()
    zeroed[:, 2] = 0
    with pytest.raises(RouteHealthError, match="zero_rows"):
        RouteHealthCheck(moe_layers=LAYERS).check(zeroed, trajectory="zeroed", token_ids=tokens_of(r))
    stale = r["routes"].copy()
    stale[10:40] = stale[10]
    with pytest.raises(RouteHealthError, match="stale_rows"):
        RouteHealthCheck(moe_layers=LAYERS).check(stale, trajectory="stale", token_ids=tokens_of(r))
