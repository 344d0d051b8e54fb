"""The cluster-scale contract: every rank's micro-batches are slices of one global batch.

A DP 2 x PP 2 job is simulated in one process: each (data-parallel rank,
pipeline stage) pair builds its own `ShardCollator` over its micro-batches of
`plan_microbatches`, with the global `seq_len` and `dtype` of `global_geometry`
and the stage's `layers`. Every micro-batch must equal, bit for bit and dtype
for dtype, the matching part of one global `R3Collator` batch (itself checked
against the independent reference): padded, the micro-batch's rows (and the
stage's layers); packed, the micro-batch's samples' spans of the global batch,
concatenated (a micro-batch is its own pack, so its `cu_seqlens` restart at 0).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.reference_collate import assert_batch_equal, reference_r3_collator
from tests.samples import route_samples
from tests.spelling import torch_r3_options
from torch_r3 import (
    BufferPool,
    Memory,
    Padded,
    R3Collator,
    ShardCollator,
    collate_routes,
    global_geometry,
    plan_microbatches,
)

L, K, EXPERTS = 4, 2, 7
STAGES = ([0, 1], [2, 3])  # PP 2: each stage's MoE layers


def make_global(seed, wide):
    """The shared global batch, 8 to 14 samples; with `wide`, every third sample (from the second) int16."""
    return route_samples(
        seed,
        n=(8, 15),
        max_tokens=23,
        num_layers=L,
        topk=K,
        num_experts=EXPERTS,
        dtypes=(np.uint8, np.int16, np.uint8) if wide else (np.uint8,),
        extras=("loss_mask", "reward"),
    )


def expected_part(full, indices, layers, layout):
    """The global batch's part that micro-batch `indices` (and stage `layers`) must equal."""
    if layout == "padded":
        want = {k: v[indices] for k, v in full.items()}
        want["rollout_expert_indices"] = want["rollout_expert_indices"][:, :, layers]
        return want
    cu = full["cu_seqlens"].tolist()
    want = {"reward": full["reward"][indices]}
    for key in ("rollout_expert_indices", "router_padding_mask", "input_ids", "loss_mask"):
        want[key] = torch.cat([full[key][cu[i] : cu[i + 1]] for i in indices])
    want["rollout_expert_indices"] = want["rollout_expert_indices"][:, layers]
    spans = [cu[i + 1] - cu[i] for i in indices]
    want["cu_seqlens"] = torch.tensor([0, *np.cumsum(spans)], dtype=torch.int32)
    return want


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("padding", ["arange", "balanced"])
@pytest.mark.parametrize("wide", [False, True], ids=["uint8", "int16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_microbatch_of_every_rank_equals_its_part_of_the_global_batch(seed, padding, wide, layout):
    samples = make_global(seed, wide)
    counts = [len(s["input_ids"]) for s in samples]
    experts = EXPERTS if padding == "balanced" else None
    opts = {"layout": layout, "filler": padding, "num_experts": experts, "pad_token_id": 3}
    opts["pad_keys"] = {"loss_mask": -1.0}
    full = R3Collator(**torch_r3_options(**opts))(samples)
    reference = reference_r3_collator(
        samples,
        pad_token_id=3,
        layout=layout,
        pad_keys={"loss_mask": (-1.0, np.float32)},
        filler=padding,
        num_experts=opts["num_experts"],
    )
    assert_batch_equal(full, reference)  # the global batch itself is right
    kernel = collate_routes(
        [s["routes"] for s in samples], counts, layout=layout, filler=padding, num_experts=opts["num_experts"]
    )
    for key, value in kernel.items():  # R3Collator's routes are collate_routes' own
        assert torch.equal(full[key], value), key

    geometry = global_geometry(
        counts, {s["routes"].dtype for s in samples}, filler=padding, num_experts=opts["num_experts"]
    )
    assert geometry.dtype == full["rollout_expert_indices"].numpy().dtype
    if layout == "padded":
        assert geometry.seq_len == full["attention_mask"].shape[1]
    seq_len = geometry.seq_len if layout == "padded" else None
    plan = plan_microbatches(counts, dp_size=2, micro_batch_size=3)
    assert len(plan[0]) == len(plan[1])
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(samples)))

    fetched = []
    for rank in range(2):
        for stage, layers in enumerate(STAGES):

            def fetch(indices, rank=rank, stage=stage):
                fetched.append((rank, stage, tuple(indices)))
                return [samples[i] for i in indices]

            shard = ShardCollator(
                fetch,
                plan[rank],
                dtype=geometry.dtype,
                keep_layers=layers,
                prefetch=stage == 1,
                **torch_r3_options(seq_len=seq_len, **opts),
            )
            got = list(shard)  # all kept alive here: the values must survive recycling
            assert len(got) == len(plan[rank])
            for indices, batch in zip(plan[rank], got):
                want = expected_part(full, indices, layers, layout)
                assert set(batch) == set(want)
                for key, value in want.items():
                    assert batch[key].dtype == value.dtype, (key, batch[key].dtype, value.dtype)
                    assert torch.equal(batch[key], value), (rank, stage, indices, key)
    assert sorted(fetched) == sorted((r, s, tuple(mb)) for r in range(2) for s in range(2) for mb in plan[r])


def test_a_for_loop_keeps_two_microbatches_of_buffers():
    samples = make_global(5, wide=True)
    counts = [len(s["input_ids"]) for s in samples]
    geometry = global_geometry(counts, {np.uint8, np.int16})
    mbs = [[i] for i in range(len(samples))]
    shard = ShardCollator(
        lambda idx: [samples[i] for i in idx],
        mbs,
        layout=Padded(seq_len=geometry.seq_len),
        dtype=np.int16,
        pad_keys=["loss_mask"],
        pad_token_id=0,
    )
    addresses = set()
    for batch in shard:
        addresses |= {t.data_ptr() for t in batch.values() if isinstance(t, torch.Tensor) and t.dim() > 1}
    # Equal shapes every step: after the first two micro-batches nothing new is mapped.
    stats = shard.collator.buffers.stats()
    assert len(samples) >= 8
    assert stats["misses"] == 2 * 5, stats  # routes, router mask, attention mask, input_ids, loss_mask
    assert len(addresses) == 2 * 5


def test_prefetch_fetches_the_next_microbatch_while_the_current_one_is_held():
    samples = make_global(6, wide=False)
    fetching_next, release = threading.Event(), threading.Event()

    def fetch(indices):
        if indices == [1]:
            fetching_next.set()
            release.wait(timeout=60)
        return [samples[i] for i in indices]

    shard = ShardCollator(fetch, [[0], [1], [2]], prefetch=True, pad_keys=["loss_mask"], pad_token_id=0)
    it = iter(shard)
    first = next(it)
    # The caller holds micro-batch 0 and has not asked for more: the fetch of 1 has begun anyway.
    assert fetching_next.wait(timeout=60)
    release.set()
    rest = list(it)
    assert [b["input_ids"][0, -1].item() for b in [first, *rest]] == [s["input_ids"][-1] for s in samples[:3]]


class _WaitingSample(dict):
    """A sample whose routes are read only after `written` is set (or a second passed).

    On the main thread the collator reads a sample's routes while it collates it: this
    holds that read until the prefetched `fetch` of the next micro-batch has written the
    shared buffer, if that fetch runs during the collation at all.
    """

    written: threading.Event | None = None

    def __getitem__(self, key):
        if key == "routes" and self.written is not None:
            self.written.wait(timeout=1)
        return super().__getitem__(key)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_prefetch_never_runs_a_fetch_into_one_reused_buffer_while_the_current_microbatch_is_collated(layout):
    # Issue 43.2: prefetch=True began fetch(k + 1) before collating micro-batch k; a fetch that
    # decodes into one reused buffer then overwrote k's rows while they were copied.
    store = make_global(9, wide=False)
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]
    buffer = np.empty((2 * 23, L, K), np.uint8)  # one micro-batch's rows, reused by every fetch
    written = threading.Event()

    def fetch(indices):
        out, start = [], 0
        for i in indices:
            routes = store[i]["routes"]
            view = buffer[start : start + len(routes)]
            view[...] = routes
            start += len(routes)
            out.append(_WaitingSample(store[i], routes=view))
            out[-1].written = written if indices == plan[0] else None
        if indices == plan[1]:
            written.set()
        return out

    def fresh(indices):
        return [{**store[i], "routes": store[i]["routes"].copy()} for i in indices]

    options = dict(layout=layout, pad_keys=["loss_mask"], pad_token_id=0)
    serial = [{k: v.clone() for k, v in b.items()} for b in ShardCollator(fresh, plan, prefetch=False, **options)]
    got = [{k: v.clone() for k, v in b.items()} for b in ShardCollator(fetch, plan, prefetch=True, **options)]
    assert written.is_set()
    assert len(got) == len(serial)
    for k, (a, b) in enumerate(zip(got, serial)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (k, key)


def test_prefetch_raises_the_fetch_s_error_and_leaves_no_thread_behind():
    samples = make_global(6, wide=False)

    def fetch(indices):
        if indices == [2]:
            raise KeyError("trajectory 2 is gone")
        return [samples[i] for i in indices]

    shard = ShardCollator(fetch, [[0], [1], [2]], prefetch=True, pad_keys=["loss_mask"], pad_token_id=0)
    it = iter(shard)
    next(it)
    next(it)
    with pytest.raises(KeyError, match="trajectory 2 is gone"):
        next(it)
    it = iter(shard)
    next(it)
    it.close()  # a loop that breaks early
    assert not [t for t in threading.enumerate() if t.name.startswith("torch_r3-prefetch")]


def test_a_framework_s_own_index_lists_work_like_a_plan():
    samples = make_global(7, wide=False)
    counts = [len(s["input_ids"]) for s in samples]
    geometry = global_geometry(counts, {np.uint8}, filler="balanced", num_experts=EXPERTS)
    full = R3Collator(filler="balanced", num_experts=EXPERTS, pad_keys=["loss_mask"], pad_token_id=0)(samples)
    mine = [np.array([5, 2]), torch.tensor([0]), range(3, 5)]  # any order, any sequence type
    shard = ShardCollator(
        lambda idx: [samples[i] for i in idx],
        mine,
        layout=Padded(seq_len=geometry.seq_len),
        dtype=geometry.dtype,
        filler="balanced",
        num_experts=EXPERTS,
        pad_keys=["loss_mask"],
        pad_token_id=0,
    )
    for indices, batch in zip([[5, 2], [0], [3, 4]], shard):
        for key in batch:
            assert torch.equal(batch[key], full[key][indices]), key


@pytest.mark.parametrize(
    "microbatches, exc, match",
    [
        ([[0, 1], []], ValueError, r"microbatches\[1\] must hold at least one sample index"),
        ([[0, 1], [1]], ValueError, r"microbatches\[1\]: sample 1 is also in microbatches\[0\]"),
        ([[0, 0]], ValueError, r"microbatches\[0\]\[1\]: sample index 0 is listed twice"),
        ([[0, -1]], ValueError, r"microbatches\[0\]\[1\]: sample index -1 is outside"),
        ([[0.5]], TypeError, r"microbatches\[0\]\[0\] must be an int"),
        ("01", TypeError, "microbatches: expected a sequence"),
    ],
)
def test_bad_microbatches_are_refused_naming_them(microbatches, exc, match):
    with pytest.raises(exc, match=match):
        ShardCollator(lambda idx: [], microbatches, pad_token_id=0)


def test_a_fetch_returning_the_wrong_number_of_samples_is_refused():
    samples = make_global(8, wide=False)
    shard = ShardCollator(lambda idx: samples[:1], [[0, 1]], pad_keys=["loss_mask"], pad_token_id=0)
    with pytest.raises(ValueError, match=r"fetch\(\[0, 1\]\) returned 1 samples for 2 indices"):
        next(iter(shard))


# ---------------------------------------------------------------------------
# plan_microbatches
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "dp, mbs, cap", [(1, None, None), (2, 3, None), (4, 2, None), (2, None, 60), (3, 4, 80), (8, 1, None)]
)
def test_plan_places_each_sample_once_with_equal_microbatch_counts(seed, dp, mbs, cap):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(dp, 40))
    if mbs == 1:  # one sample per micro-batch: equal counts need equal sample counts
        size -= size % dp
    counts = [int(n) for n in rng.integers(1, 40, size=size)]
    plan = plan_microbatches(counts, dp_size=dp, micro_batch_size=mbs, max_tokens_per_microbatch=cap)
    assert len(plan) == dp
    assert len({len(rank) for rank in plan}) == 1
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(counts)))
    for rank in plan:
        for mb in rank:
            assert mb and mb == sorted(mb)
            assert mbs is None or len(mb) <= mbs
            assert cap is None or sum(counts[i] for i in mb) <= cap
    # Balanced across ranks: within one longest sample's tokens of each other.
    loads = [sum(counts[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(counts)
    sizes = [sum(len(mb) for mb in rank) for rank in plan]
    assert max(sizes) - min(sizes) <= 1
    assert plan == plan_microbatches(counts, dp_size=dp, micro_batch_size=mbs, max_tokens_per_microbatch=cap)


def test_plan_balances_tokens_better_than_contiguous_chunks():
    counts = [100, 100, 100, 100, 1, 1, 1, 1]
    plan = plan_microbatches(counts, dp_size=2)
    loads = [sum(counts[i] for mb in rank for i in mb) for rank in plan]
    assert loads == [202, 202]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"token_counts": [3], "dp_size": 2}, ValueError, "1 samples cannot give each of dp_size=2"),
        ({"token_counts": [3, 0], "dp_size": 1}, ValueError, r"token_counts\[1\] must be >= 1, got 0"),
        ({"token_counts": [3, 2.0], "dp_size": 1}, TypeError, r"token_counts\[1\] must be an int"),
        ({"token_counts": [3, 9], "dp_size": 1, "max_tokens_per_microbatch": 8}, ValueError, "sample 1 has 9"),
        ({"token_counts": [3, 3], "dp_size": 0}, ValueError, "dp_size must be >= 1"),
        ({"token_counts": [3, 3], "dp_size": 1, "micro_batch_size": 0}, ValueError, "micro_batch_size must be"),
        (
            {"token_counts": [5, 5, 5, 5], "dp_size": 2, "max_tokens_per_microbatch": 5, "micro_batch_size": 1},
            None,
            None,
        ),
        ({"token_counts": [5, 5, 1], "dp_size": 2, "max_tokens_per_microbatch": 5}, ValueError, "need more micro"),
        ({"token_counts": [1, 1, 1], "dp_size": 2, "micro_batch_size": 1}, ValueError, "than the 1 samples a rank"),
    ],
)
def test_plan_refuses_what_it_cannot_plan(kwargs, exc, match):
    if exc is None:
        plan = plan_microbatches(**kwargs)
        assert [len(r) for r in plan] == [2, 2]
        return
    with pytest.raises(exc, match=match):
        plan_microbatches(**kwargs)


def test_buffers_shared_by_the_shard_collators_of_successive_steps_are_reused():
    samples = make_global(9, wide=False)
    counts = [len(s["input_ids"]) for s in samples]
    geometry = global_geometry(counts, {np.uint8})
    pool = BufferPool()
    for step in range(3):
        plan = plan_microbatches(counts[step:], dp_size=1, micro_batch_size=2)[0]
        plan = [[i + step for i in mb] for mb in plan]
        shard = ShardCollator(
            lambda idx: [samples[i] for i in idx],
            plan,
            layout=Padded(seq_len=geometry.seq_len),
            memory=Memory(buffers=pool),
            pad_keys=["loss_mask"],
            pad_token_id=0,
        )
        assert shard.collator.buffers is pool
        for _ in shard:
            pass
        if step == 0:
            misses = pool.stats()["misses"]
    assert pool.stats()["misses"] == misses  # steps 1 and 2 mapped nothing new
    with pytest.raises(TypeError, match="buffers must be None or a torch_r3.BufferPool"):
        ShardCollator(lambda idx: [], [[0]], memory=Memory(buffers={}), pad_token_id=0)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_any_plan_and_stage_slices_the_global_batch(data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    samples = make_global(seed, wide=data.draw(st.booleans()))
    counts = [len(s["input_ids"]) for s in samples]
    layout = data.draw(st.sampled_from(["padded", "packed"]))
    padding = data.draw(st.sampled_from(["arange", "balanced"]))
    dp = data.draw(st.integers(1, 4))
    mbs = data.draw(st.none() | st.integers(1, 4))
    if mbs == 1:
        samples = samples[: len(samples) - len(samples) % dp]
        counts = counts[: len(samples)]
    layers = data.draw(st.permutations(range(L)).flatmap(lambda p: st.integers(1, L).map(lambda k: list(p[:k]))))
    experts = EXPERTS if padding == "balanced" else None
    opts = {
        "layout": layout,
        "filler": padding,
        "num_experts": experts,
        "pad_keys": {"loss_mask": 2.0},
        "pad_token_id": 0,
    }
    full = R3Collator(**torch_r3_options(**opts))(samples)
    geometry = global_geometry(counts, {s["routes"].dtype for s in samples}, filler=padding, num_experts=experts)
    seq_len = geometry.seq_len if layout == "padded" else None
    plan = plan_microbatches(counts, dp_size=dp, micro_batch_size=mbs)
    for rank in range(dp):
        shard = ShardCollator(
            lambda idx: [samples[i] for i in idx],
            plan[rank],
            dtype=geometry.dtype,
            keep_layers=layers,
            **torch_r3_options(seq_len=seq_len, **opts),
        )
        for indices, batch in zip(plan[rank], shard):
            want = expected_part(full, indices, layers, layout)
            for key, value in want.items():
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key


# The four gaps of issue 16: a rank collating its own subset could not match the global batch.


def _gap_routes(seed=0):
    """Four samples, the second int16: an uncaptured tail, full capture, nothing captured, a tail."""
    counts = [3, 9, 5, 7]
    samples = route_samples(
        seed,
        counts,
        captured=[2, 9, 0, 6],
        num_layers=4,
        topk=2,
        num_experts=200,
        dtypes=(np.uint8, np.int16, np.uint8, np.uint8),
        token_ids=None,
    )
    return [sample["routes"] for sample in samples], counts


def test_seq_len_pads_a_subset_to_the_global_length():
    routes, counts = _gap_routes()
    full = collate_routes(routes, counts)
    part = collate_routes(routes[:1], counts[:1], layout=Padded(seq_len=full["attention_mask"].shape[1]))
    for key in part:
        assert torch.equal(part[key], full[key][:1]), key


def test_dtype_fixes_the_output_dtype_whatever_the_subset_holds():
    routes, counts = _gap_routes()
    full = collate_routes(routes, counts)  # int16: sample 1 is int16
    part = collate_routes(routes[2:], counts[2:], dtype=torch.int16)  # all uint8 here
    assert full["rollout_expert_indices"].dtype == part["rollout_expert_indices"].dtype == torch.int16


def test_balanced_filler_of_a_subset_matches_the_global_batch():
    routes, counts = _gap_routes()
    kw = {"filler": "balanced", "num_experts": 200, "dtype": np.int16}  # the routes' ids are < 200
    full = collate_routes(routes, counts, layout="packed", **kw)
    cu = full["cu_seqlens"].tolist()
    part = collate_routes(routes[2:], counts[2:], layout="packed", sample_ids=[2, 3], **kw)
    assert torch.equal(part["rollout_expert_indices"], full["rollout_expert_indices"][cu[2] :])
    T = max(counts)
    full = collate_routes(routes, counts, **kw)
    part = collate_routes(routes[3:], counts[3:], layout=Padded(seq_len=T), sample_ids=[3], **kw)
    assert torch.equal(part["rollout_expert_indices"], full["rollout_expert_indices"][3:])


def test_layers_collates_only_a_stage_s_layers_in_their_order():
    routes, counts = _gap_routes()
    full = collate_routes(routes, counts)
    stage = collate_routes(routes, counts, keep_layers=[3, 1])
    assert torch.equal(stage["rollout_expert_indices"], full["rollout_expert_indices"][:, :, [3, 1]])
