"""Where a batch's output tensors live: pinned, shared or plain host memory.

* Inside a `DataLoader` worker the output goes to fresh shared memory: the
  batch then reaches the main process without another copy (as
  `torch.utils.data.default_collate` does).
* In the main process of a machine with an accelerator it is pinned (page
  locked), so that `.to(device, non_blocking=True)` is a real asynchronous DMA.
* Otherwise it is plain memory.

Plain outputs of a hugepage or more, and every buffer of `BufferPool`, come
from private anonymous mappings (`mmap(MAP_PRIVATE | MAP_ANONYMOUS)`): a forked
child sees them copy-on-write, never the parent's later writes. Smaller plain
outputs come from NumPy's heap, private too. Either way the memory is tied to
the tensor's storage (`keep_with_storage`), so that it outlives a
`share_memory_()` that moves the storage while NumPy views still point at it. Where
transparent hugepages are in `madvise` or `always` mode, the mapping is
aligned to a hugepage and advised `MADV_HUGEPAGE`: a fresh output then takes
one page fault per 2 MiB instead of one per 4 KiB, and first-touch faults,
not the copy, are what a fresh batch costs on small pages.

This module also registers recycled host buffers with the CUDA driver
(`cudaHostRegister`): once per buffer, for the buffer's exact size, instead of
taking pinned blocks from torch's caching host allocator, which rounds every
block up to a power of two.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_r3._deprecation import warn_external


def accelerator_available() -> bool:
    """Whether an accelerator (CUDA, ROCm, XPU, ...) is usable from this process.

    A broken or missing driver counts as "no accelerator", never as an error.

    Returns:
        `True` when `torch.accelerator` (or, on older torch, CUDA) reports a device.
    """
    try:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "is_available"):
            return bool(acc.is_available())
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def in_worker() -> bool:
    """Whether this code runs inside a `DataLoader` worker process."""
    return torch.utils.data.get_worker_info() is not None


def check_pin_memory(pin_memory: Any) -> bool | None:
    """`pin_memory` validated: `None`, `True` or `False` (a `numpy.bool_` counts as a bool)."""
    if pin_memory is None or isinstance(pin_memory, (bool, np.bool_)):
        return None if pin_memory is None else bool(pin_memory)
    raise TypeError(f"pin_memory must be None, True or False, got {pin_memory!r} ({type(pin_memory).__name__})")


def memory_kind(pin_memory: bool | None) -> str:
    """`"shared"` inside a DataLoader worker, `"pinned"` where it helps, else `"plain"`."""
    if in_worker():
        # The batch crosses to the main process through shared memory without
        # another copy. Pinning, if any, happens there (DataLoader pin_memory).
        return "shared"
    if pin_memory is False:
        return "plain"
    if accelerator_available():
        return "pinned"
    if pin_memory:
        warn_external("pin_memory=True but no accelerator is available; using plain memory", UserWarning)
    return "plain"


#: Where the kernel says how transparent hugepages are used (`always [madvise] never`).
THP_ENABLED = "sys/kernel/mm/transparent_hugepage/enabled"
_THP_SIZE = "sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
# The usual x86-64 and arm64 (4 KiB base page) hugepage size, where the kernel does not say.
_DEFAULT_HUGEPAGE = 2 << 20


def read_thp_mode(root: str | os.PathLike = "/") -> str | None:
    """The transparent-hugepage mode under `root`: `"always"`, `"madvise"`, `"never"`, or `None` if unknown."""
    try:
        text = (Path(root) / THP_ENABLED).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


@functools.lru_cache(maxsize=1)
def thp_mode() -> str | None:
    """This machine's transparent-hugepage mode, read once per process (see `read_thp_mode`)."""
    return read_thp_mode()


@functools.lru_cache(maxsize=1)
def hugepage_size() -> int:
    """Bytes of one transparent hugepage (2 MiB where the kernel does not say)."""
    try:
        size = int(Path("/", _THP_SIZE).read_text())
    except (OSError, ValueError):
        return _DEFAULT_HUGEPAGE
    return size if size > mmap.PAGESIZE else _DEFAULT_HUGEPAGE


# Cleared the first time madvise is refused, so a kernel without THP is asked once.
_advise = {"hugepage": hasattr(mmap, "MADV_HUGEPAGE")}


def _size_error(nbytes: int, detail: object) -> MemoryError:
    return MemoryError(
        f"could not get {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB) of host memory for a collated output: {detail}"
    )


def map_private(nbytes: int, requested: int | None = None) -> np.ndarray:
    """`nbytes` of fresh private anonymous memory, as a `uint8` array that keeps the mapping alive.

    Copy-on-write across `fork`. Where transparent hugepages are in `madvise`
    or `always` mode and `nbytes` is at least a hugepage, the array starts on
    a hugepage boundary (the mapping is one hugepage larger, never touched
    there) and the mapping is advised `MADV_HUGEPAGE`; a kernel that refuses
    the advice gets plain pages, never an error.

    Raises:
        MemoryError: the OS refused the mapping; the message names `requested`
            (the size asked for, when the mapping is larger: a pool's headroom).
    """
    huge = hugepage_size()
    advise = _advise["hugepage"] and nbytes >= huge and thp_mode() in ("madvise", "always")
    length = max(nbytes + (huge if advise else 0), 1)
    try:
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as e:
        detail = f"a mapping of {length:,} bytes was refused ({e})"
        raise _size_error(nbytes if requested is None else requested, detail) from None
    if advise:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP not built in, or refused for this mapping: small pages
            _advise["hugepage"] = False
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = (-whole.ctypes.data) % huge if advise else 0
    return whole[start : start + nbytes]


def keep_with_storage(tensor: torch.Tensor, owner: object) -> None:
    """Keep `owner` (the memory a tensor was made over) alive for as long as `tensor`'s storage lives.

    The storage normally holds its memory itself. But `share_memory_()` (which
    `torch.multiprocessing.Queue.put` calls in place) and `resize_()` give the
    storage new memory and let go of the old, while a NumPy view taken before
    still points there: tied to the storage too, the old memory stays mapped
    while such a view can exist.
    """
    keep_with_storage_object(tensor.untyped_storage(), owner)


def keep_with_storage_object(storage: torch.UntypedStorage, owner: object) -> None:
    """`keep_with_storage` for a storage already in hand.

    torch keeps a storage's Python object for as long as the storage itself
    lives, so a finalizer on it runs when the storage goes, not when this
    reference does.
    """
    weakref.finalize(storage, _keep, owner).atexit = False


def _keep(owner: object) -> None:
    """Nothing to do: the finalizer's reference to `owner` was the point."""


def empty(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A fresh, uninitialised tensor of `kind` memory (`"shared"`, `"pinned"` or `"plain"`).

    Raises:
        MemoryError: the memory could not be had; the message names the size.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if kind == "shared":
        # _new_shared maps fresh shared memory; share_memory_() on an existing
        # tensor would instead copy it, writing the buffer a second time.
        try:
            storage = torch.UntypedStorage._new_shared(max(nbytes, dtype.itemsize))
        except RuntimeError as e:
            raise _size_error(nbytes, e) from None
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)
    if kind == "pinned":
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # driver present but unusable: plain memory, never an error
            pass
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if nbytes < hugepage_size():  # small: NumPy's (private) heap memory is as good as a mapping
        try:
            memory = np.empty(nbytes, dtype=np.uint8)
        except MemoryError as e:
            raise _size_error(nbytes, e) from None
    else:
        memory = map_private(nbytes)
    # frombuffer keeps the array (and so the memory) for the storage's data;
    # keep_with_storage keeps it for as long as the storage lives, moved or not.
    tensor = torch.frombuffer(memory, dtype=dtype, count=math.prod(shape)).view(shape)
    keep_with_storage(tensor, memory)
    return tensor


def register_host(address: int, nbytes: int) -> bool:
    """Page-lock `nbytes` of host memory at `address` for the accelerator; `False` if it cannot.

    Called once per recycled buffer. Only CUDA (and ROCm through the same
    interface) offers registration of existing memory; where it returns
    `False`, `BufferPool` takes pinned memory from torch instead.
    """
    try:
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        # cudaHostRegisterPortable (1): pinned for every CUDA context of the
        # process, as torch registers host memory itself.
        if int(cudart.cudaHostRegister(address, nbytes, 1)) == 0:
            return True
        # A failed call leaves its error for cudaGetLastError; clear it so that a
        # later, unrelated launch check in torch does not report it.
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
        return False
    except Exception:  # no CUDA runtime, or registration refused: plain memory
        return False


def unregister_host(address: int) -> None:
    """Undo `register_host` before the memory is unmapped."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # the process is shutting down or CUDA is gone: nothing to undo
        pass


def copy_fence() -> Any:
    """An event that completes after the work queued so far on the current CUDA stream.

    A pinned buffer may still be the source of a `non_blocking` host-to-device
    copy when its last tensor is dropped; `BufferPool` reuses it only once this
    fence, taken when the buffer comes back, has completed.

    Returns:
        An object with `query() -> bool`, or `None` when CUDA was never used
        in this process (then no copy can be in flight).
    """
    try:
        if not torch.cuda.is_initialized():
            return None
        event = torch.cuda.Event()
        event.record()
        return event
    except Exception:  # CUDA unusable here: nothing could have been queued on it
        return None
