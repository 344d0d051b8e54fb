"""Recycled outputs (`BufferPool`, `R3Collator`'s default): reused only once nothing uses them."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.reference_collate import assert_batch_equal, reference_collate_routes, reference_r3_collator
from tests.samples import route_samples, router_routes
from torch_r3 import BufferPool, Memory, R3Collator, collate_routes

PAD_KEYS = {"loss_mask": (0.0, np.float32)}


def make_samples(seed, n_samples=4, max_tokens=12, L=2, K=2, fixed_length=False):
    """The shared samples; with `fixed_length`, the first is `max_tokens` long (every batch as wide)."""
    lengths = [max_tokens if fixed_length and i == 0 else None for i in range(n_samples)]
    return route_samples(
        seed, lengths, max_tokens=max_tokens, num_layers=L, topk=K, num_experts=200, extras=("loss_mask", "reward")
    )


def collator(cache_bytes=None, **kwargs):
    memory = Memory(workers=1, cache_bytes=cache_bytes)
    return R3Collator(pad_token_id=0, pad_keys={"loss_mask": 0.0}, memory=memory, **kwargs)


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
        routes = [router_routes(rng, n - 1, 3, 2, num_experts=99, dtype=np.int16) for n in counts]
        layout = ("padded", "packed")[call % 2]
        mine = torch.empty(len(counts) + 1, dtype=torch.int32)
        out = {"cu_seqlens": mine} if layout == "packed" else None
        got = collate_routes(routes, counts, layout=layout, memory=Memory(buffers=pool), out=out)
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
    pool = BufferPool(cache_bytes=3 << 20)
    tensors = [pool.empty((1 << 20,), torch.uint8) for _ in range(8)]
    del tensors
    stats = pool.stats()
    assert stats["live_bytes"] == 0
    assert 0 < stats["cached_bytes"] <= 3 << 20
    off = BufferPool(cache_bytes=0)
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
    assert copy.buffers.cache_bytes == 5 << 20
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
        R3Collator(memory=Memory(cache_bytes=value), pad_token_id=0)


def test_buffers_must_be_a_buffer_pool():
    with pytest.raises(TypeError, match="buffers must be None or a torch_r3.BufferPool"):
        collate_routes([np.zeros((1, 1, 2), np.uint8)], [2], memory=Memory(buffers={}))


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
    pool = BufferPool(cache_bytes=1)  # every released buffer is evicted
    host = pool.empty((64, 1024), torch.uint8, pinned=True)
    host.fill_(5)
    device = _slow_copy_of(host)
    del host
    pool.stats()  # folds the release in, which evicts the buffer: only after the copy is done
    assert torch.cuda.current_stream().query()
    assert bool((device == 5).all())


# --------------------------------------------------------------------------
# Private, copy-on-write mappings; storages moved to shared memory; bad requests
# --------------------------------------------------------------------------


def _in_child(check) -> int:
    """Fork; run `check()` in the child and return the child's exit status (0: it held)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = 0 if check() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_s_batch_is_unchanged_by_the_parent_s_next_batches_and_vice_versa():
    collate = collator()  # recycling on, workers=1: no threads across the fork
    samples = make_samples(7, max_tokens=300, L=4, K=4, fixed_length=True)
    want = expected(samples)
    batch = collate(samples)
    address = batch["rollout_expert_indices"].data_ptr()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: wait until the parent has overwritten the buffer, then look
        code = 1
        try:
            os.close(write)
            os.read(read, 1)
            code = 0 if all(torch.equal(batch[k], torch.from_numpy(v)) for k, v in want.items()) else 3
        finally:
            os._exit(code)
    os.close(read)
    del batch
    for seed in range(8, 12):  # same length: every batch reuses the first one's buffers
        later = make_samples(seed, max_tokens=300, L=4, K=4, fixed_length=True)
        other = collate(later)
        assert_batch_equal(other, expected(later))
        reused = other["rollout_expert_indices"].data_ptr() == address
        del other
    assert reused  # the parent really did write over the memory the child's batch lives in
    os.write(write, b"x")
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the parent's later batches changed the child's batch"

    # And the other way round: the child's in-place edits and batches never reach the parent.
    held = collate(samples)

    def child_edits():
        held["rollout_expert_indices"].fill_(255)
        held["router_padding_mask"].fill_(True)
        for seed in range(3):
            collate(make_samples(seed, max_tokens=300, L=4, K=4, fixed_length=True))
        return True

    assert _in_child(child_edits) == 0
    assert_batch_equal(held, want)


@pytest.mark.parametrize("cache_bytes", [None, 0], ids=["recycled", "fresh"])
def test_a_numpy_view_taken_before_share_memory_never_reads_a_later_batch(cache_bytes):
    # torch.multiprocessing.Queue.put calls share_memory_() in place: the storage
    # moves to new shared memory, and an earlier .numpy() view keeps the old address.
    # Recycled or fresh, that old memory must stay mapped and untouched while the view lives.
    collate = collator(cache_bytes=cache_bytes)
    samples = make_samples(20, max_tokens=300, L=4, K=4, fixed_length=True)
    want = expected(samples)["rollout_expert_indices"]
    batch = collate(samples)
    view = batch["rollout_expert_indices"].numpy()
    for t in batch.values():
        if isinstance(t, torch.Tensor):
            t.share_memory_()
    assert batch["rollout_expert_indices"].is_shared()
    for seed in range(21, 26):
        later = collate(make_samples(seed, max_tokens=300, L=4, K=4, fixed_length=True))
        assert later["rollout_expert_indices"].data_ptr() != view.ctypes.data
        del later
    gc.collect()
    assert np.array_equal(view, want)
    assert torch.equal(batch["rollout_expert_indices"], torch.from_numpy(want))
    del batch
    del view  # only now may the old memory go
    assert collate.buffers.stats()["live_bytes"] == 0


@pytest.mark.parametrize("shape", [(-1,), (4, -2), (3, -1, 5)])
def test_a_negative_dimension_is_refused_naming_the_shape(shape):
    pool = BufferPool()
    with pytest.raises(ValueError, match=re.escape(str(shape))):
        pool.empty(shape, torch.uint8)
    with pytest.raises(ValueError, match=re.escape(str(shape))):
        pool.empty_batch({"x": (shape, torch.uint8)})


@pytest.mark.parametrize("shape", [(1.5,), ("3",), (True, 2), (None,)])
def test_a_non_integer_dimension_is_refused_naming_the_shape(shape):
    with pytest.raises(TypeError, match=re.escape(str(shape))):
        BufferPool().empty(shape, torch.uint8)


def test_a_mapping_the_os_refuses_is_a_memory_error_naming_the_size(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    nbytes = 1 << 47  # beyond any user address space: the mapping is always refused
    for pool in (BufferPool(), BufferPool(cache_bytes=0)):
        with pytest.raises(MemoryError, match=f"{nbytes:,} bytes"):
            pool.empty((nbytes,), torch.uint8)
    gc.collect()
    assert unraisable == []  # no AttributeError from a half-built buffer's __del__


def test_output_memory_is_private_and_hugepage_advised_where_the_kernel_allows():
    from torch_r3.collate._memory import thp_mode

    mode = thp_mode()
    for pool in (BufferPool(), BufferPool(cache_bytes=0)):
        t = pool.empty((8 << 20,), torch.uint8)
        t.fill_(1)
        lo = t.data_ptr()
        entry = _smaps_entry(lo)
        assert entry["shared"] is False  # MAP_PRIVATE: copy-on-write across fork
        if mode in ("madvise", "always"):
            assert "hg" in entry["flags"]  # MADV_HUGEPAGE was applied
            assert lo % (2 << 20) == 0  # aligned: every whole 2 MiB of the output can be a hugepage


def _smaps_entry(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding `address`: whether it is shared, its VmFlags."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = {"shared": head[1][3] == "s", "flags": []} if lo <= address < hi else None
            elif found is not None and head[0] == "VmFlags:":
                found["flags"] = head[1:]
                return found
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_kernel_that_refuses_the_hugepage_advice_gets_small_pages_not_an_error(monkeypatch):
    import mmap

    from torch_r3.collate import _memory

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(_memory, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(_memory.mmap, "mmap", Refusing)
    monkeypatch.setitem(_memory._advise, "hugepage", True)
    memory = _memory.map_private(4 << 20)
    memory[:] = 7
    assert memory.nbytes == 4 << 20 and int(memory.sum()) == 7 * (4 << 20)
    assert _memory._advise["hugepage"] is False  # asked once, never again
    t = BufferPool().empty((4 << 20,), torch.uint8)
    t.fill_(3)
    assert int(t.sum()) == 3 * (4 << 20)


def test_cache_bytes_is_the_keyword_and_attribute_as_on_r3collator():
    pool = BufferPool(cache_bytes=3 << 20)
    assert pool.cache_bytes == 3 << 20
    assert R3Collator(memory=Memory(cache_bytes=3 << 20), pad_token_id=0).buffers.cache_bytes == 3 << 20
    assert pickle.loads(pickle.dumps(pool)).cache_bytes == 3 << 20
    assert "cache_bytes=3145728" in repr(pool)
    assert BufferPool().cache_bytes is None


def test_max_cached_bytes_still_works_and_warns_that_it_is_deprecated():
    with pytest.deprecated_call(match="cache_bytes"):
        pool = BufferPool(max_cached_bytes=3 << 20)
    assert pool.cache_bytes == 3 << 20
    with pytest.deprecated_call(match="cache_bytes"):
        assert pool.max_cached_bytes == 3 << 20
    with pytest.raises(TypeError, match="BufferPool: pass cache_bytes= only .* not both"):
        BufferPool(cache_bytes=1, max_cached_bytes=1)


def test_an_old_pickle_with_max_cached_bytes_still_loads():
    pool = BufferPool.__new__(BufferPool)
    pool.__setstate__({"max_cached_bytes": 5})
    assert pool.cache_bytes == 5
