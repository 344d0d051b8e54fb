"""Numbers as the report prints them: units that scale with the value.

A column of times or sizes gets one unit, chosen from its smallest value, so a
tiny shape reads "85 us" rather than "0.1 ms" and a small buffer "12 kB"
rather than "0 MB".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["byte_unit", "format_bytes", "format_gib", "format_rate", "format_ratio", "number", "time_unit"]

_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


def _unit(values: Sequence[float], units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    smallest = min(positive) if positive else 0.0
    for name, scale in units:
        if smallest >= scale:
            return name, scale
    return units[-1]


def time_unit(seconds: Sequence[float]) -> tuple[str, float]:
    """The unit (name, seconds per unit) in which the smallest of `seconds` is at least 1.

    Args:
        seconds: the values of one column.

    Returns:
        `(name, scale)`: print `value / scale` followed by `name`.

    Examples:
        >>> time_unit([0.25, 0.0123]), time_unit([8.5e-05, 0.002])
        (('ms', 0.001), ('us', 1e-06))
    """
    return _unit(seconds, _TIME_UNITS)


def byte_unit(sizes: Sequence[float]) -> tuple[str, float]:
    """The decimal unit (name, bytes per unit) in which the smallest of `sizes` is at least 1.

    Args:
        sizes: the values of one column, in bytes.

    Returns:
        `(name, scale)`: print `value / scale` followed by `name`.

    Examples:
        >>> byte_unit([688e6, 1.2e9]), byte_unit([12_000, 3e6])
        (('MB', 1000000.0), ('kB', 1000.0))
    """
    return _unit(sizes, _BYTE_UNITS)


def format_gib(n: float) -> str:
    """`n` bytes in GiB with one decimal, the unit of every memory requirement.

    Examples:
        >>> format_gib(3 * 2**30)
        '3.0 GiB'
    """
    return f"{n / 2**30:.1f} GiB"


def format_ratio(value: float | None) -> str:
    """A ratio as `1.23x`, or `-` where there is none.

    Examples:
        >>> format_ratio(1.234), format_ratio(None)
        ('1.23x', '-')
    """
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def number(value: float) -> str:
    """A value already scaled to its unit: no decimals from 100 up, one below.

    Examples:
        >>> number(1234.5), number(12.34)
        ('1,234', '12.3')
    """
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def format_bytes(n: float) -> str:
    """`n` bytes in the decimal unit that suits it.

    Examples:
        >>> format_bytes(688_000_000), format_bytes(280)
        ('688 MB', '280 B')
    """
    name, scale = byte_unit([n])
    return f"{number(n / scale)} {name}"


def format_rate(bytes_per_s: float) -> str:
    """A throughput in the decimal unit per second that suits it.

    Examples:
        >>> format_rate(25.7e9), format_rate(3.2e6)
        ('25.7 GB/s', '3.2 MB/s')
    """
    return format_bytes(bytes_per_s) + "/s"
