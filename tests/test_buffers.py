"""Recycled outputs (`BufferPool`, `R3Collator`'s default): reused only once nothing uses them."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from torch_r3 import BufferPool, R3Collator, collate_routes

from reference_collate import assert_batch_equal, reference_collate_routes, reference_r3_collator

PAD_KEYS = {"loss_mask": (0.0, np.float32)}


def make_samples(seed, n_samples=4, max_tokens=12, L=2, K=2, fixed_length=False):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n_samples):
        n = max_tokens if fixed_length and i == 0 else int(rng.integers(1, max_tokens + 1))
        r = int(rng.integers(0, n + 1))
        samples.append(
            {
                "input_ids": rng.integers(1, 1000, size=n).tolist(),
                "routes": rng.integers(0, 200, size=(r, L, K)).astype(np.uint8),
                "loss_mask": rng.integers(0, 2, size=n).astype(np.float32),
                "reward": float(rng.random()),
            }
        )
    return samples


def collator(**kwargs):
    return R3Collator(pad_keys={"loss_mask": 0.0}, workers=1, **kwargs)


def expected(samples, layout="padded"):
    return reference_r3_collator(samples, layout=layout, pad_keys=PAD_KEYS)


def test_a_view_of_batch_one_is_unchanged_across_many_later_calls():
    collate = collator()
    first = make_samples(0, max_tokens=40)
    view = collate(first)["rollout_expert_indices"][1:, 3:]  # the batch itself is dropped
    want = torch.from_numpy(expected(first)["rollout_expert_indices"][1:, 3:])
    for seed in range(1, 40):
        batch = collate(make_samples(seed, max_tokens=40))
        assert_batch_equal(batch, expected(make_samples(seed, max_tokens=40)))
        del batch
        assert torch.equal(view, want)
    assert collate.buffers.stats()["hits"] > 0  # buffers really were recycled meanwhile


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_no_live_batch_is_ever_overwritten_under_four_threads(layout):
    collate = collator(layout=layout)
    kept = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def work(k):
        barrier.wait()
        for call in range(50):
            seed = 1000 * k + call
            batch = collate(make_samples(seed, max_tokens=30))
            # Keep, in turn: the tensors, a view, a .numpy() array, or nothing.
            if call % 4 == 0:
                kept[k].append((seed, "tensor", dict(batch)))
            elif call % 4 == 1:
                kept[k].append((seed, "view", batch["rollout_expert_indices"][1:]))
            elif call % 4 == 2:
                kept[k].append((seed, "numpy", batch["router_padding_mask"].numpy()))
            del batch

    with ThreadPoolExecutor(4) as threads:
        list(threads.map(work, range(4)))  # re-raises a thread's error here
    for seed, what, obj in (item for items in kept for item in items):
        want = expected(make_samples(seed, max_tokens=30), layout)
        if what == "tensor":
            assert_batch_equal(obj, want)
        elif what == "view":
            assert torch.equal(obj, torch.from_numpy(want["rollout_expert_indices"][1:]))
        else:
            assert np.array_equal(obj, want["router_padding_mask"])
    assert collate.buffers.stats()["hits"] > 0


def test_kernel_outputs_from_a_pool_match_the_reference_and_out_still_wins():
    pool = BufferPool()
    rng = np.random.default_rng(3)
    for call in range(20):
        counts = [int(x) for x in rng.integers(1, 30, size=3)]
        routes = [rng.integers(0, 99, size=(n - 1, 3, 2)).astype(np.int16) for n in counts]
        layout = ("padded", "packed")[call % 2]
        mine = torch.empty(len(counts) + 1, dtype=torch.int32)
        out = {"cu_seqlens": mine} if layout == "packed" else None
        got = collate_routes(routes, counts, layout=layout, buffers=pool, out=out)
        assert_batch_equal(got, reference_collate_routes(routes, counts, layout=layout))
        if out:
            assert got["cu_seqlens"] is mine
    assert pool.stats()["hits"] > 0


def test_a_freed_buffer_serves_a_smaller_batch_only_within_bounded_waste():
    pool = BufferPool()
    t = pool.empty((1000, 100), torch.uint8)
    address = t.data_ptr()
    del t
    smaller = pool.empty((600, 100), torch.uint8)  # 60% of the buffer: reused as a prefix view
    assert smaller.data_ptr() == address
    del smaller
    tiny = pool.empty((100, 100), torch.uint8)  # 10%: too wasteful, a buffer of its own
    assert tiny.data_ptr() != address
    assert pool.stats()["hits"] == 1


def test_idle_bytes_stay_within_the_bound_and_zero_turns_recycling_off():
    pool = BufferPool(max_cached_bytes=3 << 20)
    tensors = [pool.empty((1 << 20,), torch.uint8) for _ in range(8)]
    del tensors
    stats = pool.stats()
    assert stats["live_bytes"] == 0
    assert 0 < stats["cached_bytes"] <= 3 << 20
    off = BufferPool(max_cached_bytes=0)
    for _ in range(3):
        off.empty((1 << 20,), torch.uint8)
    assert off.stats() == {"cached_bytes": 0, "live_bytes": 0, "buffers": 0, "hits": 0, "misses": 0}


def test_a_loader_loop_reuses_the_previous_batch_memory_at_the_default_bound():
    # Every batch has the same T, so every batch's tensors fit the previous ones' buffers.
    samples = [s for seed in range(10) for s in make_samples(seed, max_tokens=64, fixed_length=True)]
    collate = collator()
    loader = DataLoader(samples, batch_size=4, collate_fn=collate)
    for k, batch in enumerate(loader):  # the loop variable holds batch k while k+1 is collated
        assert_batch_equal(batch, expected(samples[4 * k : 4 * k + 4]))
    stats = collate.buffers.stats()
    # Two batches' worth of buffers (held + being collated) serve all ten; the
    # five tensors of a padded batch with a pad key are each recycled.
    assert stats["misses"] == 2 * 5 and stats["hits"] == 8 * 5
    batch_bytes = sum(v.numel() * v.element_size() for k, v in batch.items() if k != "reward")
    assert stats["cached_bytes"] + stats["live_bytes"] <= 2 * 2 * batch_bytes + 10 * 4096


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_batches_kept_in_a_list_all_match_the_reference(num_workers):
    samples = [s for seed in range(6) for s in make_samples(seed, max_tokens=64)]
    loader = DataLoader(samples, batch_size=4, collate_fn=collator(), num_workers=num_workers)
    batches = list(loader)
    for k, batch in enumerate(batches):
        assert batch["rollout_expert_indices"].is_shared() == (num_workers > 0)
        assert_batch_equal(batch, expected(samples[4 * k : 4 * k + 4]))


def test_pickling_keeps_the_setting_and_never_the_buffers():
    collate = collator(cache_bytes=5 << 20)
    big = collate(make_samples(0, max_tokens=5000, L=8, K=8))
    del big
    assert collate.buffers.stats()["cached_bytes"] > 0
    data = pickle.dumps(collate)
    assert len(data) < 4096
    copy = pickle.loads(data)
    assert copy.buffers.max_cached_bytes == 5 << 20
    assert copy.buffers.stats()["cached_bytes"] == 0
    samples = make_samples(1)
    assert_batch_equal(copy(samples), expected(samples))


def _child(collate, q):
    out = []
    for seed in range(5):
        batch = collate(make_samples(seed, max_tokens=40))
        out.append(batch["rollout_expert_indices"].sum().item())
    q.put(out)


def test_a_forked_child_collates_correctly_and_leaves_the_parents_batch_alone():
    collate = collator()
    held = collate(make_samples(100, max_tokens=40))
    collate(make_samples(101, max_tokens=40))  # dropped at once: idle buffers for the child to inherit
    gc.collect()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(collate, q))
    p.start()
    p.join(timeout=60)
    if p.exitcode is None:
        p.kill()
    assert p.exitcode == 0
    sums = q.get(timeout=5)
    want = [int(expected(make_samples(s, max_tokens=40))["rollout_expert_indices"].sum()) for s in range(5)]
    assert sums == want
    assert_batch_equal(held, expected(make_samples(100, max_tokens=40)))


@pytest.mark.parametrize(
    "value, exc, match",
    [(-1, ValueError, ">= 0"), (1.5, TypeError, "an int"), (True, TypeError, "an int"), ("1", TypeError, "an int")],
)
def test_bad_cache_bounds_are_refused(value, exc, match):
    with pytest.raises(exc, match=match):
        BufferPool(value)
    with pytest.raises(exc, match=match):
        R3Collator(cache_bytes=value)


def test_buffers_must_be_a_buffer_pool():
    with pytest.raises(TypeError, match="buffers must be None or a torch_r3.BufferPool"):
        collate_routes([np.zeros((1, 1, 2), np.uint8)], [2], buffers={})


# The pinned path needs a CUDA device: these run on a GPU machine (`benchmarks/gpu_check.py`
# exercises the same path at full size) and are skipped here. No CUDA call is faked.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")


@needs_cuda
def test_pinned_buffers_are_registered_once_per_buffer_not_per_batch():
    pool = BufferPool()
    specs = {"routes": ((8, 1000, 4), torch.uint8), "mask": ((8, 1000), torch.bool)}
    prev = None
    for _ in range(10):
        batch = pool.empty_batch(specs, pinned=True)
        assert all(t.is_pinned() for t in batch.values())
        prev = batch  # noqa: F841  (the loop holds the previous batch)
    assert pool.stats()["misses"] == 4  # two batches' buffers, each registered once
    # no power-of-two rounding: a buffer is at most a page-rounded sixteenth larger than asked
    assert batch["routes"].untyped_storage().nbytes() < 2 * 8 * 1000 * 4
    plain = pool.empty((8, 1000, 4), torch.uint8)  # a plain request never gets a pinned buffer
    assert not plain.is_pinned()


def _slow_copy_of(host: torch.Tensor) -> torch.Tensor:
    """Queue a long kernel, then a `non_blocking` copy of `host` behind it on the current stream."""
    device = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the copy may start
    device.copy_(host, non_blocking=True)
    return device


@needs_cuda
def test_a_pinned_buffer_is_reused_only_after_copies_queued_before_its_release_complete():
    pool = BufferPool()
    first = pool.empty((64, 1024), torch.uint8, pinned=True)
    first.fill_(7)
    address = first.data_ptr()
    device = _slow_copy_of(first)
    del first  # the copy is still queued behind the sleep
    second = pool.empty((64, 1024), torch.uint8, pinned=True)
    assert second.data_ptr() != address
    torch.cuda.synchronize()
    assert bool((device == 7).all())
    del second
    third = pool.empty((64, 1024), torch.uint8, pinned=True)  # both buffers are free again: no new one
    assert third.is_pinned() and pool.stats()["misses"] == 2


@needs_cuda
def test_an_evicted_pinned_buffer_waits_for_its_copies_before_it_is_unlocked():
    pool = BufferPool(max_cached_bytes=1)  # every released buffer is evicted
    host = pool.empty((64, 1024), torch.uint8, pinned=True)
    host.fill_(5)
    device = _slow_copy_of(host)
    del host
    pool.stats()  # folds the release in, which evicts the buffer: only after the copy is done
    assert torch.cuda.current_stream().query()
    assert bool((device == 5).all())
