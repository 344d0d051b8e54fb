"""The shared sample builder makes what its callers assume: distinct experts per token, the asked shapes and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.samples import route_samples, router_routes


@pytest.mark.parametrize("skew", [None, 1.2])
@pytest.mark.parametrize(("topk", "experts"), [(1, 1), (2, 2), (3, 7), (8, 8), (8, 300)])
def test_router_routes_choose_distinct_experts_per_token_and_layer(topk, experts, skew):
    routes = router_routes(0, 200, 3, topk, num_experts=experts, dtype=np.int16, skew=skew)
    assert routes.shape == (200, 3, topk) and routes.dtype == np.int16
    assert routes.min() >= 0 and routes.max() < experts
    assert all(len(set(row.tolist())) == topk for row in routes.reshape(-1, topk))


def test_router_routes_are_seeded_and_a_skew_favours_some_experts():
    assert np.array_equal(router_routes(4, 50, 2, 2), router_routes(4, 50, 2, 2))
    counts = np.bincount(router_routes(1, 4000, 1, 2, num_experts=16, skew=2.0).reshape(-1), minlength=16)
    assert counts.max() > 4 * counts.min() + 1  # the favourite expert is chosen far more often than the rarest


def test_route_samples_follow_the_lengths_capture_dtypes_and_dense_layers():
    samples = route_samples(
        3,
        [5, None, 1],
        max_tokens=9,
        captured="all_but_last",
        num_layers=4,
        moe_layers=[0, 2],
        dtypes=(np.uint8, np.int16),
        extras=("loss_mask", "reward", "prompt_length", "uid"),
    )
    lengths = [len(s["input_ids"]) for s in samples]
    assert lengths[0] == 5 and 1 <= lengths[1] <= 9 and lengths[2] == 1
    for i, (s, n) in enumerate(zip(samples, lengths)):
        assert s["routes"].shape == (n - 1, 4, 2)
        assert s["routes"].dtype == (np.uint8, np.int16)[i % 2]
        assert not s["routes"][:, [1, 3]].any()  # dense layers: zero rows
        assert s["loss_mask"].shape == (n,) and 0 <= s["prompt_length"] <= n and s["uid"] == i
    some = route_samples(0, n=20, max_tokens=6)
    assert all(0 <= len(s["routes"]) <= len(s["input_ids"]) for s in some)
    assert len({len(s["routes"]) for s in some}) > 1
