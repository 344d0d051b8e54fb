"""The `.npy` reader under vLLM's route decoder: a header parser that never unpickles.

`decode_npy` reads a whole `.npy` file of integers from bytes; `npy_layout`
reads the dtype, order, shape and data offset from a file's first bytes, so the
codec's fast path can size the result before decoding the rest of the base64
text. Both check every size the header declares against the caller's cap, and
against the bytes that follow the header, before anything is read.

`check_size` is the one cap check the codec's decoders share with this reader.
Everything malformed raises `WireFormatError`. This module needs NumPy only.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from typing import Any

import numpy as np

from torch_r3._checks import check_at_least
from torch_r3.errors import WireFormatError

__all__ = ["DEFAULT_MAX_ROUTE_BYTES", "MAX_HEADER", "check_size", "decode_npy", "npy_layout"]

#: Default cap on the decoded route bytes of one payload (1 GiB): 128k tokens of
#: a 94-layer, top-8 model in `int32` are 0.4 GiB.
DEFAULT_MAX_ROUTE_BYTES = 1 << 30

# .npy: magic, version, header length; NumPy itself refuses headers over 10000 bytes.
_MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000
_MAX_DIMS = 64  # NumPy's own limit on ndim
_DESCR = re.compile(r"[<>|=]?[iu][1248]")
# The header as NumPy writes it, e.g. "{'descr': '|u1', 'fortran_order': False, 'shape': (95, 4, 4), }" and
# spaces to a 64-byte boundary, then a newline. Every text this matches is a literal that `ast.literal_eval`
# reads as the dict built from the groups (decimal ints without leading zeros, as Python writes them); any
# other text is read by `ast.literal_eval` itself.
_DIM = r"(?:0|[1-9][0-9]*)"
_INTEGER_DTYPES = {
    f"{order}{kind}{size}": np.dtype(f"{order}{kind}{size}")
    for order in ("", "<", ">", "|", "=")
    for kind in "iu"
    for size in "1248"
}
_WRITTEN = re.compile(
    r"\{'descr': '([<>|=]?[iu][1248])', 'fortran_order': (True|False), "
    rf"'shape': \(((?:{_DIM}, )*{_DIM},|{_DIM}(?:, {_DIM})+)?\), \}} *\n?"
)


def decode_npy(data: Any, *, max_bytes: int = DEFAULT_MAX_ROUTE_BYTES, name: str = "npy") -> np.ndarray:
    """Read a `.npy` file of integers from bytes, checking the header before the data.

    The header (format versions 1 to 3) is parsed as a Python literal, never
    unpickled; only integer dtypes of 1, 2, 4 or 8 bytes are accepted. The
    array's byte count, computed from the declared shape, is compared with
    `max_bytes` and with the bytes that follow the header before anything is
    read; the result is a read-only view of `data` (no copy).

    Args:
        data: The whole file as `bytes`, `bytearray`, `memoryview` or a `uint8`
            NumPy array.
        max_bytes: Largest array data accepted, in bytes.
        name: What to call the value in error messages.

    Returns:
        The array with the file's dtype and shape, a view of `data`.

    Raises:
        WireFormatError: `data` is not a `.npy` file, its header is malformed,
            its dtype is not an integer, its data is over `max_bytes`, or the
            byte count after the header is not the declared one.

    Examples:
        >>> import io, numpy as np
        >>> buf = io.BytesIO()
        >>> np.save(buf, np.arange(6, dtype=np.int16).reshape(3, 2), allow_pickle=False)
        >>> decode_npy(buf.getvalue()).tolist()
        [[0, 1], [2, 3], [4, 5]]
    """
    check_at_least(max_bytes, f"{name}: max_bytes", 0)
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise WireFormatError(f"{name}: expected .npy bytes, got an array of {data.dtype} shape {data.shape}")
        buf = data.data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        buf = memoryview(data).cast("B")
    else:
        raise WireFormatError(f"{name}: expected .npy bytes, got {type(data).__name__}")
    dtype, fortran, shape, offset = npy_layout(buf, len(buf), max_bytes, name)
    array = np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=offset)
    return array.reshape(shape, order="F" if fortran else "C")


def npy_layout(
    head: bytes | memoryview, total: int, max_bytes: int, name: str
) -> tuple[np.dtype, bool, tuple[int, ...], int]:
    """The dtype, order, shape and data offset of a `.npy` file of `total` bytes, from its first bytes.

    `head` holds the whole file, or at least its first `12 + MAX_HEADER` bytes.
    """
    if total < 10 or bytes(head[:6]) != _MAGIC:
        raise WireFormatError(f"{name}: not a .npy file (missing the \\x93NUMPY magic)")
    major = head[6]
    if major == 1:
        length, start = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3) and total >= 12:
        length, start = int.from_bytes(head[8:12], "little"), 12
    else:
        raise WireFormatError(f"{name}: unsupported .npy format version {major}.{head[7]}")
    if length > MAX_HEADER or start + length > total:
        raise WireFormatError(
            f"{name}: .npy header of {length} bytes is too long or truncated (file has {total} bytes)"
        )
    dtype, fortran, shape = _parse_header(bytes(head[start : start + length]), major, name)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # a zero dim: the others must still fit, or NumPy refuses the shape
        extent = math.prod(d for d in shape if d) * dtype.itemsize
        check_size(extent, max_bytes, name, "the non-zero dims of .npy shape", list(shape), dtype.str)
    check_size(nbytes, max_bytes, name, ".npy data", dtype.str, list(shape))
    offset = start + length
    if total - offset != nbytes:
        raise WireFormatError(
            f"{name}: .npy header declares {nbytes} data bytes ({dtype.str} {list(shape)}), but {total - offset} follow it"
        )
    return dtype, fortran, shape, offset


def check_size(nbytes: int, max_bytes: int, name: str, *described: object) -> None:
    """`nbytes` within `max_bytes`, else a `WireFormatError` naming what: `described`, joined by spaces.

    The description is built only for a refusal, so a short body pays nothing for it.
    """
    if nbytes > max_bytes:
        what = " ".join(map(str, described))
        raise WireFormatError(f"{name}: {what} is {nbytes} bytes, over the cap max_bytes={max_bytes}")


# Keyed by the header's bytes: a client reads the same few headers (one per row count) again and again, and a
# short body pays the parse on every call. Only headers that pass are kept (a refusal raises, and is not cached).
@functools.lru_cache(maxsize=256)
def _parse_header(header: bytes, major: int, name: str) -> tuple[np.dtype, bool, tuple[int, ...]]:
    try:
        text = header.decode("utf-8" if major == 3 else "latin1")
        # A Python literal, never code: literal_eval builds only constants and
        # containers, and the text is at most MAX_HEADER characters.
        written = _as_written(text)
        meta = written or ast.literal_eval(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
        raise WireFormatError(f"{name}: .npy header is not a Python literal ({type(exc).__name__})") from None
    if written is not None and len(written["shape"]) <= _MAX_DIMS:  # what the checks below accept, by its form
        return _INTEGER_DTYPES[written["descr"]], written["fortran_order"], written["shape"]
    if not isinstance(meta, dict) or set(meta) != {"descr", "fortran_order", "shape"}:
        raise WireFormatError(f"{name}: .npy header must be a dict with exactly descr, fortran_order and shape")
    descr, fortran, shape = meta["descr"], meta["fortran_order"], meta["shape"]
    if not isinstance(descr, str) or not _DESCR.fullmatch(descr):
        raise WireFormatError(f"{name}: .npy dtype must be an integer dtype, got {descr!r:.40}")
    if not isinstance(fortran, bool):
        raise WireFormatError(f"{name}: .npy fortran_order must be a bool, got {fortran!r:.40}")
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WireFormatError(f"{name}: .npy shape must be a tuple of non-negative ints, got {shape!r:.60}")
    if len(shape) > _MAX_DIMS:
        raise WireFormatError(f"{name}: .npy shape has {len(shape)} dims, more than NumPy's {_MAX_DIMS}")
    return np.dtype(descr), fortran, shape


def _as_written(text: str) -> dict[str, Any] | None:
    """The header dict of a header text as NumPy writes it, without `ast` (a hundred times faster), else `None`."""
    match = _WRITTEN.fullmatch(text)
    if match is None:
        return None
    descr, fortran, dims = match.groups()
    shape = tuple(int(d) for d in dims.rstrip(",").split(", ")) if dims else ()
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}
