"""Bad route values that used to pass the validating steps (issue 45, item 3).

`R3Collator(num_experts=)` / `collate_routes(num_experts=)` check every expert id against
the bound (it used to serve `filler="balanced"` only); `compact_routes`, the sender's
validating step, refuses a route that names one expert twice. Each refusal names the
sample, the row and the layer; the expected positions come from a plain Python scan.
"""

from __future__ import annotations

import numpy as np
import pytest

from torch_r3 import R3Collator, collate_routes, compact_routes
from torch_r3.routes import first_repeated_expert


def _routes(rows: int, layers: int, topk: int, experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :topk].astype(np.uint8)


def _first(routes: np.ndarray, bad) -> tuple[int, int]:
    """The reference: the first (row, layer) whose route `bad(route)` says is bad, scanned in Python."""
    for r in range(routes.shape[0]):
        for j in range(routes.shape[1]):
            if bad(routes[r, j].tolist()):
                return r, j
    raise AssertionError("no bad route")


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_the_collator_checks_ids_against_num_experts(dtype):
    samples = [{"input_ids": list(range(1, 6)), "routes": _routes(4, 3, 2, 16, s).astype(dtype)} for s in range(3)]
    samples[2]["routes"][2, 1, 1] = 200
    row, layer = _first(samples[2]["routes"], lambda route: max(route) >= 16)
    message = rf"routes\[2\] \(sample 2\): row {row}, layer {layer}: expert id 200 is outside \[0, num_experts=16\)"
    with pytest.raises(ValueError, match=message):
        R3Collator(pad_token_id=0, num_experts=16)(samples)
    with pytest.raises(ValueError, match=message):
        collate_routes([s["routes"] for s in samples], [5, 5, 5], num_experts=16)
    R3Collator(pad_token_id=0, num_experts=201)(samples)  # in range: collated
    R3Collator(pad_token_id=0)(samples)  # no bound given: the collator trusts the dtype, as documented


def test_the_collator_refuses_a_negative_id_when_num_experts_is_given():
    routes = _routes(3, 2, 2, 8, 0).astype(np.int16)
    routes[1, 0, 0] = -3
    with pytest.raises(ValueError, match=r"routes\[0\] \(sample 0\): row 1, layer 0: expert id -3 is outside"):
        collate_routes([routes], [4], num_experts=8)


def test_compact_routes_refuses_a_repeated_expert_naming_row_and_layer():
    routes = _routes(6, 4, 3, 32, 1).astype(np.int64)
    routes[4, 2, 2] = routes[4, 2, 0]
    row, layer = _first(routes, lambda route: len(set(route)) < len(route))
    assert (row, layer) == (4, 2)
    with pytest.raises(ValueError, match=r"traj 7: row 4, layer 2: route \[\d+, \d+, \d+\] names an expert twice"):
        compact_routes(routes, name="traj 7")
    for mode in ("warn", "count"):  # not an engine-health signature: refused in every mode
        with pytest.raises(ValueError, match="names an expert twice"):
            compact_routes(routes, health=mode)
    assert compact_routes(routes, health=None).shape == routes.shape  # health=None: the caller checked them


def test_an_all_zero_route_is_left_to_the_health_check():
    # A dense layer sends zeros: [0, 0] is no repeated-expert finding, and the health check knows dense layers.
    routes = _routes(5, 3, 2, 8, 2)
    routes[:, 0] = 0
    assert first_repeated_expert(routes) is None
    assert compact_routes(routes, health="count").dtype == np.uint8
    routes[3, 2] = [6, 6]
    assert first_repeated_expert(routes) == (3, 2)


@pytest.mark.parametrize("topk", [1, 2, 5, 8])
def test_first_repeated_expert_agrees_with_a_python_scan(topk):
    rng = np.random.default_rng(topk)
    routes = rng.integers(0, 12, (40, 3, topk)).astype(np.int16)
    expected = None
    for r in range(40):
        for j in range(3):
            route = routes[r, j].tolist()
            if expected is None and len(set(route)) < topk and any(route):
                expected = (r, j)
    assert first_repeated_expert(routes) == expected


def test_shard_collator_checks_ids_against_num_experts_too():
    from torch_r3 import ShardCollator

    samples = [{"input_ids": [1, 2, 3, 4], "routes": _routes(3, 2, 2, 16, s)} for s in range(4)]
    samples[3]["routes"][1, 1, 0] = 200
    shards = ShardCollator(lambda ids: [samples[i] for i in ids], [[0, 1], [2, 3]], pad_token_id=0, num_experts=16)
    batches = iter(shards)
    assert next(batches)["rollout_expert_indices"].shape[0] == 2  # the clean micro-batch collates
    with pytest.raises(ValueError, match=r"routes\[1\] \(sample 1\): row 1, layer 1: expert id 200 is outside"):
        next(batches)
