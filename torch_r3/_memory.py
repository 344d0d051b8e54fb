"""Where a batch's output tensors live: pinned, shared or plain host memory.

* Inside a `DataLoader` worker the output goes to fresh shared memory: the
  batch then reaches the main process without another copy (as
  `torch.utils.data.default_collate` does).
* In the main process of a machine with an accelerator it is pinned (page
  locked), so that `.to(device, non_blocking=True)` is a real asynchronous DMA.
* Otherwise it is plain memory.

This module also registers recycled host buffers with the CUDA driver
(`cudaHostRegister`): once per buffer, for the buffer's exact size, instead of
taking pinned blocks from torch's caching host allocator, which rounds every
block up to a power of two.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch


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
        warnings.warn("pin_memory=True but no accelerator is available; using plain memory", stacklevel=4)
    return "plain"


def empty(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A fresh, uninitialised tensor of `kind` memory."""
    if kind == "shared":
        # _new_shared maps fresh shared memory; share_memory_() on an existing
        # tensor would instead copy it, writing the buffer a second time.
        nbytes = max(math.prod(shape), 1) * dtype.itemsize
        storage = torch.UntypedStorage._new_shared(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    if kind == "pinned":
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # driver present but unusable: plain memory, never an error
            pass
    return torch.empty(shape, dtype=dtype)


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
