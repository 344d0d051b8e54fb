"""The copy threads of the collation kernel: one pool per process that grows and shrinks.

`run(costs, write_rows, workers, total_bytes)` splits the rows of a batch into
contiguous chunks of about equal cost and writes them on `workers` threads: the
calling thread plus `workers - 1` helpers from the process's pool. The pool
starts threads only when a call asks for more than are idle, never holds more
than `MAX_WORKERS - 1`, and a thread left idle for `IDLE_SECONDS` exits, so
calls with different `workers` values share the same threads instead of each
leaving its own pool alive. Work goes to the most recently idle thread, so
after one call with many workers the surplus threads really do go idle, and
exit, while a loop keeps asking for a few.

A call never waits on the pool to make progress: the calling thread writes
chunks too, and the call completes when every chunk is written, whichever
thread wrote it. So a call finishes even while other callers occupy every
helper, and a helper that starts late simply finds no chunk left.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_r3._checks import check_positive
from torch_r3.cpu import ENV_NUM_WORKERS, MAX_WORKERS, pool_workers

#: Seconds a helper thread waits for work before it exits.
IDLE_SECONDS = 10.0
#: Below this many output bytes a pool costs more than it saves.
SERIAL_BELOW_BYTES = 4 << 20
# Chunks per worker: enough for load balance, few enough that the per-chunk
# Python overhead (which holds the GIL) stays negligible.
_CHUNKS_PER_WORKER = 4
_THREAD_NAME = "torch_r3-collate"


def check_workers(workers: Any) -> int:
    """`workers` validated: an int in `1 .. MAX_WORKERS` (`None`, the machine's default, is resolved per call)."""
    workers = check_positive(workers, "workers")
    if workers > MAX_WORKERS:
        raise ValueError(
            f"workers must be <= {MAX_WORKERS}, got {workers}: copies are bound by memory bandwidth, "
            f"more threads only contend (None picks a default from the usable CPUs)"
        )
    return workers


@functools.cache
def _machine_workers(share: int) -> int:
    # Reading the cgroup tree costs ~0.1 ms; the answer does not change while
    # the process runs, so it is read once per process (and again after fork).
    return pool_workers(share=share)


def default_workers() -> int:
    """Copy threads when the caller gives none: `torch_r3.cpu.pool_workers()`, or a worker's share."""
    if os.environ.get(ENV_NUM_WORKERS, "").strip():
        return pool_workers()  # the override, validated there
    info = torch.utils.data.get_worker_info()
    # Inside a DataLoader worker the CPUs are already shared by num_workers
    # processes: give each its share rather than oversubscribing.
    return _machine_workers(1 if info is None else info.num_workers)


class _Idle:
    """One helper waiting for work: the task handed to it, and the event that wakes it."""

    __slots__ = ("task", "wake")

    def __init__(self) -> None:
        self.task: Callable[[], None] | None = None
        self.wake = threading.Event()


class _Threads:
    """Helper threads that run submitted callables; started on demand, exit when idle.

    Work goes to the most recently idle helper (a stack, not a queue): a loop
    that now needs two helpers keeps reusing the same two, and the others,
    left over from one call with many workers, see no work and exit after
    `IDLE_SECONDS`. (With a shared queue every waiting helper would get a turn
    often enough never to time out.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []  # most recently idle last
        self._threads = 0

    def submit(self, fn: Callable[[], None], count: int) -> None:
        """Run `fn` on up to `count` helpers; at the thread cap, fewer (the caller drains the rest)."""
        with self._lock:
            for _ in range(count):
                if self._idle:
                    waiting = self._idle.pop()
                    waiting.task = fn
                    waiting.wake.set()
                elif self._threads < MAX_WORKERS - 1:
                    self._threads += 1
                    threading.Thread(target=self._loop, args=(fn,), name=_THREAD_NAME, daemon=True).start()
                else:
                    return

    def _loop(self, fn: Callable[[], None] | None) -> None:
        while fn is not None:
            fn()
            # Drop the finished call's closure before waiting: `run` empties its
            # work list, but the closure's error list can still hold a traceback
            # into the batch, which must die when its caller lets go.
            fn = None
            me = _Idle()
            with self._lock:
                self._idle.append(me)
            me.wake.wait(IDLE_SECONDS)
            with self._lock:
                # A task is handed over under this lock: if none came, leave.
                if me.task is None:
                    self._idle.remove(me)
                    self._threads -= 1
                    return
            fn = me.task


_threads = _Threads()


def _reset_after_fork() -> None:
    # Threads do not survive fork(): the child gets the pool object but not its
    # threads, and work queued to it would never run. Start afresh.
    global _threads
    _threads = _Threads()
    _machine_workers.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def run(costs: list[int], write_rows: Callable[[int, int], None], workers: int, total_bytes: int) -> None:
    """Call `write_rows(lo, hi)` over contiguous chunks covering rows `0 .. len(costs) - 1`.

    Args:
        costs: the relative cost of each row (its output tokens).
        write_rows: writes rows `lo .. hi - 1`; called from several threads at once.
        workers: threads in all, the caller included; `1` writes on the calling thread.
        total_bytes: the output size; small outputs are written serially.
    """
    n = len(costs)
    if workers <= 1 or n <= 1 or total_bytes < SERIAL_BELOW_BYTES:
        write_rows(0, n)
        return
    target = max(1, sum(costs) // (workers * _CHUNKS_PER_WORKER))
    acc, lo = 0, 0
    bounds: list[tuple[int, int]] = []
    for i, c in enumerate(costs):
        acc += c
        if acc >= target:
            bounds.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < n:
        bounds.append((lo, n))
    chunks = iter(bounds)
    # Helper threads keep their last task until the next one: through `work`, emptied below, it
    # does not keep `write_rows` (and the batch it writes) alive.
    work = [write_rows]
    lock = threading.Lock()
    done = threading.Condition(lock)
    left = [len(bounds)]  # chunks not yet written, under `lock`
    errors: list[BaseException] = []  # the first is re-raised by the caller

    def drain() -> None:
        while True:
            with lock:
                chunk = next(chunks, None)
            if chunk is None:
                return
            try:
                work[0](*chunk)
            except BaseException as e:  # re-raised by the caller below
                errors.append(e)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.notify_all()

    _threads.submit(drain, min(workers - 1, len(bounds) - 1))
    drain()
    with lock:
        done.wait_for(lambda: left[0] == 0)
    work.clear()
    if errors:
        raise errors[0]
