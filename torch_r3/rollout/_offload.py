"""Where large route payloads are decoded: a thread pool, off the caller's event loop.

The base64 kernel (pybase64) and NumPy's range checks and casts release the
GIL, so while one response decodes on a pool thread the event loop keeps
serving, and N responses in flight decode on N cores at once. The pool has one
thread per usable CPU (affinity mask and cgroup quota, `torch_r3.cpu`), is
started on first use, and is started afresh in a child after `fork()`.
Payloads under `OFFLOAD_BYTES` decode on the loop's own thread: a hop to the
pool costs more than they take.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from torch_r3.cpu import usable_cpus

__all__ = ["OFFLOAD_BYTES", "decode_workers", "off_loop"]

#: Route text below this many bytes decodes on the event loop's thread (about 0.2 ms of work).
OFFLOAD_BYTES = 1 << 20
_THREAD_NAME = "torch_r3-decode"
_T = TypeVar("_T")
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def decode_workers() -> int:
    """The decode pool's threads: one per usable CPU."""
    return max(1, math.floor(usable_cpus()))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=decode_workers(), thread_name_prefix=_THREAD_NAME)
        return _pool


async def off_loop(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)`, on the decode pool when `size` (the route text's bytes) is at least `OFFLOAD_BYTES`."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(fn, *args))


def _reset_after_fork() -> None:
    # A child gets the pool object but not its threads: work queued to it would never run.
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
