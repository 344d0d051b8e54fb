"""The dtype rule of a batch's other keys: the widest of the samples' values, as NumPy promotes.

A key that is neither the routes, the tokens nor a `pad_keys` key (a reward, an index, a
per-sample array) is stacked into one tensor `[B, ...]`. Its dtype is NumPy's promotion of
the samples' values (`np.result_type`): a Python int is `int64`, a float `float64`, a bool
`bool`, a NumPy value or a tensor its own dtype; so `[0, 0.1]` is `float64`, float32 and
float64 arrays make `float64`. Every value is cast to that dtype before it is stacked, so a
DataLoader worker (which stacks into shared memory of the first value's dtype) gives the
main process's batch. The one promotion NumPy makes that can lose precision, 64-bit ints
with floats (or `int64` with `uint64`) to `float64`, is refused for an int beyond 2**53.

A subset of a batch (a micro-batch) sees only its own samples: `extra_dtypes` gives a key
the global batch's dtype, and each value is checked to cast to it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["FLOAT64_EXACT", "check_extra_dtypes", "numeric_dtypes", "stack_numbers"]

# Beyond this, a 64-bit int does not survive float64.
FLOAT64_EXACT = 2**53
# Tensor dtypes NumPy lacks, promoted as the narrowest NumPy dtype that holds every value.
_PROMOTED_AS = {torch.bfloat16: np.dtype(np.float32)}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16, float8, ...: NumPy has no such dtype
        return None


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _dtype_of(value: Any, i: int, key: str) -> np.dtype | torch.dtype | None:
    """A value's dtype (`None`: not a number or a numeric array; a torch dtype: one NumPy lacks)."""
    if isinstance(value, torch.Tensor):
        return _numpy_dtype(value.dtype) or value.dtype
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype if value.dtype.kind in "biufc" else None
    if isinstance(value, (bool, int, float)):
        dtype = np.asarray(value).dtype
        if dtype.kind == "O":
            raise ValueError(f"sample {i}: extra key {key!r} holds {value}, which fits no 64-bit integer dtype")
        return dtype
    return None


def numeric_dtypes(values: Sequence[Any], key: str) -> list[np.dtype | torch.dtype] | None:
    """Each value's dtype, or `None` when a value is not a number, numeric array or tensor."""
    dtypes = []
    for i, value in enumerate(values):
        dtype = _dtype_of(value, i, key)
        if dtype is None:
            return None
        dtypes.append(dtype)
    return dtypes


def _promoted(dtypes: list[np.dtype | torch.dtype], key: str) -> np.dtype | torch.dtype:
    """NumPy's promotion of the dtypes; one dtype NumPy lacks stays itself, mixed it promotes as `_PROMOTED_AS`."""
    if all(d == dtypes[0] for d in dtypes):
        return dtypes[0]
    as_numpy = []
    for i, d in enumerate(dtypes):
        if isinstance(d, torch.dtype):
            if d not in _PROMOTED_AS:
                raise ValueError(
                    f"sample {i}: extra key {key!r} is a {d} tensor, which no NumPy dtype holds, and other samples' "
                    f"values are {dtypes[0] if i else dtypes[1]}; give every sample's {key!r} one dtype"
                )
            d = _PROMOTED_AS[d]
        as_numpy.append(d)
    return np.result_type(*as_numpy)


def _too_wide(value: Any) -> bool:
    """A 64-bit integer value (or array) holding an int beyond 2**53."""
    if isinstance(value, int):
        return abs(value) > FLOAT64_EXACT
    if isinstance(value, torch.Tensor):
        value = value.numpy(force=True)
    arr = np.asarray(value)
    return bool(arr.size) and (int(arr.max()) > FLOAT64_EXACT or int(arr.min()) < -FLOAT64_EXACT)


def _check_exact(values: Sequence[Any], dtypes: list[Any], target: Any, key: str, given: bool) -> None:
    """Every value casts to `target` exactly, or a `ValueError` names the sample."""
    if isinstance(target, torch.dtype):
        return  # every value already has this dtype NumPy lacks
    for i, (value, d) in enumerate(zip(values, dtypes)):
        if isinstance(d, torch.dtype):
            d = _PROMOTED_AS[d]
        if given and not np.can_cast(d, target, "safe"):
            raise ValueError(
                f"sample {i}: extra key {key!r} is {d}, which extra_dtypes[{key!r}] = {target} does not hold "
                f"exactly; give the global batch's dtype (NumPy's promotion of every sample's value)"
            )
        if target.kind in "fc" and d.kind in "iu" and d.itemsize == 8 and _too_wide(value):
            raise ValueError(
                f"sample {i}: extra key {key!r} holds an int beyond 2**53, which the batch's {target} (NumPy's "
                f"promotion with the other samples' values) would round; give every sample's {key!r} ints, or "
                f"floats already"
            )


def _as_tensor(value: Any, dtype: torch.dtype, np_dtype: np.dtype | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, np.ndarray) and value.dtype == np_dtype:
        return torch.as_tensor(value)
    return torch.from_numpy(np.asarray(value, dtype=np_dtype))


def stack_numbers(values: Sequence[Any], dtypes: list[Any], key: str, dtype: Any = None) -> list[torch.Tensor]:
    """The values as tensors of one dtype (`dtype`, else NumPy's promotion of theirs), checked exact.

    Args:
        values: the samples' values of one key, numbers, numeric arrays or tensors.
        dtypes: their dtypes, from `numeric_dtypes`.
        key: the key, for messages.
        dtype: the global batch's dtype of the key (`extra_dtypes`), a NumPy dtype.

    Returns:
        One tensor per sample, all of the batch's dtype, for `default_collate` to stack.
    """
    target = _promoted(dtypes, key) if dtype is None else dtype
    _check_exact(values, dtypes, target, key, given=dtype is not None)
    if isinstance(target, torch.dtype):
        return [_as_tensor(v, target, None) for v in values]
    return [_as_tensor(v, _torch_dtype(target), target) for v in values]


def check_extra_dtypes(extra_dtypes: Any, reserved: set[str]) -> dict[str, np.dtype]:
    """`R3Collator(extra_dtypes=)`: `{key: dtype}` (a torch or NumPy dtype NumPy holds), keys not reserved."""
    if extra_dtypes is None:
        return {}
    if not isinstance(extra_dtypes, Mapping):
        raise TypeError(f"extra_dtypes must be a mapping {{key: dtype}}, got {type(extra_dtypes).__name__}")
    out = {}
    for key, dtype in extra_dtypes.items():
        np_dtype = _numpy_dtype(dtype) if isinstance(dtype, torch.dtype) else None
        if dtype is not None and not isinstance(dtype, torch.dtype):  # np.dtype(None) would be float64
            try:
                np_dtype = np.dtype(dtype)
            except TypeError:
                np_dtype = None
        if np_dtype is None or np_dtype.kind not in "biufc":
            raise TypeError(f"extra_dtypes[{key!r}] must be a numeric torch or NumPy dtype NumPy holds, got {dtype!r}")
        out[key] = np_dtype
    clash = reserved & set(out)
    if clash:
        raise ValueError(f"extra_dtypes may not name the routes/tokens/pad keys or an output key: {sorted(clash)}")
    return out
