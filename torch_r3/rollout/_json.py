"""`loads`: a response body's `json.loads`, read by orjson where orjson gives exactly that value.

orjson (in the `client` extra) parses an engine's answer two to four times
faster than the standard library. Its value differs from `json.loads`'s in
two ways only, and `loads` rules both out:

* it refuses some documents `json.loads` reads (`NaN` and `Infinity`, a lone
  surrogate escape, a number past the float range, nesting past 1024, bytes
  that are not UTF-8): on any refusal `json.loads` reads the body, and gives
  its own value or raises its own error;
* it reads an integer outside 64 bits as a float, without refusing: a body
  holding a run of `MAX_PLAIN_DIGITS + 1` digits or more that does not follow
  a `.` goes to `json.loads`. A fraction's digits follow the point, so a
  log-prob such as `-0.0012345678901234567` (19 digits after the point, as
  Python and pydantic write it) is no such run; everything else is counted,
  in a string too: a cheap test that can send a body to `json.loads` for
  nothing, never one that lets a long integer through.

So `loads(body)` equals `json.loads(body)`, value and types, or raises the same
error; only the time differs. Without orjson, or with `TORCH_R3_JSON=json` in
the environment when this module is imported, every body is read by `json.loads`.
"""

from __future__ import annotations

import json
import os
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by forcing the standard library, not by uninstalling
    orjson = None  # type: ignore[assignment]

__all__ = ["ENV_JSON", "MAX_PLAIN_DIGITS", "describe_parser", "loads", "parser"]

#: The environment variable that forces the standard library's parser: `TORCH_R3_JSON=json`.
ENV_JSON = "TORCH_R3_JSON"
#: The longest run of digits a body may hold for orjson to read it. An integer of 18 digits is
#: below 10**18 < 2**63 in magnitude, which orjson reads as an `int`; from 19 digits on, a negative
#: one may pass -2**63 and from 20 a positive one 2**64, which orjson would turn into a float.
MAX_PLAIN_DIGITS = 18
# Every digit byte to "1", the point to ".", every other byte to "0": a run of digits is then a
# run of "1"s, and one right after a "." is a fraction's (see `_long_integer`).
_DIGITS = bytes(0x31 if 0x30 <= b <= 0x39 else 0x2E if b == 0x2E else 0x30 for b in range(256))
_LONG_RUN = b"1" * (MAX_PLAIN_DIGITS + 1)
_POINT = ord(".")
_FAST = None if orjson is None or os.environ.get(ENV_JSON) == "json" else orjson.loads


def parser() -> str:
    """Which parser reads the bodies `loads` can hand to it: `"orjson"` or `"json"` (the standard library)."""
    return "json" if _FAST is None else "orjson"


def describe_parser() -> str:
    """One line for `torch-r3 doctor`: which parser reads the response bodies, and why."""
    if _FAST is not None:
        return f"orjson {orjson.__version__} (json.loads where orjson would read a body differently)"
    why = f"forced by {ENV_JSON}=json" if orjson is not None else "orjson not installed"
    return f"json.loads ({why}; two to four times slower on log-prob-heavy bodies: pip install 'torch_r3[client]')"


def _long_integer(marks: bytes | bytearray) -> bool:
    """Whether `marks` (a body through `_DIGITS`) holds a long run of digits that no point precedes.

    The run itself is searched for (a pattern led by "0" would make the search
    slow on a text of "0"s); a run after a point is a fraction, skipped to its end.
    """
    at = marks.find(_LONG_RUN)
    while at >= 0:
        if at == 0 or marks[at - 1] != _POINT:
            return True
        end = marks.find(b"0", at)  # a fraction's digits end at a byte that is neither digit nor point
        if end < 0:
            return False
        at = marks.find(_LONG_RUN, end)
    return False


def loads(body: bytes | bytearray) -> Any:
    """`json.loads(body)`: the same value, of the same types, or the same error.

    Examples:
        >>> loads(b'{"ids": [1, 2], "logprob": -0.25}')
        {'ids': [1, 2], 'logprob': -0.25}
        >>> loads(b'[123456789012345678901234567890, NaN]')  # what orjson would change or refuse
        [123456789012345678901234567890, nan]
    """
    fast = _FAST
    if fast is None or _long_integer(body.translate(_DIGITS)):
        return json.loads(body)
    try:
        return fast(body)
    except ValueError:  # orjson.JSONDecodeError: json.loads reads it, or names what is wrong as before
        return json.loads(body)
