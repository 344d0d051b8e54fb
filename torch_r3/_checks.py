"""Argument checks: one rule, one error class and one wording per kind of argument.

Every public function and class of the package checks its caller's arguments
here, so the same mistake reads the same wherever it is made:

- an integer accepts a Python `int` or any NumPy integer and returns an `int`;
  a `bool` (Python or NumPy) is refused, since `True` as a size is a bug;
- a sequence of indices accepts a list, tuple, range, 1-D NumPy array or torch
  tensor of such integers (never a `str`, a set or a mapping) and returns a tuple;
- a wrong type is a `TypeError` ("num_layers must be an int, got float");
- a right type with a bad value is a `ValueError` ("num_layers must be >= 1, got 0");
- every message starts with the argument's name, as the caller wrote it.

These rules are for arguments a program passes. Data read from the wire is
checked by the codec, which raises its own `WireFormatError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "check_at_least",
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_finite_float",
    "check_indices",
    "check_instance",
    "check_int",
    "check_integer_dtype",
    "check_non_negative",
    "check_positive",
    "check_str",
    "check_token_counts",
]


def check_int(value: Any, name: str) -> int:
    """`value` as an `int`: a Python or NumPy integer, never a bool.

    Examples:
        >>> check_int(np.int64(3), "num_layers")
        3
        >>> check_int(True, "num_layers")
        Traceback (most recent call last):
            ...
        TypeError: num_layers must be an int, got bool
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_at_least(value: Any, name: str, minimum: int) -> int:
    """`value` as an `int` that is `>= minimum`."""
    out = check_int(value, name)
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_positive(value: Any, name: str) -> int:
    """A size or count that must be at least 1, as an `int`.

    Examples:
        >>> check_positive(-1, "num_layers")
        Traceback (most recent call last):
            ...
        ValueError: num_layers must be >= 1, got -1
    """
    return check_at_least(value, name, 1)


def check_non_negative(value: Any, name: str) -> int:
    """A size, count or index that may be 0, as an `int`."""
    return check_at_least(value, name, 0)


def _as_sequence(value: Any, name: str, what: str) -> Any:
    # A 1-D array or tensor reads as its elements (NumPy integers or Python ints); torch is
    # recognised by name, so this module needs no torch import.
    if isinstance(value, np.ndarray) or (type(value).__module__ == "torch" and type(value).__name__ == "Tensor"):
        if value.ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence of {what}s, got an array of shape {list(value.shape)}")
        return list(value) if isinstance(value, np.ndarray) else value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)):
        raise TypeError(f"{name} must be a sequence of {what}s, got {type(value).__name__}")
    return value


def check_indices(
    value: Any, name: str, *, limit: int | None = None, what: str = "index", distinct: bool = True
) -> tuple[int, ...]:
    """A non-empty sequence of indices (each an `int` in `[0, limit)`, distinct unless `distinct=False`), as a tuple.

    `what` names one element in the messages ("layer index", "id").

    Examples:
        >>> check_indices(np.array([2, 0]), "keep_layers", what="layer index")
        (2, 0)
        >>> check_indices([1, 1], "keep_layers", what="layer index")
        Traceback (most recent call last):
            ...
        ValueError: keep_layers[1]: layer index 1 is listed twice
        >>> check_indices([3], "route_layers", limit=3, what="layer")
        Traceback (most recent call last):
            ...
        ValueError: route_layers[0]: layer 3 is outside [0, 3)
    """
    items = _as_sequence(value, name, "int")
    if len(items) == 0:
        raise ValueError(f"{name} must hold at least one {what}, got an empty sequence")
    out = tuple(check_int(v, f"{name}[{k}]") for k, v in enumerate(items))
    seen: set[int] = set()
    for k, v in enumerate(out):
        if v < 0 or (limit is not None and v >= limit):
            bound = f"outside [0, {limit})" if limit is not None else "negative (indices are >= 0)"
            raise ValueError(f"{name}[{k}]: {what} {v} is {bound}")
        if distinct and v in seen:
            raise ValueError(f"{name}[{k}]: {what} {v} is listed twice")
        seen.add(v)
    return out


def check_token_counts(value: Any, name: str = "token_counts") -> list[int]:
    """A non-empty sequence of token counts, each an `int >= 1`, as a list.

    Examples:
        >>> check_token_counts(np.array([3, 1]))
        [3, 1]
        >>> check_token_counts([3, 0])
        Traceback (most recent call last):
            ...
        ValueError: token_counts[1] must be >= 1, got 0
    """
    items = _as_sequence(value, name, "int")
    if len(items) == 0:
        raise ValueError(f"{name} must hold at least one token count, got an empty sequence")
    return [check_positive(n, f"{name}[{i}]") for i, n in enumerate(items)]


def check_bool(value: Any, name: str) -> bool:
    """A flag: Python or NumPy `True`/`False`, as a `bool` (`1`, `"yes"` and `None` are refused).

    Examples:
        >>> check_bool(np.bool_(True), "compact")
        True
        >>> check_bool(1, "compact")
        Traceback (most recent call last):
            ...
        TypeError: compact must be True or False, got 1
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r:.60}")
    return bool(value)


def check_finite_float(value: Any, name: str, *, allow_zero: bool = True, note: str = "") -> float:
    """A finite, non-negative real number (a Python or NumPy int or float, never a bool), as a `float`.

    `allow_zero=False` refuses 0 as well; `note` is appended to the value error
    (say what to pass instead, such as `None` for no limit).

    Examples:
        >>> check_finite_float(np.float32(0.5), "backoff")
        0.5
        >>> check_finite_float(float("inf"), "backoff")
        Traceback (most recent call last):
            ...
        ValueError: backoff must be a finite number >= 0, got inf
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out) or out < 0 or (out == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {out}" + (f" ({note})" if note else ""))
    return out


def check_choice(value: Any, name: str, choices: Iterable[Any]) -> Any:
    """`value` when it is one of `choices` (an enum given by its members).

    Examples:
        >>> check_choice("packed", "layout", ("padded", "packed"))
        'packed'
        >>> check_choice("ragged", "layout", ("padded", "packed"))
        Traceback (most recent call last):
            ...
        ValueError: layout must be one of ['padded', 'packed'], got 'ragged'
    """
    members = list(choices)
    # Compare by type first: an array's == is elementwise, and 1 == True.
    if not any(isinstance(value, type(m)) and not isinstance(value, (bool, np.bool_)) and value == m for m in members):
        raise ValueError(f"{name} must be one of {members}, got {value!r:.60}")
    return value


def check_instance(value: Any, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`value` if it is an instance of `kind`, else `TypeError`: `name` must be `what`, got its type.

    Examples:
        >>> check_instance(b"x", "model", str, "a str")
        Traceback (most recent call last):
            ...
        TypeError: model must be a str, got bytes
    """
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_str(value: Any, name: str) -> str:
    """A `str` (text such as a URL, a model name or a version; bytes are refused)."""
    return check_instance(value, name, str, "a str")


def _dtype_names(allowed: tuple[np.dtype, ...]) -> str:
    names = [str(d) for d in allowed]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_dtype(value: Any, name: str, allowed: tuple[np.dtype, ...]) -> np.dtype:
    """A requested dtype (NumPy, torch, a type or a string) as one of the native-order NumPy dtypes `allowed`.

    Not a dtype at all is a `TypeError`; a dtype outside `allowed` a `ValueError`.

    Examples:
        >>> check_dtype("int16", "dtype", (np.dtype(np.uint8), np.dtype(np.int16)))
        dtype('int16')
        >>> check_dtype(np.float32, "dtype", (np.dtype(np.uint8), np.dtype(np.int16)))
        Traceback (most recent call last):
            ...
        ValueError: dtype must be uint8 or int16 (native byte order), got <f4 (float32)
    """
    names = _dtype_names(allowed)
    # A torch dtype, read by name so this module needs no torch import.
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        np_name = str(value).removeprefix("torch.")
        for d in allowed:
            if str(d) == np_name:
                return d
        raise ValueError(f"{name} must be {names}, got {value}")
    try:
        np_dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy or torch dtype ({names}), got {value!r:.60}") from None
    if np_dtype not in allowed:
        raise ValueError(f"{name} must be {names} (native byte order), got {np_dtype.str} ({np_dtype})")
    return np_dtype


def check_integer_dtype(array: Any, name: str) -> None:
    """An array (NumPy or anything with a NumPy `.dtype`) of integers; a float, bool or complex dtype is a `TypeError`."""
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {array.dtype}")
