"""The wire codec: route arrays to and from the JSON envelope of the generate call.

A route array ``[rows, layers, topk]`` travels as::

    {"data": "<base64 of the raw C-order bytes>", "shape": [rows, layers, topk],
     "dtype": "uint8" | "int16" | "int32"}

The bytes are little-endian. :func:`encode_routes` compacts first (one value
scan, on the sender); :func:`decode_routes` trusts the dtype and checks only the
envelope: the base64 is valid, the byte count is ``prod(shape) * itemsize``, the
dims are non-negative integers and the dtype is canonical. It never rescans the
values.

:func:`decode_sglang_routes` reads SGLang's own form (``meta_info["routed_experts"]``
of its ``/generate`` response): base64 of a flat little-endian ``int32`` array of
logical shape ``[tokens, num_layers, topk]``, where the caller supplies
``num_layers`` and ``topk``.

This module needs NumPy only; it never imports aiohttp.
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3.routes import CANONICAL_DTYPES, compact_routes

__all__ = ["decode_routes", "decode_sglang_routes", "encode_routes"]

_DTYPES_BY_NAME = {dtype.name: dtype for dtype in CANONICAL_DTYPES}
_REQUIRED_KEYS = ("data", "shape", "dtype")
# Base64 text decoded per step: a multiple of 4 characters, so every chunk but
# the last is whole quanta without padding. 4 MiB of text -> 3 MiB of bytes:
# the transient chunk stays small next to the result, which is written once.
_CHUNK_CHARS = 4 << 20
_STRICT = sys.version_info >= (3, 11)  # binascii strict_mode


def encode_routes(array: Any) -> dict[str, Any]:
    """Encode one trajectory's routes as the wire envelope, compacting them first.

    Args:
        array: A NumPy array or ``torch.Tensor`` ``[rows, layers, topk]`` of any
            integer dtype (see :func:`torch_r3.compact_routes`).

    Returns:
        ``{"data": str, "shape": [rows, layers, topk], "dtype": str}``, ready for
        ``json.dumps``; ``dtype`` is the narrowest canonical dtype.

    Raises:
        TypeError: ``array`` is not an integer array or tensor.
        ValueError: ``array`` is not 3-D, or holds a negative or too large id.

    Example:
        >>> import numpy as np
        >>> encode_routes(np.array([[[3, 1]], [[0, 7]]]))
        {'data': 'AwEABw==', 'shape': [2, 1, 2], 'dtype': 'uint8'}
    """
    routes = compact_routes(array)
    if routes.dtype.byteorder == ">" or (routes.dtype.byteorder == "=" and sys.byteorder == "big"):
        routes = routes.astype(routes.dtype.newbyteorder("<"))  # pragma: no cover - big-endian hosts
    return {
        "data": base64.b64encode(routes.reshape(-1).view(np.uint8)).decode("ascii"),
        "shape": [int(d) for d in routes.shape],
        "dtype": routes.dtype.name,
    }


def decode_routes(envelope: Any, *, name: str = "routed_experts") -> np.ndarray:
    """Decode a wire envelope into a route array, checking everything but the values.

    The base64 text is decoded straight into the result's own buffer, which is
    allocated once at its final size after the byte count has been checked
    against the shape: the payload is written exactly once.

    Args:
        envelope: The ``{"data", "shape", "dtype"}`` mapping as parsed from JSON.
        name: What to call the value in error messages (e.g. a field or sample).

    Returns:
        A new, writable, C-contiguous array ``[rows, layers, topk]`` of the
        envelope's canonical dtype.

    Raises:
        TypeError: ``envelope`` is not a mapping (a list-form route array
            included), or a field has the wrong type: ``data`` not a string,
            ``shape`` not a list, a dim not an ``int`` (``bool`` and ``float``
            are rejected), ``dtype`` not a string.
        ValueError: a required key is missing, ``shape`` is not 3 dims, a dim is
            negative (or ``layers``/``topk`` zero), ``dtype`` is not one of
            ``uint8``/``int16``/``int32``, the base64 is invalid, or its byte
            count is not ``prod(shape) * itemsize``.

    Example:
        >>> decode_routes({"data": "AwEABw==", "shape": [2, 1, 2], "dtype": "uint8"}).tolist()
        [[[3, 1]], [[0, 7]]]
    """
    if not isinstance(envelope, Mapping):
        if isinstance(envelope, (list, tuple)):
            raise TypeError(
                f"{name}: list-form routes are not accepted; expected the envelope "
                '{"data": <base64>, "shape": [rows, layers, topk], "dtype": <str>}'
            )
        raise TypeError(f"{name}: expected an envelope mapping with keys data/shape/dtype, got {type(envelope).__name__}")
    missing = [key for key in _REQUIRED_KEYS if key not in envelope]
    if missing:
        raise ValueError(f"{name}: envelope is missing required key(s) {missing}; expected keys {list(_REQUIRED_KEYS)}")
    dtype = _check_dtype(envelope["dtype"], name)
    shape = _check_shape(envelope["shape"], name)
    data = envelope["data"]
    if isinstance(data, (list, tuple)):
        raise TypeError(f"{name}.data: list-form routes are not accepted; expected a base64 string")
    out = np.empty(shape, dtype=dtype.newbyteorder("<"))
    _b64decode_into(data, out, f"{name}.data", f"shape {list(shape)} dtype {dtype.name}")
    return _to_native(out)


def decode_sglang_routes(
    value: Any,
    *,
    num_layers: int,
    topk: int,
    num_tokens: int | None = None,
    name: str = "routed_experts",
) -> np.ndarray:
    """Decode SGLang's ``routed_experts`` and compact it to a canonical route array.

    SGLang (``--enable-return-routed-experts``, request field
    ``"return_routed_experts": true``) returns the routes of its ``/generate``
    call in ``meta_info["routed_experts"]``: base64 of the raw bytes of a
    C-order little-endian ``int32`` array of logical shape
    ``[tokens, num_hidden_layers, num_experts_per_tok]``. The layer and top-k
    counts are not in the payload, so the caller gives them.

    Args:
        value: The base64 string (or bytes), or a mapping holding it: SGLang's
            ``meta_info``, or a whole ``/generate`` response with ``meta_info``.
        num_layers: Layers per row (the model's ``num_hidden_layers``).
        topk: Experts per token (the model's ``num_experts_per_tok``).
        num_tokens: When given, the exact row count expected.
        name: What to call the value in error messages.

    Returns:
        A new array ``[tokens, num_layers, topk]`` of the narrowest canonical dtype.

    Raises:
        TypeError: ``value`` is neither base64 text nor such a mapping, or a count
            is not an ``int``.
        ValueError: the key is missing, the base64 is invalid, the byte count is
            not a multiple of ``num_layers * topk * 4`` (or does not match
            ``num_tokens``), or an expert id is negative.

    Example:
        >>> import base64, numpy as np
        >>> raw = base64.b64encode(np.arange(8, dtype="<i4").tobytes()).decode()
        >>> decode_sglang_routes({"meta_info": {"routed_experts": raw}}, num_layers=2, topk=2).shape
        (2, 2, 2)
    """
    for field, count in (("num_layers", num_layers), ("topk", topk)):
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise TypeError(f"{name}: {field} must be an int, got {type(count).__name__}")
        if count <= 0:
            raise ValueError(f"{name}: {field} must be > 0, got {count}")
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"{name}: num_tokens must be an int or None, got {type(num_tokens).__name__}")
        if num_tokens < 0:
            raise ValueError(f"{name}: num_tokens must be >= 0, got {num_tokens}")
    data = value
    if isinstance(data, Mapping):
        if "meta_info" in data:
            data = data["meta_info"]
            if not isinstance(data, Mapping):
                raise TypeError(f"{name}: expected meta_info to be a mapping, got {type(data).__name__}")
        if "routed_experts" not in data:
            raise ValueError(f"{name}: no 'routed_experts' key in meta_info (was the request sent with return_routed_experts=True?)")
        data = data["routed_experts"]
    if isinstance(data, (list, tuple)):
        raise TypeError(f"{name}: list-form routes are not accepted; expected SGLang's base64 string")
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{name}: expected base64 text, got {type(data).__name__}")
    row_bytes = int(num_layers) * int(topk) * 4
    nbytes = _b64_length(data, f"{name}")
    if nbytes % row_bytes:
        raise ValueError(
            f"{name}: {nbytes} decoded bytes is not a whole number of int32 rows of "
            f"[num_layers={num_layers}, topk={topk}] ({row_bytes} bytes each)"
        )
    rows = nbytes // row_bytes
    if num_tokens is not None and rows != num_tokens:
        raise ValueError(f"{name}: expected {num_tokens} rows of [{num_layers}, {topk}], got {rows}")
    wide = np.empty((rows, int(num_layers), int(topk)), dtype="<i4")
    _b64decode_into(data, wide, name, f"{rows} int32 rows")
    # SGLang sends int32 whatever the expert count; narrowing is the one value
    # scan the contract allows, done here on the receiving edge because the
    # sender did not.
    return compact_routes(_to_native(wide), name=name)


def _check_dtype(value: Any, name: str) -> np.dtype:
    if not isinstance(value, str):
        raise TypeError(f"{name}.dtype: expected a string, one of {sorted(_DTYPES_BY_NAME)}, got {type(value).__name__}")
    dtype = _DTYPES_BY_NAME.get(value)
    if dtype is None:
        raise ValueError(f"{name}.dtype: expected one of the canonical dtypes {sorted(_DTYPES_BY_NAME)}, got {value!r}")
    return dtype


def _check_shape(value: Any, name: str) -> tuple[int, int, int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}.shape: expected a list [rows, layers, topk], got {type(value).__name__}")
    if len(value) != 3:
        raise ValueError(f"{name}.shape: expected 3 dims [rows, layers, topk], got {len(value)}: {list(value)}")
    for i, dim in enumerate(value):
        # bool is an int subclass; a float dim (even 2.0) means a broken sender.
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"{name}.shape[{i}]: expected an int, got {type(dim).__name__} {dim!r}")
        if dim < 0:
            raise ValueError(f"{name}.shape[{i}]: expected a non-negative int, got {dim}")
    if value[1] == 0 or value[2] == 0:
        raise ValueError(f"{name}.shape: layers and topk must be > 0, got {list(value)}")
    return (value[0], value[1], value[2])


def _b64_length(data: Any, what: str) -> int:
    """Decoded length of padded base64 text, from its length alone (no decoding)."""
    if isinstance(data, str):
        if not data.isascii():
            raise ValueError(f"{what}: invalid base64 (non-ASCII characters)")
        tail = data[-2:]
        pad = tail.count("=")
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = memoryview(data).cast("B")
        tail = bytes(data[-2:])
        pad = tail.count(b"=")
    else:
        raise TypeError(f"{what}: expected a base64 string, got {type(data).__name__}")
    if len(data) % 4:
        raise ValueError(f"{what}: invalid base64 (length {len(data)} is not a multiple of 4)")
    return len(data) // 4 * 3 - pad


def _b64decode_into(data: Any, out: np.ndarray, what: str, expected: str) -> None:
    """Decode base64 ``data`` into ``out``'s buffer, checking the byte count first."""
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{what}: expected a base64 string, got {type(data).__name__}")
    nbytes = _b64_length(data, what)
    if nbytes != out.nbytes:
        raise ValueError(f"{what}: base64 decodes to {nbytes} bytes, but {expected} needs {out.nbytes}")
    target = memoryview(out.reshape(-1).view(np.uint8))
    pos = 0
    try:
        for start in range(0, len(data), _CHUNK_CHARS):
            # binascii has no decode-into; each transient chunk is bounded, and
            # the result buffer was allocated once at its final size.
            chunk = data[start : start + _CHUNK_CHARS]
            if _STRICT:
                raw = binascii.a2b_base64(chunk, strict_mode=True)
            else:  # pragma: no cover - Python 3.10
                raw = base64.b64decode(chunk, validate=True)
            target[pos : pos + len(raw)] = raw
            pos += len(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what}: invalid base64 ({exc})") from None
    if pos != out.nbytes:  # padding inside the text, e.g. "AA==AAAA"
        raise ValueError(f"{what}: invalid base64 (decoded {pos} bytes, expected {out.nbytes})")


def _to_native(array: np.ndarray) -> np.ndarray:
    if array.dtype.isnative:
        return array.view(array.dtype.newbyteorder("="))
    return array.byteswap(inplace=True).view(array.dtype.newbyteorder("="))  # pragma: no cover - big-endian hosts

