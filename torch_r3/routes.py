"""Route arrays: the canonical dtypes, the sender-side `compact_routes` and the
receive-side `check_expert_ids`.

A trajectory's routes are a C-contiguous NumPy array `[rows, layers, topk]` of
one *canonical* dtype: `uint8` (expert ids < 2**8), `int16` (< 2**15) or
`int32` (< 2**31), in native byte order. The sender compacts to the narrowest
one; the receiver checks the id range once where routes enter the process, and
from then on everything trusts the dtype and never rescans values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from torch_r3._checks import check_integer_dtype, check_non_negative, check_positive
from torch_r3.health.check import RouteHealthCheck, health_check

# The rest (the dtype table, `widest`, `as_host_array`) is shared with the
# codec, trace and collator, not offered to users.
__all__ = ["canonical_dtype_for", "check_expert_ids", "compact_routes"]

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
    """The narrowest canonical dtype that holds expert ids `0 .. max_id`.

    Args:
        max_id: The largest expert id to hold.

    Returns:
        `uint8`, `int16` or `int32`.

    Raises:
        TypeError: `max_id` is not an `int`.
        ValueError: `max_id` is negative or does not fit `int32`.

    Examples:
        >>> canonical_dtype_for(255), canonical_dtype_for(256), canonical_dtype_for(40000)
        (dtype('uint8'), dtype('int16'), dtype('int32'))
    """
    max_id = check_non_negative(max_id, "max_id")
    for dtype, limit in _LIMITS:
        if max_id < limit:
            return dtype
    raise ValueError(f"expert id {max_id} does not fit int32 (must be < 2**31)")


def is_canonical(dtype: Any) -> bool:
    """True when `dtype` is one of `CANONICAL_DTYPES` (native byte order)."""
    try:
        return np.dtype(dtype) in CANONICAL_DTYPES
    except TypeError:
        return False


def widest(dtypes: Iterable[np.dtype]) -> np.dtype:
    """The widest of some canonical dtypes: promotion by dtype alone, no value scan.

    Examples:
        >>> widest([np.dtype("uint8"), np.dtype("int16")])
        dtype('int16')
    """
    return max(dtypes, key=CANONICAL_DTYPES.index)


def as_host_array(array: Any, what: str) -> np.ndarray:
    """A host NumPy array from what a sender naturally holds.

    Accepts a NumPy array, a `torch.Tensor` on any device (detached and moved to
    the host), or any object with the `.detach().cpu().numpy()` methods of a
    tensor (a duck-typed device array).

    Args:
        array: The array, tensor or tensor-like object.
        what: What to call it in error messages.

    Returns:
        A NumPy array (the input itself when it already is one).

    Raises:
        TypeError: `array` is none of these, a tensor of a float, complex or
            bool dtype, or its `.numpy()` did not return a NumPy array.
    """
    # Lazy torch import keeps this module usable from NumPy-only senders.
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]  # the isinstance checks below are skipped without torch
    if torch is not None and isinstance(array, torch.Tensor):
        if array.dtype.is_floating_point or array.dtype.is_complex or array.dtype == torch.bool:
            raise TypeError(f"{what}: expected an integer tensor, got dtype {array.dtype}")
        return array.detach().to("cpu").numpy()
    if isinstance(array, np.ndarray):
        return array
    if callable(getattr(array, "detach", None)):
        host = array.detach().cpu().numpy()
        if not isinstance(host, np.ndarray):
            raise TypeError(
                f"{what}: {type(array).__name__}.detach().cpu().numpy() returned "
                f"{type(host).__name__}, not a NumPy array"
            )
        return host
    raise TypeError(
        f"{what}: expected a NumPy array or torch.Tensor (or a tensor-like object with "
        f".detach().cpu().numpy()), got {type(array).__name__}"
    )


def check_expert_ids(routes: np.ndarray, num_experts: int | None = None, *, name: str = "routes") -> np.ndarray:
    """Check that every expert id is in `[0, num_experts)`: the receive-side range check.

    Run it once where routes enter the process (the wire decoders do); after it,
    the collator trusts the dtype and never looks at the values again (the
    replay hook checks them once more on the training device, with the model's
    expert count and for repeated experts in a row). It scans only what the dtype leaves open: a `uint8` array is
    never negative, and when `num_experts` exceeds what the dtype can hold no
    upper scan is needed either.

    Args:
        routes: An integer NumPy array of any shape.
        num_experts: Routed experts per MoE layer, when known; without it only
            negative ids are refused.
        name: What to call the array in error messages.

    Returns:
        `routes` itself, unchanged.

    Raises:
        TypeError: `routes` is not an integer NumPy array, or `num_experts` is
            not an `int`.
        ValueError: `num_experts` is not positive, or an id is negative or
            `>= num_experts` (the message gives its index and value).

    Examples:
        >>> import numpy as np
        >>> check_expert_ids(np.array([[[0, 7]]], np.int16), 8).tolist()
        [[[0, 7]]]
        >>> check_expert_ids(np.array([[[0, -1]]], np.int16))
        Traceback (most recent call last):
            ...
        ValueError: routes: expert ids must be in [0, num_experts), found -1 at index (0, 0, 1)
    """
    if not isinstance(routes, np.ndarray) or routes.dtype.kind not in "iu":
        got = routes.dtype if isinstance(routes, np.ndarray) else type(routes).__name__
        raise TypeError(f"{name}: expected an integer NumPy array, got {got}")
    _check_num_experts(num_experts, name)
    index = first_bad_id(routes, num_experts)
    if index is not None:
        raise ValueError(
            f"{name}: expert ids must be in [0, num_experts), found {int(routes[index])} at index {index}"
            + (f" (num_experts={num_experts})" if num_experts is not None else "")
        )
    return routes


def first_bad_id(routes: np.ndarray, num_experts: int | None) -> tuple[int, ...] | None:
    """The index of the first id outside `[0, num_experts)` (negative only, without `num_experts`), or `None`.

    One min and one max scan, each only where the dtype leaves it open (a `uint8` array is never
    negative; a `num_experts` above the dtype's largest value needs no upper scan).

    Examples:
        >>> first_bad_id(np.array([[[0, 7]], [[9, 1]]], np.uint8), 8)
        (1, 0, 0)
    """
    if routes.size == 0:
        return None
    bad = None
    if routes.dtype.kind == "i" and int(routes.min()) < 0:
        bad = routes < 0
    elif num_experts is not None and int(num_experts) <= int(np.iinfo(routes.dtype).max):
        if int(routes.max()) >= num_experts:
            bad = routes >= num_experts
    if bad is None:
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), routes.shape))


def first_repeated_expert(routes: np.ndarray) -> tuple[int, int] | None:
    """`(row, layer)` of the first route `[rows, layers, topk]` that names one expert twice, or `None`.

    A route whose ids are all zero is left to the engine-health check: that is what a dense
    layer, or a layer the engine did not capture, sends (`torch_r3.health`). Whole-array
    comparisons of the `topk` columns, pair by pair, over one transposed copy: no loop per row.

    Examples:
        >>> first_repeated_expert(np.array([[[0, 1], [0, 0]], [[2, 3], [5, 5]]], np.uint8))
        (1, 1)
    """
    k = routes.shape[-1]
    if k < 2 or routes.size == 0:
        return None
    columns = np.ascontiguousarray(routes.reshape(-1, k).T)  # [topk, rows * layers]
    repeated = np.zeros(columns.shape[1], bool)
    equal = np.empty_like(repeated)
    for a in range(k - 1):
        for b in range(a + 1, k):
            repeated |= np.equal(columns[a], columns[b], out=equal)
    if not repeated.any():
        return None
    hits = np.flatnonzero(repeated & columns.any(axis=0))
    if hits.size == 0:
        return None
    row, layer = divmod(int(hits[0]), routes.shape[1])
    return row, layer


def _check_num_experts(num_experts: Any, name: str) -> None:
    if num_experts is not None:
        check_positive(num_experts, f"{name}: num_experts")


def compact_routes(
    array: Any,
    *,
    name: str = "routes",
    num_experts: int | None = None,
    health: str | RouteHealthCheck | None = "raise",
) -> np.ndarray:
    """Validate one trajectory's routes and compact them to the narrowest canonical dtype.

    The sender-side step: it scans the values once (min and max) so that the
    receiver only has to check the range (`check_expert_ids`). It also checks
    the routes for the engines' capture-bug signatures that are decidable
    without the model's layer map or the tokens (`torch_r3.health`): rows
    that are zero in every layer (with `topk >= 2`, impossible for real
    routes) and a layer stuck on one non-zero row over many tokens; and it
    refuses a route that names one expert twice, naming its row and layer.
    The collator does not rescan values for that (with `num_experts=` it
    checks the range only); the replay hooks refuse repeated experts again on
    the training device, before a router sees them.

    Args:
        array: A NumPy array, a CPU/GPU `torch.Tensor` or a tensor-like object
            (see `as_host_array`) `[rows, layers, topk]` of any integer dtype.
        name: What to call the array in error messages.
        num_experts: Routed experts per MoE layer, when known: the same min/max
            scan then also refuses ids `>= num_experts`, as `check_expert_ids`
            would (with its message), without a second pass over the values.
        health: What to do with routes that carry a capture-bug signature:
            `"raise"` (the default, `RouteHealthError`), `"warn"`, `"count"`,
            a `RouteHealthCheck` of your own (its `stats` count every call), or
            `None` for no check (routes a check has already seen). Unless
            `None`, a route that names one expert twice (`[5, 5]`, not all
            zero) is refused whatever the mode: a router never makes one.

    Returns:
        A new C-contiguous, writable array of `uint8`, `int16` or `int32`.

    Raises:
        TypeError: not an array/tensor, or a float, bool or complex dtype.
        ValueError: not 3-D, `layers` or `topk` zero, a negative id, an id >= 2**31, or
            (with a health check) a route naming one expert twice, with its row and layer.
        RouteHealthError: A capture-bug signature, with `health="raise"` (a `ValueError`).

    Examples:
        >>> import numpy as np
        >>> compact_routes(np.array([[[3, 1]], [[0, 7]]], dtype=np.int64)).dtype
        dtype('uint8')
        >>> compact_routes(np.array([[[300, 1]]])).dtype
        dtype('int16')
        >>> compact_routes(np.array([[[3, 8]]]), num_experts=8)
        Traceback (most recent call last):
            ...
        ValueError: routes: expert ids must be in [0, num_experts), found 8 at index (0, 0, 1) (num_experts=8)
    """
    _check_num_experts(num_experts, name)
    check = None if health is None else health_check(health)
    a = as_host_array(array, name)
    check_integer_dtype(a, name)
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
        if num_experts is not None and hi >= num_experts:
            check_expert_ids(a, num_experts, name=name)  # raises, naming the first offending index
        target = canonical_dtype_for(hi)
    # Always a fresh, writable, C-ordered, native-endian copy: the caller may
    # hand us a view of a buffer it goes on mutating.
    out = np.array(a, dtype=target, order="C", copy=True)
    if check is not None:
        check.check(out, trajectory=name, num_experts=num_experts)
        repeated = first_repeated_expert(out)
        if repeated is not None:
            row, layer = repeated
            route = out[row, layer].tolist()
            raise ValueError(
                f"{name}: row {row}, layer {layer}: route {route} names an expert twice; the topk={len(route)} "
                "experts of a token are distinct (a router never repeats one): check how the routes were made"
            )
    return out
