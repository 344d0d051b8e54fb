"""collate_routes and R3Collator against a plain, obviously-correct reference loop."""

from __future__ import annotations

import doctest
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader

import torch_r3.collate._buffers
import torch_r3.collate._filler
import torch_r3.collate._pool as pool_mod
import torch_r3.keys
from tests.reference_collate import (
    ROUTE_DTYPES as ORDER,
    assert_batch_equal,
    reference_collate_routes,
    reference_r3_collator,
)
from tests.samples import EXPERTS_IN, route_samples, router_routes
from tests.spelling import torch_r3_options
from torch_r3 import Memory, Padded, R3Collator, collate_routes, compact_routes


@pytest.fixture
def force_pool(monkeypatch):
    """Send even small batches through the thread pool (its threshold is a size)."""
    monkeypatch.setattr(pool_mod, "SERIAL_BELOW_BYTES", 0)


# ---------------------------------------------------------------------------
# collate_routes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("padding", ["arange", "balanced"])
@pytest.mark.parametrize(
    "dtypes",
    [[np.uint8] * 3, [np.int16] * 3, [np.int32] * 3, [np.uint8, np.int16, np.uint8], [np.int32, np.uint8, np.int16]],
)
def test_matches_reference_for_every_layout_padding_and_dtype_mix(layout, padding, dtypes):
    rng = np.random.default_rng(0)
    counts = [5, 9, 1]
    rows = [4, 9, 0]  # uncaptured tail, fully captured, nothing captured
    routes = [router_routes(rng, r, 3, 2, num_experts=EXPERTS_IN[d], dtype=d) for r, d in zip(rows, dtypes)]
    kw = dict(layout=layout, filler=padding, num_experts=300 if padding == "balanced" else None)  # every id < 300
    got = collate_routes(routes, counts, **kw)
    assert_batch_equal(
        got, reference_collate_routes(routes, counts, layout=layout, filler=padding, num_experts=kw["num_experts"])
    )


def test_mixed_batch_promotes_to_widest_dtype_by_dtype_alone():
    # Small values in an int32 array: the dtype, not the values, decides.
    a = np.zeros((1, 1, 1), np.uint8)
    b = np.ones((1, 1, 1), np.int32)
    assert collate_routes([a, b], [1, 1])["rollout_expert_indices"].dtype == torch.int32


@pytest.mark.parametrize("multiple", [1, 4, 16])
def test_pad_to_multiple_of_rounds_T_up(multiple):
    rng = np.random.default_rng(1)
    routes = [router_routes(rng, 3, 2, 2, num_experts=256), router_routes(rng, 6, 2, 2, num_experts=256)]
    got = collate_routes(routes, [5, 7], layout=Padded(pad_to_multiple_of=multiple))
    assert_batch_equal(got, reference_collate_routes(routes, [5, 7], pad_to_multiple_of=multiple))


def test_read_only_and_non_contiguous_inputs_are_valid():
    rng = np.random.default_rng(2)
    base = router_routes(rng, 8, 4, 6, num_experts=300, dtype=np.int16)
    view = base[::2, ::2, 1::2]  # strided in every dim
    ro = router_routes(rng, 3, 2, 3, num_experts=300, dtype=np.int16)
    ro.flags.writeable = False
    assert not view.flags.c_contiguous
    got = collate_routes([view, ro], [4, 5])
    assert_batch_equal(got, reference_collate_routes([view, ro], [4, 5]))


def test_cpu_tensors_are_accepted_like_arrays():
    rng = np.random.default_rng(3)
    a = router_routes(rng, 2, 2, 2, num_experts=256)
    got = collate_routes([torch.from_numpy(a)], [3])
    assert_batch_equal(got, reference_collate_routes([a], [3]))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_pool_path_matches_reference(layout, force_pool):
    rng = np.random.default_rng(4)
    counts = [int(x) for x in rng.integers(1, 70, size=40)]
    routes = [router_routes(rng, max(n - 1, 0), 4, 8, num_experts=256) for n in counts]
    got = collate_routes(routes, counts, layout=layout, memory=Memory(workers=3))
    assert _collate_threads()  # helper threads were started for the call
    assert_batch_equal(got, reference_collate_routes(routes, counts, layout=layout))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_out_buffer_is_fully_overwritten(layout):
    rng = np.random.default_rng(5)
    routes = [
        router_routes(rng, 2, 2, 3, num_experts=300, dtype=np.int16),
        router_routes(rng, 4, 2, 3, num_experts=256),
    ]
    counts = [3, 4]
    first = collate_routes(routes, counts, layout=layout)
    # Garbage in every byte of caller-owned buffers: all of it must be replaced.
    out = {k: torch.full_like(v, 77) if v.dtype != torch.bool else torch.ones_like(v) for k, v in first.items()}
    out["rollout_expert_indices"].fill_(77)
    got = collate_routes(routes, counts, layout=layout, out=out)
    for k in out:
        assert got[k].data_ptr() == out[k].data_ptr()
    assert_batch_equal(got, reference_collate_routes(routes, counts, layout=layout))
    # A bare tensor means the routes buffer.
    buf = torch.full_like(first["rollout_expert_indices"], 99)
    got = collate_routes(routes, counts, layout=layout, out=buf)
    assert got["rollout_expert_indices"].data_ptr() == buf.data_ptr()
    assert_batch_equal(got, reference_collate_routes(routes, counts, layout=layout))


def test_pin_memory_never_raises_without_an_accelerator():
    routes = [np.zeros((1, 1, 2), np.uint8)]
    assert not collate_routes(routes, [2])["rollout_expert_indices"].is_pinned()
    if torch.cuda.is_available():
        assert collate_routes(routes, [2], memory=Memory(pin_memory=True))["rollout_expert_indices"].is_pinned()
    else:
        with pytest.warns(UserWarning, match="no accelerator"):
            got = collate_routes(routes, [2], memory=Memory(pin_memory=True))
        assert not got["rollout_expert_indices"].is_pinned()
    assert not collate_routes(routes, [2], memory=Memory(pin_memory=False))["rollout_expert_indices"].is_pinned()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_random_batches_match_reference(data):
    B = data.draw(st.integers(1, 5))
    L = data.draw(st.integers(1, 3))
    K = data.draw(st.integers(1, 4))
    layout = data.draw(st.sampled_from(["padded", "packed"]))
    padding = data.draw(st.sampled_from(["arange", "balanced"]))
    E = data.draw(st.integers(K, K + 9))
    pad_to = data.draw(st.sampled_from([None, 1, 3, 8])) if layout == "padded" else None
    counts, routes = [], []
    for _ in range(B):
        n = data.draw(st.integers(1, 12))
        r = data.draw(st.integers(0, n))
        dtype = data.draw(st.sampled_from(ORDER))
        seed = data.draw(st.integers(0, 2**16))
        counts.append(n)
        experts = E if padding == "balanced" else EXPERTS_IN[dtype]  # num_experts=E checks every id against E
        routes.append(router_routes(np.random.default_rng(seed), r, L, K, num_experts=experts, dtype=dtype))
    E = E if padding == "balanced" else None
    got = collate_routes(
        routes, counts, **torch_r3_options(layout=layout, pad_to_multiple_of=pad_to), filler=padding, num_experts=E
    )
    assert_batch_equal(
        got,
        reference_collate_routes(
            routes, counts, layout=layout, pad_to_multiple_of=pad_to, filler=padding, num_experts=E
        ),
    )


def test_balanced_padding_uses_every_expert_and_distinct_experts_per_row():
    got = collate_routes([np.zeros((0, 1, 3), np.uint8)], [8], filler="balanced", num_experts=6)
    rows = got["rollout_expert_indices"][0, :, 0]
    assert all(len(set(r.tolist())) == 3 for r in rows)
    assert set(rows.flatten().tolist()) == set(range(6))


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

GOOD = np.zeros((2, 3, 2), np.uint8)


@pytest.mark.parametrize(
    "routes, counts, kwargs, exc, match",
    [
        ([], [], {}, ValueError, "empty batch"),
        ([GOOD, [[[1, 2]]]], [2, 2], {}, TypeError, r"routes\[1\]: expected a NumPy array"),
        ([GOOD, GOOD.astype(np.float32)], [2, 2], {}, ValueError, r"routes\[1\]: expected a canonical dtype.*float32"),
        ([GOOD.astype(bool)], [2], {}, ValueError, r"routes\[0\].*bool"),
        ([GOOD, GOOD.astype(np.int64)], [2, 2], {}, ValueError, r"routes\[1\].*int64"),
        ([GOOD.astype(np.uint16)], [2], {}, ValueError, r"routes\[0\].*uint16"),
        ([GOOD, GOOD.astype(">i2")], [2, 2], {}, ValueError, r"routes\[1\].*>i2"),
        ([GOOD, np.zeros((2, 4, 2), np.uint8)], [2, 2], {}, ValueError, r"routes\[1\]: expected \[rows, 3, 2\]"),
        ([np.zeros((2, 3, 0), np.uint8)], [2], {}, ValueError, "topk must be > 0"),
        (
            [GOOD, np.zeros((2, 3), np.uint8)],
            [2, 2],
            {},
            ValueError,
            r"routes\[1\]: expected shape \[rows, layers, topk\]",
        ),
        ([GOOD, GOOD], [2, 1], {}, ValueError, r"routes\[1\]: 2 route rows for 1 tokens"),
        ([GOOD, GOOD], [2, 0], {}, ValueError, r"token_counts\[1\] must be >= 1, got"),
        ([GOOD, GOOD], [2, -3], {}, ValueError, r"token_counts\[1\] must be >= 1, got"),
        ([GOOD, GOOD], [2, 2.0], {}, TypeError, r"token_counts\[1\] must be an int"),
        ([GOOD, GOOD], [2, True], {}, TypeError, r"token_counts\[1\] must be an int"),
        ([GOOD, GOOD], [2], {}, ValueError, "expected 2 counts"),
        ([GOOD], [2], {"filler": "balanced"}, ValueError, "needs num_experts"),
        ([GOOD], [2], {"filler": "balanced", "num_experts": 1}, ValueError, "num_experts >= topk"),
        ([GOOD], [2], {"filler": "bogus"}, ValueError, "filler must be one of"),
        ([GOOD], [2], {"layout": "ragged"}, ValueError, "layout must be one of"),
        ([GOOD], [2], {"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be >= 1"),
        ([GOOD], [2], {"layout": "packed", "seq_len": 8}, TypeError, "unexpected keyword argument 'seq_len'"),
        ([GOOD], [2], {"workers": 0}, ValueError, "workers must be >= 1"),
        (
            [GOOD],
            [2],
            {"out": torch.empty(1, 3, 3, 2, dtype=torch.uint8)},
            ValueError,
            r"out\['rollout_expert_indices'\]: expected shape \[1, 2, 3, 2\]",
        ),
        ([GOOD], [2], {"out": torch.empty(1, 2, 3, 2, dtype=torch.int16)}, ValueError, "dtype torch.uint8"),
        ([GOOD], [2], {"out": {"bogus": torch.empty(1)}}, ValueError, "unexpected key 'bogus'"),
        ([GOOD], [2], {"out": np.empty((1, 2, 3, 2), np.uint8)}, TypeError, "out: expected a tensor"),
        (GOOD, [2, 2], {}, TypeError, "routes: expected a sequence"),
    ],
)
def test_bad_input_is_rejected_with_a_message_naming_the_sample(routes, counts, kwargs, exc, match):
    with pytest.raises(exc, match=match):  # the layout and memory values are built inside, as a caller builds them
        collate_routes(routes, counts, **torch_r3_options(**kwargs))


# ---------------------------------------------------------------------------
# compact_routes (sender side)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_id, dtype",
    [(0, np.uint8), (255, np.uint8), (256, np.int16), (2**15 - 1, np.int16), (2**15, np.int32), (2**31 - 1, np.int32)],
)
@pytest.mark.parametrize("src", [np.int64, np.uint64, np.int32])
def test_compact_routes_picks_the_narrowest_canonical_dtype(max_id, dtype, src):
    if max_id > np.iinfo(src).max:
        pytest.skip("does not fit the source dtype")
    a = np.array([[[max_id, 0]], [[1, 2]]], dtype=src)
    got = compact_routes(a, health=None)  # max_id 0 makes row 0 all zero, a capture-bug signature (test_health)
    assert got.dtype == dtype and got.flags.c_contiguous and got.flags.writeable
    assert np.array_equal(got.astype(np.int64), a.astype(np.int64))


def test_compact_routes_accepts_tensors_and_copies():
    t = torch.tensor([[[3, 1]]], dtype=torch.int64, requires_grad=False)
    got = compact_routes(t)
    assert got.dtype == np.uint8 and got.tolist() == [[[3, 1]]]
    src = np.array([[[1, 2]]], np.uint8)
    out = compact_routes(src)
    out[0, 0, 0] = 9
    assert src[0, 0, 0] == 1  # never aliases the caller's buffer


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (np.zeros((1, 1, 1), np.float32), TypeError, "integer dtype"),
        (np.zeros((1, 1, 1), bool), TypeError, "integer dtype"),
        (np.zeros((1, 1), np.int64), ValueError, "2-D"),
        (np.array([[[-1, 2]]]), ValueError, ">= 0, found -1"),
        (np.array([[[2**31, 2]]]), ValueError, "< 2\\*\\*31"),
        ([[[1, 2]]], TypeError, "NumPy array or torch.Tensor"),
        (torch.zeros(1, 1, 1), TypeError, "integer tensor"),
        (np.zeros((1, 0, 2), np.int64), ValueError, "layers and topk must be > 0"),
    ],
)
def test_compact_routes_rejects_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        compact_routes(bad)


# ---------------------------------------------------------------------------
# R3Collator
# ---------------------------------------------------------------------------


def make_samples(seed=0, n_samples=6, L=3, K=2, big=False):
    """The shared samples, uint8 and int16 mixed, with the token ids of every third sample a tensor."""
    samples = route_samples(
        seed,
        n=n_samples,
        max_tokens=399 if big else 11,
        num_layers=L,
        topk=K,
        num_experts=256,
        dtypes=ORDER[:2],
        extras=("loss_mask", "reward", "uid"),
    )
    for sample in samples[::3]:
        sample["input_ids"] = torch.tensor(sample["input_ids"])
    return samples


def reference_collator(samples, pad_token_id=0, layout="padded"):
    return reference_r3_collator(
        samples, pad_token_id=pad_token_id, layout=layout, pad_keys={"loss_mask": (0.0, np.float32)}
    )


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collator_matches_reference(layout):
    samples = make_samples()
    got = R3Collator(pad_token_id=7, pad_keys={"loss_mask": 0.0}, layout=layout)(samples)
    assert_batch_equal(got, reference_collator(samples, pad_token_id=7, layout=layout))


def test_collator_reads_custom_routes_and_tokens_keys_and_drops_them_from_the_batch():
    rng = np.random.default_rng(0)
    samples = [
        {"tok": [1, 2, 3], "r": router_routes(rng, 2, 1, 1, num_experts=256)},
        {"tok": [4], "r": router_routes(rng, 0, 1, 1, num_experts=256)},
    ]
    got = R3Collator(routes_key="r", tokens_key="tok", pad_token_id=-1)(samples)
    assert got["input_ids"].tolist() == [[1, 2, 3], [-1, -1, 4]]
    assert "tok" not in got and "r" not in got


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda s: s[1].pop("routes"), ValueError, "sample 1: missing key 'routes'"),
        (lambda s: s[2].pop("input_ids"), ValueError, "sample 2: missing key 'input_ids'"),
        (
            lambda s: s[1].__setitem__("loss_mask", np.zeros(99, np.float32)),
            ValueError,
            "sample 1: 'loss_mask' has 99 entries",
        ),
        (lambda s: s[0].__setitem__("input_ids", [1.5, 2.5]), TypeError, "sample 0: 'input_ids' must hold integer"),
        (lambda s: s[0].__setitem__("input_ids", []), ValueError, "sample 0: 'input_ids' is empty"),
        (lambda s: s[3].__setitem__("input_ids", "abc"), TypeError, "sample 3: 'input_ids' must be a list"),
        (
            lambda s: s[1].__setitem__("routes", s[1]["routes"].astype(np.int64)),
            ValueError,
            r"routes\[1\].*int64.*'routes'",
        ),
        (lambda s: s[4].__setitem__("extra", 1), ValueError, "sample 4: keys differ"),
        (lambda s: s.__setitem__(2, [1, 2]), TypeError, "sample 2: expected a mapping"),
    ],
)
def test_collator_refuses_bad_samples_naming_the_sample_and_key(mutate, exc, match):
    samples = make_samples()
    mutate(samples)
    with pytest.raises(exc, match=match):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


def test_collator_rejects_more_route_rows_than_tokens():
    samples = [{"input_ids": [1, 2], "routes": np.zeros((3, 1, 2), np.uint8)}]
    with pytest.raises(ValueError, match=r"routes\[0\]: 3 route rows for 2 tokens"):
        R3Collator(pad_token_id=0)(samples)


def test_collator_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        R3Collator(pad_token_id=0)([])


def test_collator_is_picklable():
    import pickle

    c = R3Collator(pad_keys={"loss_mask": 0.0}, filler="balanced", num_experts=256, pad_token_id=0)
    c2 = pickle.loads(pickle.dumps(c))
    samples = make_samples()
    assert_batch_equal(c2(samples), {k: v.numpy() for k, v in c(samples).items()})


class RecordingCollator:
    """Records, inside the worker, whether the routes went to shared memory."""

    def __init__(self):
        self.inner = R3Collator(pad_keys={"loss_mask": 0.0}, pad_token_id=0)

    def __call__(self, samples):
        batch = self.inner(samples)
        batch["shared"] = torch.tensor(batch["rollout_expert_indices"].is_shared())
        return batch


@pytest.mark.parametrize(
    "num_workers, context",
    [(0, None), (2, "fork"), (2, "spawn")],
)
def test_dataloader_batches_equal_direct_calls(num_workers, context, force_pool):
    samples = make_samples(seed=11, n_samples=12, big=True)
    # Use the pool in this process first: a forked worker must not inherit a dead pool.
    collate_routes([s["routes"] for s in samples], [len(s["input_ids"]) for s in samples], memory=Memory(workers=2))
    loader = DataLoader(
        samples,
        batch_size=4,
        collate_fn=RecordingCollator(),
        num_workers=num_workers,
        multiprocessing_context=context,
        persistent_workers=False,
    )
    direct = R3Collator(pad_keys={"loss_mask": 0.0}, pad_token_id=0)
    batches = list(loader)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        assert bool(batch.pop("shared")) == (num_workers > 0)
        want = direct(samples[4 * k : 4 * k + 4])
        assert set(batch) == set(want)
        for key in want:
            assert torch.equal(batch[key], want[key]), key


def _child_collate(q):
    samples = make_samples(seed=3, n_samples=8, big=True)
    got = R3Collator(memory=Memory(workers=2), pad_token_id=0)(
        [{k: s[k] for k in ("input_ids", "routes")} for s in samples]
    )
    q.put(got["rollout_expert_indices"].sum().item())


def test_pool_survives_fork(force_pool):
    samples = make_samples(seed=3, n_samples=8, big=True)
    parent = R3Collator(memory=Memory(workers=2), pad_token_id=0)(
        [{k: s[k] for k in ("input_ids", "routes")} for s in samples]
    )
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_collate, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.exitcode is None:  # hung on a dead pool: fail, don't leak the child
        p.kill()
    assert p.exitcode == 0
    assert q.get(timeout=5) == parent["rollout_expert_indices"].sum().item()


def test_four_threads_share_one_collator(force_pool):
    collator = R3Collator(pad_keys={"loss_mask": 0.0}, memory=Memory(workers=2), pad_token_id=0)
    inputs = [make_samples(seed=s, n_samples=10, L=16, K=8, big=True) for s in range(4)]
    wants = [reference_collator(s) for s in inputs]
    results, errors = [None] * 4, []
    barrier = threading.Barrier(4)

    def work(k):
        try:
            barrier.wait()
            for _ in range(3):
                results[k] = collator(inputs[k])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for got, want in zip(results, wants):
        assert_batch_equal(got, want)


# ---------------------------------------------------------------------------
# The copy-thread pool and the padding template stay bounded (issues 10, 11)
# ---------------------------------------------------------------------------


def _collate_threads():
    return [t for t in threading.enumerate() if t.name.startswith("torch_r3-collate")]


@pytest.mark.parametrize("call", ["collate_routes", "R3Collator"])
def test_more_workers_than_the_cap_are_refused(call):
    routes = [np.zeros((1, 1, 2), np.uint8)]
    with pytest.raises(ValueError, match="workers must be <= 64"):
        if call == "collate_routes":
            collate_routes(routes, [2], memory=Memory(workers=1000))
        else:
            R3Collator(memory=Memory(workers=1000), pad_token_id=0)


def test_distinct_worker_counts_share_one_pool_that_shrinks_when_idle(force_pool, monkeypatch):
    monkeypatch.setattr(pool_mod, "IDLE_SECONDS", 0.2)
    rng = np.random.default_rng(7)
    counts = [int(x) for x in rng.integers(1, 50, size=64)]
    routes = [router_routes(rng, n, 2, 2, num_experts=256) for n in counts]
    want = reference_collate_routes(routes, counts)
    for workers in (4, 16, 9, 16, 64):
        assert_batch_equal(collate_routes(routes, counts, memory=Memory(workers=workers)), want)
        # One pool: never more threads than the largest single request needs.
        assert len(_collate_threads()) <= 63
    assert len(_collate_threads()) <= 63
    deadline = time.monotonic() + 30
    while _collate_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _collate_threads() == []


def test_padding_template_cache_stays_small_after_a_huge_batch():
    import tracemalloc

    routes = [np.zeros((0, 8, 8), np.uint8), np.ones((1, 8, 8), np.uint8)]
    counts = [300_000, 1]  # 300k padding rows of 64 bytes: a 19 MB padding region
    tracemalloc.start()
    try:
        got = collate_routes(routes, counts, memory=Memory(workers=1))
        assert got["rollout_expert_indices"].shape == (2, 300_000, 8, 8)
        del got
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 4 << 20


# ---------------------------------------------------------------------------
# Silent failures of the collator, each refused with a clear message (issue 11)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("key", ["attention_mask", "rollout_expert_indices", "router_padding_mask", "cu_seqlens"])
def test_a_sample_key_equal_to_an_output_key_is_refused_not_overwritten(layout, key, per_token):
    samples = make_samples(n_samples=3)
    for s in samples:
        # A tokenizer's per-token attention_mask, or a per-sample value that
        # default_collate would happily stack over the computed tensor.
        s[key] = np.ones(len(s["input_ids"]), np.int64) if per_token else 1
    with pytest.raises(ValueError, match=rf"sample 0: key '{key}'.*rename.*drop"):
        R3Collator(pad_keys={"loss_mask": 0.0}, layout=layout, pad_token_id=0)(samples)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(
    "padding, experts, topk", [("balanced", 300, 2), ("balanced", 40000, 4), ("arange", None, 300)]
)
def test_padding_ids_beyond_the_input_dtype_widen_the_output_instead_of_wrapping(layout, padding, experts, topk):
    rng = np.random.default_rng(8)
    # uint8 inputs whatever topk is (no router picks 300 distinct experts from 256): any ids will do.
    routes = [rng.integers(0, 256, size=(rows, 2, topk)).astype(np.uint8) for rows in (2, 0)]
    counts = [9000, 3]  # padding positions up to 9000: balanced ids reach num_experts - 1
    got = collate_routes(routes, counts, layout=layout, filler=padding, num_experts=experts)
    want = reference_collate_routes(routes, counts, layout=layout, filler=padding, num_experts=experts)
    assert_batch_equal(got, want)
    # Ids past what a narrower dtype holds really occur, so a narrower output would wrap.
    narrower_max = 255 if (experts or topk) - 1 < 2**15 else 2**15 - 1
    assert int(got["rollout_expert_indices"].max()) > narrower_max


def test_numpy_integers_are_accepted_wherever_python_ints_are():
    samples = make_samples(n_samples=4)
    kwargs = dict(
        filler="balanced",
        num_experts=np.int64(256),  # the samples' ids are < 256
        layout=Padded(pad_to_multiple_of=np.int32(4)),
        memory=Memory(workers=np.int64(2)),
    )
    got = R3Collator(pad_token_id=np.int64(5), pad_keys={"loss_mask": np.float32(0.5)}, **kwargs)(samples)
    want = reference_r3_collator(
        samples,
        pad_token_id=5,
        pad_keys={"loss_mask": (0.5, np.float32)},
        filler="balanced",
        num_experts=256,
        pad_to_multiple_of=4,
    )
    assert_batch_equal(got, want)
    direct = collate_routes([s["routes"] for s in samples], [len(s["input_ids"]) for s in samples], **kwargs)
    for key in direct:
        assert torch.equal(direct[key], got[key])


@pytest.mark.parametrize(
    "values, exc, match",
    [
        ([[1, 2], np.zeros(3), [4, 5], [6, 7]], ValueError, r"sample 1: key 'extra'"),  # a list and an array alike
        ([[1, 2], [3, 4], [5], [6, 7]], ValueError, r"sample 2: key 'extra' has shape/length \(1,\)"),
        ([[1, 2], ["a", "b"], [4, 5], [6, 7]], ValueError, r"sample 1: key 'extra'"),  # numbers, then not
        ([np.zeros(2), np.zeros(2), np.zeros(3), np.zeros(2)], ValueError, r"sample 2: key 'extra'"),
        ([1.0, None, 2.0, 3.0], TypeError, r"sample 1: key 'extra' is None"),
        ([None, None, None, None], TypeError, r"sample 0: key 'extra' is None"),
    ],
)
def test_extra_keys_that_default_collate_cannot_batch_are_refused_naming_sample_and_key(values, exc, match):
    samples = make_samples(n_samples=4)
    for s, v in zip(samples, values):
        s["extra"] = v
    with pytest.raises(exc, match=match):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"pin_memory": "yes"}, TypeError, "pin_memory must be None, True or False"),
        ({"pad_token_id": 2**63}, ValueError, "pad_token_id.*int64"),
        ({"pad_token_id": -(2**63) - 1}, ValueError, "pad_token_id.*int64"),
        ({"pad_token_id": 1.5}, TypeError, "pad_token_id must be an int"),
        ({"pad_keys": {"loss_mask": "zero"}}, TypeError, "pad value for 'loss_mask' must be a number"),
        ({"filler": "balanced"}, ValueError, "needs num_experts"),
        ({"layout": "ragged"}, ValueError, "layout must be one of"),
        ({"num_experts": 8.0}, TypeError, "num_experts must be an int"),
    ],
)
def test_bad_collator_settings_are_refused_at_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        R3Collator(**torch_r3_options(**{"pad_token_id": 0, **kwargs}))


def test_token_ids_beyond_int64_are_refused_instead_of_wrapping_negative():
    samples = make_samples(n_samples=3)
    samples[1]["input_ids"] = np.array([5, 2**63, 7], np.uint64)
    samples[1]["loss_mask"] = np.ones(3, np.float32)
    samples[1]["routes"] = samples[1]["routes"][:3]
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids'.*2\*\*63"):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


def test_uint64_token_ids_below_2_63_are_collated():
    samples = make_samples(n_samples=3)
    for s in samples:
        s["input_ids"] = np.asarray(s["input_ids"], np.uint64)
    got = R3Collator(pad_keys={"loss_mask": 0.0}, pad_token_id=0)(samples)
    assert_batch_equal(got, reference_collator(samples))


@pytest.mark.parametrize("module", [torch_r3.collate._buffers, torch_r3.collate._filler, torch_r3.keys])
def test_docstring_examples_of_the_modules_collate_uses_hold(module):
    # doctest.testmod(torch_r3.collate) skips names it only imports, such as padding_rows.
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


# ---------------------------------------------------------------------------
# Issue 19: nothing silent, nothing unbounded
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_input_living_inside_out_is_refused_not_overwritten_before_it_is_read(layout):
    # Item 4: routes[1] is a view of out's first row; writing row 0 would clobber it.
    rng = np.random.default_rng(40)
    a = router_routes(rng, 3, 2, 2, num_experts=256)
    counts = [3, 3]
    out = collate_routes([a, a], counts, layout=layout)["rollout_expert_indices"].clone()
    inside = out.numpy()[0, :3] if layout == "padded" else out.numpy()[:3]
    with pytest.raises(ValueError, match=r"routes\[1\] lies in the memory of out\['rollout_expert_indices'\]"):
        collate_routes([a, inside], counts, layout=layout, out=out)
    # A copy of the same values is fine.
    got = collate_routes([a, inside.copy()], counts, layout=layout, out=out)
    assert_batch_equal(got, reference_collate_routes([a, a], counts, layout=layout))


def test_float_lists_in_pad_keys_come_out_float64_like_other_float_keys():
    # Item 7: torch.as_tensor made Python float lists float32 (16777217.0 -> 16777216.0).
    samples = make_samples(n_samples=3)
    for s in samples:
        s["advantage"] = [16777217.0] * len(s["input_ids"])
    got = R3Collator(pad_keys={"loss_mask": 0.0, "advantage": 0.5}, pad_token_id=0)(samples)
    assert got["advantage"].dtype == torch.float64 == got["reward"].dtype
    assert got["advantage"][got["attention_mask"] == 1].eq(16777217.0).all()
    assert got["advantage"][got["attention_mask"] == 0].eq(0.5).all()


@pytest.mark.parametrize("pad", [1e6, -1e6, 7e4])
def test_a_float_pad_value_beyond_the_key_s_dtype_is_refused(pad):
    # Item 7: 1e6 in a float16 key became inf.
    samples = make_samples(n_samples=3)
    for s in samples:
        s["weight"] = np.ones(len(s["input_ids"]), np.float16)
    with pytest.raises(ValueError, match=r"pad value .* for 'weight' does not fit torch.float16"):
        R3Collator(pad_keys={"loss_mask": 0.0, "weight": pad}, pad_token_id=0)(samples)
    # Infinities are representable, and asked for explicitly: kept.
    got = R3Collator(pad_keys={"loss_mask": 0.0, "weight": float("-inf")}, pad_token_id=0)(samples)
    assert got["weight"][got["attention_mask"] == 0].eq(float("-inf")).all()


@pytest.mark.parametrize("lengths", [[4, 4], [1], [2, 5]], ids=["equal", "batch_of_one", "ragged"])
def test_a_list_key_not_in_pad_keys_is_collated_as_the_same_numbers_in_an_array_are(lengths):
    # Issue 26 item 16: a list of numbers came back as a list per sample, silently, while an
    # array of different lengths was refused. One rule now, default_collate's for arrays:
    # equal shapes stack, different shapes are refused naming the sample; the reference is
    # default_collate itself on the arrays NumPy makes of the lists.
    def collate(as_array):
        samples = make_samples(n_samples=len(lengths))
        for s, n in zip(samples, lengths):
            scores = [0.5 + j for j in range(n)]
            s["scores"] = np.asarray(scores) if as_array else scores
            s["tags"] = [f"t{j}" for j in range(n)]  # not numbers: one value per sample, whatever the lengths
        try:
            return R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples), samples
        except ValueError as e:
            return str(e), samples

    from_lists, samples = collate(as_array=False)
    from_arrays, _ = collate(as_array=True)
    if len(set(lengths)) == 1:
        expected = torch.utils.data.default_collate([np.asarray(s["scores"]) for s in samples])
        for got in (from_lists, from_arrays):
            assert torch.equal(got["scores"], expected) and got["scores"].dtype == torch.float64
            assert got["scores"].shape == (len(lengths), lengths[0])
            assert got["tags"] == [s["tags"] for s in samples]
            assert got["reward"].shape == (len(lengths),)  # numbers are still stacked
    else:
        assert from_lists == from_arrays  # the same refusal, word for word
        assert "sample 1: key 'scores' has shape/length (5,), sample 0 has (2,)" in from_lists
        assert "list a per-token key in pad_keys" in from_lists


def test_mixed_uint64_and_int64_pad_keys_are_refused_naming_sample_and_key():
    # Item 18: torch raised "Promotion for uint16, uint32, uint64 types is not supported".
    samples = make_samples(n_samples=3)
    for i, s in enumerate(samples):
        s["pos"] = np.arange(len(s["input_ids"]), dtype=np.uint64 if i == 2 else np.int64)
    with pytest.raises(ValueError, match=r"sample 2: 'pos' is uint64.*sample 0.*int64"):
        R3Collator(pad_keys=["loss_mask", "pos"], pad_token_id=0)(samples)


def test_an_input_ids_list_holding_2_63_is_refused_naming_sample_and_key():
    # Item 18: torch.as_tensor raised "Overflow when unpacking long long".
    samples = make_samples(n_samples=3)
    samples[1]["input_ids"] = [5, 2**63, 7]
    samples[1]["loss_mask"] = np.ones(3, np.float32)
    samples[1]["routes"] = samples[1]["routes"][:3]
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids'.*2\*\*63"):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)
    samples[1]["input_ids"] = [-1, 2**63, 7]  # NumPy would make this float64
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids'"):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


@pytest.mark.parametrize("key", ["input_ids", "loss_mask"])
def test_meta_device_tensors_are_refused_naming_sample_and_key(key):
    # Item 18: "Cannot copy out of meta tensor; no data!" named nothing.
    samples = make_samples(n_samples=3)
    samples[2][key] = torch.ones(len(samples[2]["input_ids"]), dtype=torch.long, device="meta")
    with pytest.raises(TypeError, match=rf"sample 2: '{key}' is a tensor on the meta device"):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


def test_meta_device_routes_are_refused_naming_the_sample():
    samples = make_samples(n_samples=2)
    samples[1]["routes"] = torch.zeros(0, 3, 2, dtype=torch.uint8, device="meta")
    with pytest.raises(TypeError, match=r"routes\[1\].*meta"):
        R3Collator(pad_keys=["loss_mask"], pad_token_id=0)(samples)


@pytest.mark.parametrize(
    "kwargs, counts, match",
    [
        ({}, [10**11], r"would allocate \d+ bytes"),
        ({"pad_to_multiple_of": 2**36}, [3], r"would allocate 893353197568 bytes \(832.0 GiB"),
        ({"seq_len": 2**40}, [3], r"would allocate \d+ bytes"),
        ({"max_output_bytes": 38}, [3], r"would allocate 39 bytes.*more than the bound of 38"),
    ],
)
def test_an_output_beyond_the_size_bound_is_refused_before_allocating(kwargs, counts, match):
    # Item 12: 10**11 tokens or pad_to_multiple_of=2**36 went straight to the allocator.
    routes = [np.zeros((1, 2, 2), np.uint8)]
    with pytest.raises(ValueError, match=match):
        collate_routes(routes, counts, **torch_r3_options(**kwargs))


def test_the_size_bound_is_overridable_by_the_environment(monkeypatch):
    routes = [np.zeros((1, 2, 2), np.uint8)]
    monkeypatch.setenv("TORCH_R3_MAX_OUTPUT_BYTES", "32")
    with pytest.raises(ValueError, match="would allocate 39 bytes .* more than the bound of 32 bytes"):
        collate_routes(routes, [3])
    monkeypatch.setenv("TORCH_R3_MAX_OUTPUT_BYTES", "1000")
    assert collate_routes(routes, [3])["rollout_expert_indices"].shape == (1, 3, 2, 2)
    with pytest.raises(ValueError, match="would allocate 63 bytes .* more than the bound of 62 bytes"):
        R3Collator(memory=Memory(max_output_bytes=62), pad_token_id=0)([{"input_ids": [1, 2, 3], "routes": routes[0]}])


# ---------------------------------------------------------------------------
# Issue 19 item 26: routes stored in a Hugging Face `datasets` dataset
# ---------------------------------------------------------------------------


def _hf_dataset():
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(26)
    rows = [3, 0, 5, 2]  # one trajectory with no captured route
    routes = [router_routes(rng, r, 3, 2, num_experts=60, dtype=np.int64) for r in rows]
    tokens = [rng.integers(1, 100, size=r + 1).tolist() for r in rows]
    ds = datasets.Dataset.from_dict({"routes": [r.tolist() for r in routes], "input_ids": tokens})
    want = reference_r3_collator(
        [{"routes": r.astype(np.uint8), "input_ids": t} for r, t in zip(routes, tokens)], pad_token_id=0
    )
    return ds, want


@pytest.mark.parametrize("fmt", [None, "numpy", "torch"])
def test_routes_from_a_datasets_dataset_are_refused_with_advice_that_applies(fmt):
    ds, _ = _hf_dataset()
    if fmt:
        ds = ds.with_format(fmt)
    samples = [ds[i] for i in range(len(ds))]
    with pytest.raises((TypeError, ValueError), match=r"set_transform.*compact=True"):
        R3Collator(pad_token_id=0)(samples)


def test_the_datasets_recipe_set_transform_with_compact_routes_collates_exactly():
    ds, want = _hf_dataset()

    def compact(batch):  # the recipe of the batch layout page
        batch["routes"] = [compact_routes(np.asarray(r, dtype=np.int64).reshape(-1, 3, 2)) for r in batch["routes"]]
        return batch

    ds.set_transform(compact)
    loader = DataLoader(ds, batch_size=len(ds), collate_fn=R3Collator(pad_token_id=0))
    assert_batch_equal(next(iter(loader)), want)


@pytest.mark.parametrize("fmt", [None, "numpy", "torch"])
def test_compact_true_collates_a_datasets_dataset_as_stored(fmt):
    ds, want = _hf_dataset()
    if fmt:
        ds = ds.with_format(fmt)
    loader = DataLoader(ds, batch_size=len(ds), collate_fn=R3Collator(compact=True, pad_token_id=0))
    assert_batch_equal(next(iter(loader)), want)


def test_compact_true_still_refuses_bad_expert_ids_naming_the_sample():
    samples = [{"input_ids": [1, 2], "routes": [[[0, 1]], [[3, -2]]]}]
    with pytest.raises(ValueError, match=r"routes\[0\]: expert ids must be >= 0"):
        R3Collator(compact=True, pad_token_id=0)(samples)
    samples = [{"input_ids": [1, 2], "routes": np.array([[[0, 1]], [[3, 9]]])}]
    with pytest.raises(ValueError, match=r"routes\[0\]: expert ids must be in \[0, num_experts\)"):
        R3Collator(compact=True, filler="balanced", num_experts=8, pad_token_id=0)(samples)
    samples = [{"input_ids": [1, 2], "routes": [[[0, 1]], [[3]]]}]
    with pytest.raises(ValueError, match=r"routes\[0\]: expected nested lists \[rows\]\[layers\]\[topk\]"):
        R3Collator(compact=True, pad_token_id=0)(samples)
    samples = [{"input_ids": [1, 2], "routes": [[[0.5, 1]]]}]
    with pytest.raises(TypeError, match=r"routes\[0\]: compact=True needs integer expert ids, got dtype float64"):
        R3Collator(compact=True, pad_token_id=0)(samples)


_ALLOCATION_FAILS = """
import resource, sys
import numpy as np
import torch_r3
from torch_r3 import Memory, R3Collator, collate_routes
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
routes = [np.zeros((1, 16, 16), np.uint8)]
try:
    if sys.argv[1] == "pool":
        R3Collator(pad_token_id=0, memory=Memory(max_output_bytes=1 << 40))([{"input_ids": [1] * 2**24, "routes": routes[0]}])
    else:
        collate_routes(routes, [2**24], memory=Memory(max_output_bytes=1 << 40, pin_memory=False))
except MemoryError as e:
    print("MemoryError:", e)
"""


@pytest.mark.parametrize("path", ["pool", "fresh"])
def test_a_failed_allocation_is_a_memory_error_naming_the_size(path):
    # Item 12: a failed mapping gave a bare OSError [Errno 12] naming no size.
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _ALLOCATION_FAILS, path], capture_output=True, text=True, timeout=120, check=False
    )
    assert "MemoryError: could not allocate" in run.stdout, run.stdout + run.stderr
    assert "rollout_expert_indices [1, 16777216, 16, 16]" in run.stdout
