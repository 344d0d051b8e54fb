"""The health checks give, finding for finding, what the whole-array reference gives (`tests/reference_health.py`).

The package reads routes as packed words and screens with row hashes; the
reference makes one full boolean pass per question. Both see the same
sequences of route arrays, healthy ones from `tests.samples.router_routes` and
broken ones made from them the way the engine bugs make them (zero rows and
layers, a layer stuck on one row, a stale run of one row, rows copied from an
earlier response behind other tokens), in every dtype a caller may pass, with
and without token ids, layer maps and `num_experts`. Kind, layer, rows and the
words of each finding, and every counter, must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.reference_health import ReferenceHealth
from tests.samples import router_routes
from torch_r3.health.check import RouteHealthCheck


def damage(rng: np.random.Generator, routes: np.ndarray, earlier: list[np.ndarray]) -> np.ndarray:
    """One of the engine bugs' signatures (or none), applied to a copy of `routes`."""
    out = routes.copy()
    rows, layers, _ = out.shape
    kind = int(rng.integers(0, 8))
    a = int(rng.integers(0, max(rows, 1)))
    b = int(rng.integers(a, rows + 1)) if rows else 0
    if kind == 1:
        out[a:b] = 0  # rows zero in every layer
    elif kind == 2 and rows:
        out[a:b, int(rng.integers(0, layers))] = 0  # one layer's rows zero
    elif kind == 3 and rows:
        out[:, int(rng.integers(0, layers))] = out[0, 0]  # a layer stuck on one row
    elif kind == 4 and rows:
        out[a:b] = out[a]  # a stale run
    elif kind == 5 and earlier and rows:
        src = earlier[int(rng.integers(0, len(earlier)))]
        n = min(b - a, src.shape[0])
        if n:
            s = int(rng.integers(0, src.shape[0] - n + 1))
            out[a : a + n] = src[s : s + n]  # rows replayed from an earlier response
    elif kind == 6 and rows:
        out[a:b] = out[a:b, :1]  # every layer the same row as the first
    return out


def as_caller_dtype(rng: np.random.Generator, routes: np.ndarray) -> np.ndarray:
    """The routes in one of the forms a caller may pass: any integer dtype, byte order or strides."""
    form = int(rng.integers(0, 6))
    if form == 1:
        return routes.astype(np.int64)
    if form == 2:
        return routes.astype(">i2")  # big-endian
    if form == 3:
        return routes.astype(np.int32)
    if form == 4:
        wide = np.zeros((routes.shape[0], routes.shape[1], routes.shape[2] * 2), routes.dtype)
        wide[..., ::2] = routes
        return wide[..., ::2]  # not contiguous
    if form == 5:
        return routes.astype(np.uint16)
    return routes


def findings_of(check: RouteHealthCheck, routes, tokens, name):
    return [(f.kind, f.layer, f.rows, f.seen) for f in check.check(routes, trajectory=name, token_ids=tokens)]


@pytest.mark.parametrize("seed", range(8))
def test_every_finding_and_counter_agrees_with_the_reference(seed):
    rng = np.random.default_rng(seed)
    layers, topk = int(rng.integers(1, 7)), int(rng.integers(1, 10))
    experts = int(rng.choice([topk, topk + 1, 2 * topk, 64, 300]))
    if seed == 0:
        experts, topk = 2, 1  # two experts, top-1: at most two rows per layer
    moe = sorted(rng.choice(layers, int(rng.integers(0, layers + 1)), replace=False).tolist())
    known = experts if rng.random() < 0.7 else None
    kwargs = {"min_rows": int(rng.choice([4, 64])), "min_run": int(rng.choice([2, 3, 16])), "remember_blocks": 64}
    check = RouteHealthCheck("count", moe_layers=moe, num_experts=known, **kwargs)
    reference = ReferenceHealth(moe_layers=moe, num_experts=known, **kwargs)
    earlier: list[np.ndarray] = []
    kinds = set()
    for i in range(150):
        rows = int(rng.choice([0, 1, 2, 5, 17, 40, 70, 200]))
        skew = float(rng.choice([0.5, 1.2, 3.0]))
        healthy = router_routes(rng, rows, layers, topk, num_experts=experts, dtype=np.int32, skew=skew)
        routes = as_caller_dtype(rng, damage(rng, healthy, earlier))
        vocab = int(rng.choice([2, 50, 50_000]))
        tokens = rng.integers(0, vocab, rows) if rng.random() < 0.8 else None
        if tokens is not None and rng.random() < 0.3:
            tokens = tokens.astype(np.uint64)
        got = findings_of(check, routes, tokens, f"t{i}")
        want = reference.check(np.asarray(routes, np.int64), tokens, f"t{i}")
        assert got == want, (i, routes.dtype, routes.shape)
        kinds.update(k for k, *_ in got)
        earlier.append(np.asarray(routes, np.int32))
    stats = check.stats.as_dict()
    for key in ("trajectories", "rows", "uninformative"):
        assert stats[key] == reference.stats[key]
    for kind, field in [("zero_rows", "zero_rows"), ("constant_layer", "constant_layers"),
                        ("stale_rows", "stale_rows"), ("replayed_rows", "replayed_rows")]:  # fmt: skip
        assert stats[field] == reference.stats[kind]
    if known is not None and (known == topk or (known, topk) == (2, 1)):
        assert stats["uninformative"] == 150  # every check skipped the row-identity checks, and said so
    else:
        assert kinds  # the damage did make findings


def test_the_memory_agrees_with_the_reference_over_a_long_run_past_its_bound():
    # Many responses through a small memory: the same blocks are remembered, refreshed and dropped.
    rng = np.random.default_rng(7)
    check = RouteHealthCheck("count", remember_blocks=40)
    reference = ReferenceHealth(remember_blocks=40)
    sent: list[tuple[np.ndarray, np.ndarray]] = []
    for i in range(150):
        if sent and rng.random() < 0.3:
            old_routes, old_tokens = sent[int(rng.integers(0, len(sent)))]
            routes = router_routes(rng, old_routes.shape[0], 3, 4, num_experts=64, skew=1.2)
            a = int(rng.integers(0, max(old_routes.shape[0] - 40, 1)))
            routes[a : a + 40] = old_routes[a : a + 40]  # a replay, found only if its block is still remembered
            tokens = rng.integers(0, 1000, routes.shape[0]) if rng.random() < 0.7 else old_tokens  # or a resend
        else:
            n = int(rng.choice([16, 33, 64, 130]))
            routes = router_routes(rng, n, 3, 4, num_experts=64, skew=1.2)
            tokens = rng.integers(0, 1000, n)
        got = findings_of(check, routes, tokens, f"r{i}")
        assert got == reference.check(routes.astype(np.int64), tokens, f"r{i}"), i
        assert len(check.memory) == len(reference.memory.blocks)
        sent.append((routes, tokens))
    assert check.stats.replayed_rows == reference.stats["replayed_rows"] > 0
