"""Renamed arguments and names: the old spelling keeps working and says, once per call, what to write instead.

One wording for every rename, so a user who meets two of them reads the same
sentence twice. A `DeprecationWarning` is attributed to the caller's line
(`stacklevel`), and passing the old and the new spelling at once is refused.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed_argument", "warn_renamed"]


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new` (both as the user writes them).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_renamed("collate_routes(padding=)", "filler=", stacklevel=1)
        >>> str(seen[0].message)
        'collate_routes(padding=) is deprecated; use filler= instead (same meaning)'
    """
    warnings.warn(f"{old} is deprecated; use {new} instead (same meaning)", DeprecationWarning, stacklevel=stacklevel)


def renamed_argument(
    old_value: Any, new_value: Any, *, old: str, new: str, where: str, default: Any = None, stacklevel: int = 4
) -> Any:
    """The value of an argument that was renamed from `old` to `new` in `where`.

    `old_value` is `None` when the caller did not pass the old spelling; then
    `new_value` is the answer. Otherwise a `DeprecationWarning` is issued (on
    the caller's caller's line, or `stacklevel` frames up) and `old_value` is the answer, unless the caller
    passed `new` as well (a `TypeError`).

    Raises:
        TypeError: When both spellings are given.
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated spelling), not both")
    warn_renamed(f"{where}({old}=)", f"{new}=", stacklevel=stacklevel)
    return old_value
