"""Route arrays: the canonical dtypes and the sender-side ``compact_routes``.

A trajectory's routes are a C-contiguous NumPy array ``[rows, layers, topk]`` of
one *canonical* dtype: ``uint8`` (expert ids < 2**8), ``int16`` (< 2**15) or
``int32`` (< 2**31), in native byte order. The sender compacts to the narrowest
one; receivers trust the dtype and never rescan values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Canonical route dtypes, narrowest first, native byte order.
CANONICAL_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.uint8),
    np.dtype(np.int16),
    np.dtype(np.int32),
)
# Exclusive upper bound of the expert ids each canonical dtype may carry.
_LIMITS = ((np.dtype(np.uint8), 2**8), (np.dtype(np.int16), 2**15), (np.dtype(np.int32), 2**31))
MAX_EXPERT_ID = 2**31 - 1


def canonical_dtype_for(max_id: int) -> np.dtype:
    """The narrowest canonical dtype that holds expert ids ``0 .. max_id``.

    >>> canonical_dtype_for(255), canonical_dtype_for(256), canonical_dtype_for(40000)
    (dtype('uint8'), dtype('int16'), dtype('int32'))
    """
    if isinstance(max_id, bool) or not isinstance(max_id, (int, np.integer)):
        raise TypeError(f"max_id must be an int, got {type(max_id).__name__}")
    if max_id < 0:
        raise ValueError(f"max_id must be >= 0, got {max_id}")
    for dtype, limit in _LIMITS:
        if max_id < limit:
            return dtype
    raise ValueError(f"expert id {max_id} does not fit int32 (must be < 2**31)")


def is_canonical(dtype: Any) -> bool:
    """True when ``dtype`` is one of :data:`CANONICAL_DTYPES` (native byte order)."""
    try:
        return np.dtype(dtype) in CANONICAL_DTYPES
    except TypeError:
        return False


def widest(dtypes) -> np.dtype:
    """The widest of some canonical dtypes: promotion by dtype alone, no value scan."""
    return max(dtypes, key=CANONICAL_DTYPES.index)


def as_host_array(array: Any, what: str) -> np.ndarray:
    """A NumPy array or an integer ``torch.Tensor`` (detached, moved to host) as a NumPy array."""
    # Lazy torch import keeps this module usable from NumPy-only senders.
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(array, torch.Tensor):
        if array.dtype.is_floating_point or array.dtype.is_complex or array.dtype == torch.bool:
            raise TypeError(f"{what}: expected an integer tensor, got dtype {array.dtype}")
        return array.detach().to("cpu").numpy()
    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"{what}: expected a NumPy array or torch.Tensor, "
            f"got {type(array).__name__}"
        )
    return array


def compact_routes(array: Any, *, name: str = "routes") -> np.ndarray:
    """Validate one trajectory's routes and compact them to the narrowest canonical dtype.

    The sender-side step: it scans the values once (min and max) so that the
    receiver never has to. Accepts a NumPy array or a CPU/GPU ``torch.Tensor``
    ``[rows, layers, topk]`` of any integer dtype; returns a new C-contiguous,
    writable array of ``uint8``, ``int16`` or ``int32``.

    >>> import numpy as np
    >>> compact_routes(np.array([[[3, 1]], [[0, 7]]], dtype=np.int64)).dtype
    dtype('uint8')
    >>> compact_routes(np.array([[[300, 1]]])).dtype
    dtype('int16')

    Raises:
        TypeError: not an array/tensor, or a float, bool or complex dtype.
        ValueError: not 3-D, ``layers`` or ``topk`` zero, a negative id, or an id >= 2**31.
    """
    a = as_host_array(array, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {a.dtype}")
    if a.ndim != 3:
        raise ValueError(f"{name}: expected shape [rows, layers, topk], got {a.ndim}-D shape {a.shape}")
    if a.shape[1] == 0 or a.shape[2] == 0:
        raise ValueError(f"{name}: layers and topk must be > 0, got shape {a.shape}")
    if a.size == 0:
        target = CANONICAL_DTYPES[0]
    else:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0:
            raise ValueError(f"{name}: expert ids must be >= 0, found {lo}")
        if hi > MAX_EXPERT_ID:
            raise ValueError(f"{name}: expert ids must be < 2**31, found {hi}")
        target = canonical_dtype_for(hi)
    # Always a fresh, writable, C-ordered, native-endian copy: the caller may
    # hand us a view of a buffer it goes on mutating.
    return np.array(a, dtype=target, order="C", copy=True)
