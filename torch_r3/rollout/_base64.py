"""The base64 kernel under the wire codec: strict, chunked, and narrowing into the final array.

`decode_compact` reads base64 text (a `str`, or bytes such as a `memoryview` of
a response body) a chunk at a time and writes the decoded integers straight
into the canonical array the codec returns: each chunk is decoded, viewed as
the wire dtype, range-checked and narrowed while it is still in cache. There is
no full-width intermediate array and no copy of the whole text; besides the
result, a call holds one decoded chunk (`CHUNK_CHARS * 3 / 4` bytes, plus the
chunk's text when the input is a `str`).

The chunk decoder is pybase64 (SIMD, and it releases the GIL while it decodes,
as NumPy's reductions and casts do) when it is installed, else the standard
library's `binascii` in strict mode: the same checks either way, only slower.
The environment variable `TORCH_R3_BASE64` forces a choice: `binascii` the
fallback, `reference` the codec's reference decoder for every payload (the
decoder of torch_r3 0.1, kept to name what is wrong with a refused payload).

The kernel only accepts; it never diagnoses. When the text is not strict
base64 or an id is out of range, it returns `None` and the codec's reference
decoder, which reads the same payload the way it always has, names the
problem. Nothing here allocates by what a payload declares: the caller has
checked every size against its cap before calling.
"""

from __future__ import annotations

import binascii
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import pybase64
except ImportError:  # pragma: no cover - exercised by forcing the fallback, not by uninstalling
    pybase64 = None  # type: ignore[assignment]  # the decoder then is binascii

__all__ = [
    "CHUNK_CHARS",
    "ENV_DECODER",
    "decode_bytes",
    "decode_compact",
    "decoder",
    "describe_decoder",
]

#: The environment variable that forces a decoder: `binascii` (the fallback) or `reference`.
ENV_DECODER = "TORCH_R3_BASE64"
#: Base64 characters decoded per step: a multiple of 32, so that every chunk but
#: the last decodes to whole elements of 1 to 8 bytes. 256 KiB of text is 192
#: KiB of bytes: it stays in a core's L2 cache while it is checked and narrowed.
CHUNK_CHARS = 256 << 10
# The canonical dtypes, narrowest first, with the exclusive bound of the ids each holds.
_LADDER = ((np.dtype(np.uint8), 1 << 8), (np.dtype(np.int16), 1 << 15), (np.dtype(np.int32), 1 << 31))
_STRICT = sys.version_info >= (3, 11)  # binascii strict_mode
_UNSIGNED = {size: np.dtype(f"<u{size}") for size in (1, 2, 4, 8)}
_MAX = np.maximum.reduce  # `ndarray.max` without its Python wrapper: a small payload pays for every call


def decoder() -> str:
    """The decoder in use: `"pybase64"`, `"binascii"` or `"reference"` (forced, or Python 3.10 without pybase64)."""
    forced = os.environ.get(ENV_DECODER, "").strip().lower()
    if forced == "reference":
        return "reference"
    if pybase64 is not None and forced != "binascii":
        return "pybase64"
    return "binascii" if _STRICT else "reference"


def describe_decoder() -> str:
    """One line for `torch-r3 doctor`: which base64 decoder the wire codec uses, and why."""
    name = decoder()
    if name == "pybase64":
        return f"pybase64 {pybase64.__version__} (SIMD path: {_simd_name()})"
    forced = os.environ.get(ENV_DECODER, "").strip().lower()
    why = f"forced by {ENV_DECODER}={forced}" if forced in ("binascii", "reference") else "pybase64 not installed"
    if name == "binascii":
        return f"binascii, strict mode ({why}; several times slower: pip install 'torch_r3[client]')"
    return f"the reference decoder ({why}; the slowest)"


def _simd_name() -> str:
    # pybase64 names its SIMD path only through underscored helpers; a version
    # without them still decodes, it just cannot say how.
    try:
        return str(pybase64._get_simd_name(pybase64._get_simd_path()))
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - older pybase64
        return "unknown"


def _chunk_decoder() -> Callable[[Any], bytes] | None:
    name = decoder()
    if name == "pybase64":
        return _pybase64_chunk
    return _binascii_chunk if name == "binascii" else None


def _pybase64_chunk(text: Any) -> bytes:
    return pybase64.b64decode(text, validate=True)


def _binascii_chunk(text: Any) -> bytes:
    # strict_mode is Python 3.11+ (`_STRICT`); mypy checks against 3.10's signature
    return binascii.a2b_base64(text, strict_mode=True)  # type: ignore[call-arg]


def _as_text(text: Any) -> Any:
    # Slices of a memoryview are views: no chunk of a response body is copied.
    return text if isinstance(text, str) else memoryview(text).cast("B")


def decode_bytes(text: Any) -> bytes | None:
    """Strictly decode a short base64 text (a `.npy` header, a payload of one chunk), or `None` when it is not valid.

    A text whose padding sits inside it, not at its end, is not valid.
    """
    decode = _chunk_decoder()
    return None if decode is None else _decoded(decode, text)


def _decoded(decode: Callable[[Any], bytes], text: Any) -> bytes | None:
    try:
        return decode(_as_text(text))
    except ValueError:  # binascii.Error, and pybase64's refusal of non-ASCII text
        return None


def decode_compact(
    text: Any,
    *,
    shape: tuple[int, ...],
    wire: np.dtype,
    start: int = 0,
    keep: bool = False,
    num_experts: int | None = None,
    raw: bytes | None = None,
) -> np.ndarray | None:
    """Decode the integers of `wire` dtype from byte `start` of base64 `text` into a canonical array.

    The caller has checked that `text` decodes to exactly `start +
    prod(shape) * wire.itemsize` bytes and that this is under its cap.

    Args:
        text: Base64 text: a `str` or bytes (a `memoryview` of a body is read in place).
        shape: The result's shape.
        wire: The element dtype on the wire: an integer dtype of 1 to 8 bytes.
        start: Bytes to skip first (a `.npy` header); the text is still checked from its first character.
        keep: Return `wire`'s own (canonical) dtype, only range-checked, as our own
            envelope does; else the narrowest canonical dtype of the values, as
            `compact_routes` picks it.
        num_experts: Every id must be below it, when given.
        raw: `text` already decoded, when the caller has it: a text of one chunk
            is then read from `raw` rather than decoded again.

    Returns:
        A new C-contiguous array, or `None` when this kernel does not decode the
        payload: the text is not strict base64, an id is negative, `>= 2**31` or
        `>= num_experts`, or the wire is big-endian or the host is. The
        reference decoder then reads it and names what is wrong.
    """
    size = wire.itemsize
    if sys.byteorder != "little" or (size > 1 and wire.byteorder == ">"):
        return None  # a big-endian wire or host: the reference decoder swaps the bytes
    count = math.prod(shape)
    bound = _bound(wire, keep, num_experts)
    if len(text) <= CHUNK_CHARS:  # one chunk: decoded whole, then checked and narrowed in one pass each
        if raw is None:
            raw = decode_bytes(text)  # `None` when no kernel decoder is in use, too
        if raw is None or len(raw) != start + count * size:  # not base64, or padding inside the text
            return None
        ids = np.frombuffer(raw, dtype=_UNSIGNED[size], offset=start)
        # The same test as the chunked path's: a scan only where the first dtype might not hold every id.
        high = int(_MAX(ids)) if ids.size and min(bound, _LADDER[0][1]) < (1 << (8 * size)) else 0
        if high >= bound:
            return None  # the unsigned view turns a negative id into a huge one
        dtype = wire.newbyteorder("=") if keep else next(d for d, end in _LADDER if high < end)
        return ids.reshape(shape).astype(dtype)
    decode = _chunk_decoder()
    if decode is None:
        return None  # forced, or Python 3.10 without pybase64
    level = 0
    while True:
        dtype = wire.newbyteorder("=") if keep else _LADDER[level][0]
        limit = bound if keep else min(bound, _LADDER[level][1])
        out = np.empty(shape, dtype=dtype)
        if count == 0:
            return out
        widen = _fill(text, decode, out.reshape(-1), start, np.dtype(f"<u{size}"), bound, limit)
        if widen is None:
            return None
        if widen == 0:
            return out
        # A chunk held an id the dtype cannot: start again one dtype wider. Re-reading
        # the text (not copying what was written) keeps the peak at one result.
        del out
        level = widen


def _bound(wire: np.dtype, keep: bool, num_experts: int | None) -> int:
    """The exclusive bound of the ids a result of `wire` accepts."""
    signed_end = 1 << (8 * wire.itemsize - 1) if wire.kind == "i" else 1 << (8 * wire.itemsize)
    bound = signed_end if keep else min(signed_end, _LADDER[-1][1])
    return bound if num_experts is None else min(bound, num_experts)


def _fill(
    text: Any, decode: Callable[[Any], bytes], flat: np.ndarray, start: int, unsigned: np.dtype, bound: int, limit: int
) -> int | None:
    """Decode into `flat`: `0` when done, `None` when invalid, else the ladder level to restart at."""
    text = _as_text(text)
    size = unsigned.itemsize
    scan = min(bound, limit) < (1 << (8 * size))
    total = start + flat.size * size  # the bytes the whole text decodes to
    at = start // 3 * 4  # the text position of the quantum holding byte `start`
    skip = start - at // 4 * 3
    quanta = CHUNK_CHARS // 4
    while (3 * quanta - skip) % size:  # the first chunk ends on an element boundary
        quanta += 1
    pos = 0
    while pos < flat.size:
        if at >= len(text):  # pragma: no cover - the caller checked the length
            return None
        end = min(at + 4 * quanta, len(text))
        try:
            raw = decode(text[at:end])
        except ValueError:  # binascii.Error, and pybase64's refusal of non-ASCII text
            return None
        want = (end - at) // 4 * 3 if end < len(text) else total - at // 4 * 3
        if len(raw) != want:  # padding inside the text, e.g. "AA==AAAA"
            return None
        ids = np.frombuffer(raw, dtype=unsigned, offset=skip)
        if scan and ids.size:
            high = int(ids.max())
            if high >= bound:
                return None
            if high >= limit:
                return next(i for i, (_, end_id) in enumerate(_LADDER) if high < end_id)
        flat[pos : pos + ids.size] = ids  # the narrowing cast, chunk by chunk
        pos += ids.size
        del raw, ids  # freed before the next chunk is decoded: one chunk alive at a time
        at, skip, quanta = end, 0, CHUNK_CHARS // 4
    return 0
