"""Per-sequence lengths as verl holds them: Python ints, NumPy integers or integer tensors, checked once.

verl's batches carry lengths as tensors (`attention_mask.sum(-1)`,
`offsets().diff()`) and NumPy arrays (`non_tensor_batch`); all are read here as
Python ints, and only a wrong type or a value out of range is refused, each
with its own message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["lengths"]


def _scalar(value: Any, name: str) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 0:
            raise TypeError(f"{name} must be an integer, got an array of shape {list(value.shape)}")
        if isinstance(value, torch.Tensor):
            integral = not value.dtype.is_floating_point and not value.dtype.is_complex and value.dtype != torch.bool
        else:
            integral = value.dtype.kind in "iu"
        if not integral:
            raise TypeError(f"{name} must be an integer, got a {value.dtype} {type(value).__name__}")
        return int(value.item())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    return int(value)


def lengths(value: Any, name: str, *, upper: Sequence[int] | None = None) -> list[int]:
    """`value` (a sequence, 1-D array or 1-D tensor of integers) as a list of ints `>= 0`.

    Args:
        value: the lengths, one per sequence.
        name: the argument's name, as the caller wrote it (starts every message).
        upper: each element's largest allowed value (one per element), if bounded.

    Raises:
        TypeError: not a sequence of integers (a float, a bool, a 2-D array).
        ValueError: a negative length, one above its bound, or a count that
            differs from `upper`'s.
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence of integers, got an array of shape {list(value.shape)}")
        items: Sequence[Any] = list(value)
    elif isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)):
        raise TypeError(f"{name} must be a sequence of integers, got {type(value).__name__}")
    else:
        items = value
    out = [_scalar(v, f"{name}[{i}]") for i, v in enumerate(items)]
    if upper is not None and len(upper) != len(out):
        raise ValueError(f"{name}: expected {len(upper)} lengths (one per sequence), got {len(out)}")
    for i, v in enumerate(out):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        if upper is not None and v > upper[i]:
            raise ValueError(f"{name}[{i}] must be <= {upper[i]}, got {v}")
    return out
