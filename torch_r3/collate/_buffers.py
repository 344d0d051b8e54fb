"""Recycled host buffers for collated batches (`BufferPool`).

A training loop collates one batch per step. On fresh memory the first-touch
page faults cost several times the copy itself, so a pool keeps the memory of
batches the loop has finished with and hands it out again:

* Buffers are private anonymous mappings, hugepage-advised where the kernel
  allows (`torch_r3.collate._memory.map_private`): after `fork` the child sees every
  batch copy-on-write, so neither side's later batches or in-place edits
  reach the other's.
* A buffer goes back to the pool only when nothing uses it any more. Each
  output tensor is made with `torch.from_numpy` over a NumPy array that views
  the buffer; the tensor's storage holds that array, every view of the tensor
  and every `.numpy()` of it holds the storage, and a `weakref.finalize` on the
  array reports when the last of them is gone. Until then the buffer is never
  handed out again, so no live batch is ever overwritten. A storage whose
  memory was replaced in place (`share_memory_()`, which
  `torch.multiprocessing.Queue.put` calls, or `resize_()`) lets go of the
  array while NumPy views taken before still point into the buffer: such a
  buffer is never handed out again, and stays mapped until the storage goes.
* A request takes the smallest idle buffer that fits it, as a prefix view,
  provided at most about half the buffer would go unused; otherwise a new
  buffer is mapped, a sixteenth larger than asked and rounded to a page (room
  for the next slightly longer batch, never a power of two).
* Idle buffers are kept up to `cache_bytes` (by default twice the
  largest batch served, a batch being the tensors of one `empty_batch`: the `for batch in loader` loop holds the previous
  batch while the next is collated, so one idle batch is all it reuses); the
  least recently released go first.
* Pinned buffers (for accelerator hosts) are page-locked once, when mapped, for
  their exact size, and unlocked when evicted. A `non_blocking` copy to the
  device may still read a pinned buffer after its last tensor is dropped, so
  a pinned buffer is reused only once a CUDA event, recorded on the current
  stream when the buffer came back, has completed. (A copy queued on another
  stream must be synchronised by its owner before the batch is dropped.)

Releases may come from any thread (whichever drops the last tensor); they are
queued without a lock and folded in by the next request, so a release never
waits for, or deadlocks with, a request in progress. After `fork` the child
starts with an empty pool; pickling keeps only the setting.
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_non_negative
from torch_r3._deprecation import renamed_argument, warn_renamed
from torch_r3.collate import _memory

__all__ = ["BufferPool"]

_PAGE = mmap.PAGESIZE
# A request may use a buffer up to this many times its size (bounded waste).
_MAX_WASTE = 2


def _buffer_size(nbytes: int) -> int:
    """A new buffer's size: a sixteenth of headroom, whole pages, never a power-of-two rounding."""
    return max(_PAGE, -(-(nbytes + nbytes // 16) // _PAGE) * _PAGE)


def _check_shape(shape: Any) -> tuple[int, ...]:
    """`shape` as a tuple of ints >= 0; a `TypeError`/`ValueError` naming it otherwise."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints, got {shape!r}") from None
    try:
        return tuple(check_non_negative(d, f"shape[{i}]") for i, d in enumerate(dims))
    except (TypeError, ValueError) as exc:  # the whole shape too: which call asked for it
        raise type(exc)(f"{exc} (shape {shape!r})") from None


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # no NumPy equivalent (bfloat16)
        return None


class _Buffer:
    """One mapped host buffer, page-locked for the accelerator when `pinned`."""

    __slots__ = ("__weakref__", "fence", "mem", "nbytes", "pid", "pinned")

    def __init__(self, nbytes: int, pinned: bool, requested: int) -> None:
        # Set before mapping, so that a refused mapping leaves a buffer __del__ can close.
        self.nbytes, self.pinned, self.pid, self.fence = nbytes, False, os.getpid(), None
        # Private (copy-on-write across fork), page aligned, hugepage-advised
        # where the kernel allows; returned to the OS when the last view goes.
        self.mem: np.ndarray = _memory.map_private(nbytes, requested)
        if pinned:
            self.pinned = _memory.register_host(self.mem.ctypes.data, nbytes)

    def ready(self) -> bool:
        """No accelerator copy from this buffer can still be in flight."""
        if self.fence is not None and not self.fence.query():
            return False
        self.fence = None
        return True

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        # `pinned` is only ever True once `mem` exists (a refused mapping leaves it False).
        if self.pinned and self.pid == os.getpid():
            if self.fence is not None:  # never unlock memory a copy is still reading
                self.fence.synchronize()
            _memory.unregister_host(self.mem.ctypes.data)
        self.pinned = False


def _returned(state: _State, buf: _Buffer, storage: weakref.ref) -> None:
    """The array a tensor was made over is gone: recycle its buffer, unless the storage lives on.

    A storage outlives the array when its memory was replaced in place
    (`share_memory_()`, `resize_()`): views taken before still point into the
    buffer, so it is never handed out again and stays mapped until the
    storage itself goes.
    """
    moved = storage()
    if moved is None:
        state.released.append((buf, True))
        return
    state.released.append((buf, False))
    _memory.keep_with_storage_object(moved, buf)


class _State:
    """The buffers of one pool in one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.idle: list[_Buffer] = []  # least recently released first
        # (buffer, reusable) pairs, appended lock-free by whichever thread drops a batch.
        self.released: collections.deque[tuple[_Buffer, bool]] = collections.deque()
        self.idle_bytes = self.live_bytes = self.largest = self.hits = self.misses = 0
        self.can_register = True


class BufferPool:
    """Host buffers for collated batches, reused once no tensor of a batch is alive.

    `R3Collator` owns one; pass one to `collate_routes(..., memory=Memory(buffers=pool))` to
    recycle its outputs in your own loop. Thread-safe, fork-safe and
    picklable (a copy starts empty).

    Args:
        cache_bytes: the most bytes of idle buffers kept for reuse;
            `None` for twice the largest batch served so far, `0` to turn
            recycling off (every request gets fresh memory). The same setting
            as `R3Collator(memory=Memory(cache_bytes=))`.
        max_cached_bytes: deprecated, the old name of `cache_bytes`
            (a `DeprecationWarning`).

    Examples:
        >>> import torch
        >>> from torch_r3 import BufferPool
        >>> pool = BufferPool()
        >>> batch = pool.empty((4, 1024), torch.uint8)
        >>> address, view = batch.data_ptr(), batch[2:]
        >>> del batch  # the view still uses the memory: it is not handed out
        >>> pool.empty((4, 1024), torch.uint8).data_ptr() == address
        False
        >>> del view  # now nothing does
        >>> pool.empty((4, 1024), torch.uint8).data_ptr() == address
        True
    """

    def __init__(self, cache_bytes: int | None = None, *, max_cached_bytes: int | None = None) -> None:
        if max_cached_bytes is not None:
            # The old name of the keyword: `Memory(cache_bytes=)` names the same setting.
            cache_bytes = renamed_argument(
                max_cached_bytes, cache_bytes, old="max_cached_bytes", new="cache_bytes", where="BufferPool"
            )
        self.cache_bytes = None if cache_bytes is None else check_non_negative(cache_bytes, "cache_bytes")
        self._state = _State()

    @property
    def max_cached_bytes(self) -> int | None:
        """Deprecated: the old name of `cache_bytes`."""
        warn_renamed("BufferPool.max_cached_bytes", "BufferPool.cache_bytes")
        return self.cache_bytes

    def __getstate__(self) -> dict[str, Any]:
        return {"cache_bytes": self.cache_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickle written before the rename carries the old key.
        BufferPool.__init__(self, state["cache_bytes"] if "cache_bytes" in state else state["max_cached_bytes"])

    def __repr__(self) -> str:
        return f"BufferPool(cache_bytes={self.cache_bytes!r}, {self.stats()})"

    def _current(self) -> _State:
        state = self._state
        if state.pid != os.getpid():  # forked: the parent's buffers are not ours to hand out
            state = self._state = _State()
        return state

    def _bound(self, state: _State) -> int:
        return 2 * state.largest if self.cache_bytes is None else self.cache_bytes

    def _fold_released(self, state: _State) -> None:
        """Move released buffers to the idle list and evict beyond the bound (lock held)."""
        while state.released:
            buf, reusable = state.released.popleft()
            if not reusable:  # its storage moved elsewhere: no longer ours to hand out
                state.live_bytes -= buf.nbytes
                continue
            if buf.pinned:  # a non_blocking copy from it may still be queued
                buf.fence = _memory.copy_fence()
            state.live_bytes -= buf.nbytes
            state.idle.append(buf)
            state.idle_bytes += buf.nbytes
        bound = self._bound(state)
        while state.idle and state.idle_bytes > bound:
            buf = state.idle.pop(0)
            state.idle_bytes -= buf.nbytes
            buf.close()

    def _take(self, state: _State, nbytes: int, pinned: bool) -> _Buffer | None:
        with state.lock:
            self._fold_released(state)
            fits = [
                b
                for b in state.idle
                if b.pinned == pinned and nbytes <= b.nbytes <= _MAX_WASTE * nbytes + _PAGE and b.ready()
            ]
            if not fits:
                state.misses += 1
                return None
            # The smallest that fits; among equals the most recently released (warm in cache).
            buf = min(reversed(fits), key=lambda b: b.nbytes)
            state.idle.remove(buf)
            state.idle_bytes -= buf.nbytes
            state.live_bytes += buf.nbytes
            state.hits += 1
            return buf

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """An uninitialised tensor whose memory comes back to the pool once unused.

        Args:
            shape: the tensor's shape.
            dtype: its dtype.
            pinned: page-locked memory for fast accelerator copies.

        Returns:
            A contiguous CPU tensor; its memory is not handed out again while
            it, a view of it or an array sharing its memory is alive.
        """
        return self.empty_batch({"": (shape, dtype)}, pinned=pinned)[""]

    def empty_batch(
        self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], *, pinned: bool = False
    ) -> dict[str, torch.Tensor]:
        """The tensors of one batch, as `empty` makes them; the batch's size sets the default bound.

        Args:
            specs: `{key: (shape, dtype)}` of the batch's tensors.
            pinned: page-locked memory for fast accelerator copies.

        Returns:
            `{key: tensor}`, each recycled independently of the others.
        """
        specs = {k: (_check_shape(shape), _check_dtype(dt)) for k, (shape, dt) in specs.items()}
        kind = "pinned" if pinned else "plain"
        state = self._current()
        if self.cache_bytes == 0:
            return {k: _memory.empty(shape, dt, kind) for k, (shape, dt) in specs.items()}
        sizes = {k: math.prod(shape) * dt.itemsize for k, (shape, dt) in specs.items()}
        with state.lock:
            state.largest = max(state.largest, sum(_buffer_size(n) for n in sizes.values()))
        return {k: self._empty(state, shape, dt, sizes[k], pinned) for k, (shape, dt) in specs.items()}

    def _empty(self, state: _State, shape, dtype: torch.dtype, nbytes: int, pinned: bool) -> torch.Tensor:
        np_dtype = _numpy_dtype(dtype)
        if np_dtype is None or (pinned and not state.can_register):  # bfloat16, or no cudaHostRegister
            return _memory.empty(tuple(shape), dtype, "pinned" if pinned else "plain")
        buf = self._take(state, nbytes, pinned)
        if buf is None:
            buf = _Buffer(_buffer_size(nbytes), pinned, nbytes)
            if pinned and not buf.pinned:  # registration refused: stop trying, use torch's pinned memory
                state.can_register = False
                return _memory.empty(tuple(shape), dtype, "pinned")
            with state.lock:
                state.live_bytes += buf.nbytes
        array = buf.mem[:nbytes].view(np_dtype).reshape(shape)
        tensor = torch.from_numpy(array)
        # The tensor's storage holds `array`; when the last user of the storage
        # is gone, `array` dies and the buffer is queued for reuse.
        weakref.finalize(array, _returned, state, buf, weakref.ref(tensor.untyped_storage())).atexit = False
        return tensor

    def stats(self) -> dict[str, int]:
        """Counters for reports: idle and live bytes, buffers, hits and misses.

        Returns:
            `cached_bytes` (idle, kept for reuse), `live_bytes` (handed out and
            still in use), `buffers` (idle count), `hits` and `misses`.
        """
        state = self._current()
        with state.lock:
            self._fold_released(state)
            return {
                "cached_bytes": state.idle_bytes,
                "live_bytes": state.live_bytes,
                "buffers": len(state.idle),
                "hits": state.hits,
                "misses": state.misses,
            }

    def clear(self) -> None:
        """Drop every idle buffer (buffers still in use are released later, as usual)."""
        state = self._current()
        with state.lock:
            self._fold_released(state)
            for buf in state.idle:
                buf.close()
            state.idle.clear()
            state.idle_bytes = 0
