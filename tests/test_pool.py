"""The collation kernel's copy threads (`torch_r3.collate._pool`): bounded, shared, and shrinking under steady use."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from torch_r3 import Memory
from torch_r3.collate import _pool
from torch_r3.cpu import ENV_NUM_WORKERS


def _helpers() -> int:
    return sum(t.name.startswith("torch_r3-collate") for t in threading.enumerate())


def _call(workers: int, rows: int = 256, pause: float = 0.001) -> list[tuple[int, int]]:
    """One `_pool.run` over `rows` rows, `pause` seconds per chunk; the chunks it wrote, in order."""
    written: list[tuple[int, int]] = []
    lock = threading.Lock()

    def write_rows(lo: int, hi: int) -> None:
        time.sleep(pause)  # a little work, so that helpers really take chunks
        with lock:
            written.append((lo, hi))

    _pool.run([1] * rows, write_rows, workers, total_bytes=1 << 30)
    return sorted(written)


def _covers(chunks: list[tuple[int, int]], rows: int) -> bool:
    return chunks[0][0] == 0 and chunks[-1][1] == rows and all(a[1] == b[0] for a, b in itertools.pairwise(chunks))


def test_after_a_64_worker_call_steady_small_calls_let_the_surplus_threads_go(monkeypatch):
    monkeypatch.setattr(_pool, "IDLE_SECONDS", 1.0)
    assert _covers(_call(64), 256)
    grown = _helpers()
    assert grown > 8  # the big call really did start many helpers
    # A training loop that now asks for 2 workers, call after call: the one
    # helper it needs keeps being reused, the other helpers idle out.
    # Each call hands a helper work far more often than once per IDLE_SECONDS.
    deadline = time.monotonic() + 60  # a bound for a loaded machine; the loop ends once they are gone
    while _helpers() > 2 and time.monotonic() < deadline:
        assert _covers(_call(2, rows=16, pause=0), 16)
    assert _helpers() <= 2, f"{_helpers()} helper threads still alive after {grown} were started"


def test_a_call_completes_even_when_every_helper_is_busy(monkeypatch):
    monkeypatch.setattr(_pool, "IDLE_SECONDS", 0.3)
    results: list[bool] = []
    callers = [threading.Thread(target=lambda: results.append(_covers(_call(64), 256))) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert results == [True, True, True]
    assert _helpers() <= _pool.MAX_WORKERS - 1


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1000", "65", "2.5"])
def test_a_bad_worker_override_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV_NUM_WORKERS, value)
    with pytest.raises(ValueError, match=ENV_NUM_WORKERS) as info:
        _pool.default_workers()
    assert repr(value) in str(info.value)


def test_the_override_may_ask_for_the_cap_itself(monkeypatch):
    monkeypatch.setenv(ENV_NUM_WORKERS, str(_pool.MAX_WORKERS))
    assert _pool.default_workers() == _pool.MAX_WORKERS


def test_a_helper_thread_lets_go_of_a_batch_once_its_chunks_are_written():
    # A helper used to keep the finished call's closure (and through it the
    # batch's arrays) until its next task: the batch outlived the caller's last
    # reference, a pool could not recycle it, and its memory was freed during
    # the next call instead.
    import weakref

    import numpy as np

    from torch_r3 import collate_routes

    rng = np.random.default_rng(0)
    counts = [4096] * 16
    routes = [rng.integers(0, 128, size=(n - 1, 8, 8), dtype=np.uint8) for n in counts]
    out = collate_routes(
        routes,
        counts,
        memory=Memory(workers=2, pin_memory=False),
    )  # 4 MiB and more: the pool runs
    assert _helpers() >= 1
    storage = weakref.ref(out["rollout_expert_indices"].untyped_storage())
    del out
    alive = storage() is not None
    assert not alive, "a helper thread still holds the batch it helped write"
