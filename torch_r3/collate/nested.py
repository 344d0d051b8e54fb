"""A packed batch's per-token tensors as `torch.nested` jagged tensors, without a copy.

Some trainers (verl's no-padding path) carry per-token tensors as jagged
nested tensors, one component per sequence. A packed batch already holds the
same bytes: its values `[sum(n), ...]` and its `cu_seqlens`. `as_nested` wraps
them as they are; the nested tensor's `values()` is the input tensor itself
(same storage, same data pointer), so nothing is copied and a write through
either is seen by both.
"""

from __future__ import annotations

import torch

__all__ = ["as_nested"]


def _check_offsets(name: str, offsets: object, rows: int | None = None) -> list[int]:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [B + 1], got {type(offsets).__name__}")
    if offsets.ndim != 1 or offsets.numel() < 2:
        raise ValueError(f"{name}: expected shape [B + 1] with B >= 1, got {list(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got dtype {offsets.dtype}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {bounds}")
    if rows is not None and bounds[-1] != rows:
        raise ValueError(f"{name}: covers {bounds[-1]} rows, the values have {rows}")
    return bounds


def as_nested(
    values: torch.Tensor, cu_seqlens: torch.Tensor, *, cu_seqlens_padded: torch.Tensor | None = None
) -> torch.Tensor:
    """Wrap a packed per-token tensor as a jagged nested tensor, sharing its storage.

    Args:
        values: a packed tensor `[N, ...]` (`rollout_expert_indices`,
            `router_padding_mask`, `input_ids`, ...), contiguous.
        cu_seqlens: `[B + 1]` int32/int64 cumulative sequence lengths; with
            `cu_seqlens_padded`, the real lengths' sums.
        cu_seqlens_padded: the aligned offsets of a packed batch collated
            with `pad_to_multiple_of`: the nested tensor then has holes
            (offsets `cu_seqlens_padded`, lengths from `cu_seqlens`), so each
            component is the sequence's real tokens and the alignment rows
            are left out, still without a copy.

    Returns:
        A `torch.jagged` nested tensor `[B, j, ...]` whose `values()` is `values`.
        The offsets tensor is used as given (no copy either).

    Raises:
        TypeError: a tensor of the wrong kind or dtype.
        ValueError: offsets that are not `[B + 1]`, do not start at 0, decrease,
            do not cover the values, or a real length longer than its aligned span.

    Examples:
        >>> import numpy as np
        >>> from torch_r3 import collate_routes
        >>> batch = collate_routes([np.ones((2, 1, 1), np.uint8), np.ones((1, 1, 1), np.uint8)], [3, 2], layout="packed")
        >>> nested = as_nested(batch["rollout_expert_indices"], batch["cu_seqlens"])
        >>> [tuple(t.shape) for t in nested.unbind()]
        [(3, 1, 1), (2, 1, 1)]
        >>> nested.values().data_ptr() == batch["rollout_expert_indices"].data_ptr()
        True
    """
    if not isinstance(values, torch.Tensor) or values.is_nested:
        raise TypeError(f"values: expected a packed (non-nested) torch.Tensor, got {type(values).__name__}")
    if values.ndim < 1 or not values.is_contiguous():
        raise ValueError(f"values: expected a contiguous tensor [N, ...], got shape {list(values.shape)}")
    rows = values.shape[0]
    if cu_seqlens_padded is None:
        _check_offsets("cu_seqlens", cu_seqlens, rows)
        return torch.nested.nested_tensor_from_jagged(values, offsets=cu_seqlens)
    real = _check_offsets("cu_seqlens", cu_seqlens)
    spans = _check_offsets("cu_seqlens_padded", cu_seqlens_padded, rows)
    if len(real) != len(spans):
        raise ValueError(f"cu_seqlens has {len(real) - 1} sequences, cu_seqlens_padded {len(spans) - 1}")
    lengths = cu_seqlens.diff()
    for i, (n, (a, b)) in enumerate(zip(lengths.tolist(), zip(spans[:-1], spans[1:]))):
        if n > b - a:
            raise ValueError(f"sequence {i}: {n} real tokens in an aligned span of {b - a} (cu_seqlens_padded)")
    return torch.nested.nested_tensor_from_jagged(values, offsets=cu_seqlens_padded, lengths=lengths)
