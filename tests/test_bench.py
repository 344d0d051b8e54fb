"""The benchmark engine: its synthetic batches, its strategies and its checks.

Every strategy is compared with a plain position-by-position reference written
here from DESIGN.md, independent of torch_r3.collate. No timing is asserted.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from torch_r3 import bench

TINY = dict(num_sequences=6, max_seqlen=40, num_layers=3, topk=2, repeats=1)


def reference_padded(routes, counts):
    """[B, T, L, K] left-padded with arange(K) rows, filled one position at a time."""
    order = [np.uint8, np.int16, np.int32]
    dtype = order[max(order.index(r.dtype.type) for r in routes)]
    B, T = len(routes), max(counts)
    L, K = routes[0].shape[1:]
    out = np.zeros((B, T, L, K), dtype)
    mask = np.zeros((B, T), bool)
    att = np.zeros((B, T), np.int64)
    for i in range(B):
        s = T - counts[i]
        for t in range(T):
            j = t - s
            if 0 <= j < routes[i].shape[0]:
                out[i, t] = routes[i][j]
            else:
                out[i, t] = np.arange(K)
                mask[i, t] = True
            att[i, t] = int(t >= s)
    return {"rollout_expert_indices": out, "router_padding_mask": mask, "attention_mask": att}


def reference_packed(routes, counts):
    L, K = routes[0].shape[1:]
    rows, mask = [], []
    for r, n in zip(routes, counts):
        for j in range(n):
            rows.append(r[j] if j < r.shape[0] else np.arange(K).repeat(1)[None].repeat(L, 0))
            mask.append(j >= r.shape[0])
    order = [np.uint8, np.int16, np.int32]
    dtype = order[max(order.index(r.dtype.type) for r in routes)]
    return {
        "rollout_expert_indices": np.array(rows, dtype=dtype).reshape(-1, L, K),
        "router_padding_mask": np.array(mask, bool),
        "cu_seqlens": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
    }


def assert_same(got, want):
    assert set(got) == set(want)
    for key, w in want.items():
        w = torch.from_numpy(np.ascontiguousarray(w))
        assert got[key].dtype == w.dtype, key
        assert torch.equal(got[key], w), key


@pytest.mark.parametrize("distribution", bench.DISTRIBUTIONS)
def test_lengths_stay_in_range_and_reach_the_named_mean(distribution):
    lengths = bench.sequence_lengths(distribution, 2048, 4096, np.random.default_rng(1))
    assert lengths.dtype == np.int64 and lengths.min() >= 1 and lengths.max() <= 4096
    want = {"uniform": 4096 / 2, "mild_ragged": 4096 / 2, "typical_rl": 4096 / 16, "heavy_tail": 4096 / 64}
    assert abs(lengths.mean() - want[distribution]) < 0.1 * want[distribution]
    if distribution != "uniform":
        assert lengths.max() == 4096  # a few rollouts hit the generation limit


def test_batch_rows_are_tokens_minus_one_and_a_few_eos_rows_are_tokens_minus_two():
    batch = bench.make_batch(bench.BenchConfig(num_sequences=64, max_seqlen=50, num_layers=2, topk=4))
    gaps = [n - r.shape[0] for r, n in zip(batch.routes, batch.token_counts)]
    assert set(gaps) <= {1, 2} and gaps.count(2) == 4  # one in 16 carries a synthetic EOS
    for r in batch.routes:
        assert r.dtype == np.uint8 and r.flags.c_contiguous
        assert (r < 128).all()
        assert all(len(set(row)) == 4 for row in r.reshape(-1, 4).tolist())  # K distinct experts


def test_the_batch_is_a_function_of_the_seed():
    a = bench.make_batch(bench.BenchConfig(**TINY, seed=3))
    b = bench.make_batch(bench.BenchConfig(**TINY, seed=3))
    c = bench.make_batch(bench.BenchConfig(**TINY, seed=4))
    assert a.token_counts == b.token_counts and all(np.array_equal(x, y) for x, y in zip(a.routes, b.routes))
    assert a.token_counts != c.token_counts


def test_mixed_dtypes_batch_holds_uint8_and_int16_senders():
    batch = bench.make_batch(bench.BenchConfig(**TINY, mixed_dtypes=True))
    assert {r.dtype for r in batch.routes} == {np.dtype(np.uint8), np.dtype(np.int16)}
    assert batch.dtype == np.int16


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(distribution="typical_rl"), dict(distribution="heavy_tail", mixed_dtypes=True),
     dict(distribution="mild_ragged", num_experts=300, topk=3)],
    ids=["uniform", "typical_rl", "heavy_tail-mixed", "int16"],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_every_strategy_matches_the_plain_reference(shape, workers):
    batch = bench.make_batch(bench.BenchConfig(**{**TINY, **shape}))
    padded = reference_padded(batch.routes, batch.token_counts)
    packed = reference_packed(batch.routes, batch.token_counts)
    for name in bench.STRATEGIES:
        out = bench.run_strategy(name, batch, workers=workers)
        if name == bench.MEMCPY:
            assert out is None
        else:
            assert_same(out, packed if name == bench.PACKED else padded)


def test_strategies_match_the_reference_past_the_pool_threshold():
    # Big enough (> 4 MiB of output) that torch_r3 really uses its pool.
    batch = bench.make_batch(bench.BenchConfig(num_sequences=8, max_seqlen=2048, num_layers=40, topk=8))
    want = reference_padded(batch.routes, batch.token_counts)
    for name in (bench.FRESH, bench.REUSED, bench.PAD_SEQUENCE):
        assert_same(bench.run_strategy(name, batch, workers=2), want)


def test_run_shape_checks_then_times_every_strategy():
    result = bench.run_shape(bench.BenchConfig(**{**TINY, "repeats": 2}))
    assert [s.name for s in result.strategies] == list(bench.STRATEGIES)
    for s in result.strategies:
        assert len(s.times_s) == 2 and s.min_s <= s.median_s <= s.max_s
        if s.name == bench.BASELINE:
            assert s.checked_against is None and s.speedup_vs_baseline == 1.0
        elif s.name != bench.MEMCPY:
            assert s.checked_against == bench.BASELINE
    assert result.get(bench.MEMCPY).ratio_to_memcpy == 1.0


def test_a_strategy_that_differs_from_the_first_is_refused(monkeypatch):
    def wrong(ctx):
        out = bench._fresh(ctx)
        out["rollout_expert_indices"].view(-1)[0] += 1
        return out

    monkeypatch.setitem(bench._FUNCS, bench.FRESH, wrong)
    with pytest.raises(AssertionError, match="torch_r3 fresh.*not bit-identical"):
        bench.run_shape(bench.BenchConfig(**TINY), [bench.BASELINE, bench.FRESH])


def test_memory_check_refuses_a_run_that_does_not_fit():
    config = bench.BenchConfig(**bench.PRESETS["production"])
    need = bench.estimate_memory(config)
    assert need > 100 * 2**30
    short = lambda: {"available": 8 * 2**30, "mem_available": 8 * 2**30, "cgroup_room": None, "cgroup": None}
    with pytest.raises(bench.InsufficientMemoryError, match=r"needs about .* GiB"):
        bench.check_memory(config, short)
    plenty = lambda: {"available": need + 1, "mem_available": need + 1, "cgroup_room": None, "cgroup": None}
    assert bench.check_memory(config, plenty) == need


def test_available_memory_reports_meminfo():
    mem = bench.available_memory()
    assert mem["mem_available"] is None or mem["mem_available"] > 0
    assert mem["available"] is None or mem["available"] <= (mem["mem_available"] or mem["available"])


def test_peak_memory_is_per_call_not_process_lifetime():
    big = np.ones(200 << 20, np.uint8)  # an earlier, larger peak
    del big
    with bench._PeakRss() as peak:
        small = np.ones(32 << 20, np.uint8)
    del small
    assert 30 << 20 <= peak.extra < 150 << 20


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(distribution="zipf"), "distribution must be one of"),
        (dict(topk=200), "topk=200 needs at least"),
        (dict(num_experts=300, dtype="uint8"), "need int16"),
        (dict(mixed_dtypes=True, dtype="uint8"), "mixed_dtypes"),
        (dict(num_sequences=0), "num_sequences must be >= 1"),
        (dict(warmup=0), "warmup"),
    ],
)
def test_bad_configs_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.BenchConfig(**kwargs)


def test_dtype_follows_the_expert_count():
    assert bench.BenchConfig().dtype == "uint8" and bench.BenchConfig().num_experts == 128
    assert bench.BenchConfig(num_experts=256).dtype == "uint8"
    assert bench.BenchConfig(num_experts=257).dtype == "int16"
    assert dataclasses.replace(bench.BenchConfig(), dtype="int16").num_experts == 128
