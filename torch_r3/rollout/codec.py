"""The wire codec: route arrays to and from the payloads of the inference servers.

Three payloads carry routes, and each has one decoder here:

* Our own JSON envelope (`encode_routes` / `decode_routes`), little-endian
  bytes of a canonical dtype:

  ```
  {"data": "<base64 of the raw C-order bytes>", "shape": [rows, layers, topk],
   "dtype": "uint8" | "int16" | "int32"}
  ```

* SGLang's `meta_info["routed_experts"]` (`decode_sglang_routes`): base64 of a
  flat little-endian `int32` array with no header, or of the narrower dtype the
  server advertises in `meta_info["routed_experts_dtype"]`.
* vLLM's `choices[i].routed_experts` (`decode_vllm_routes`): base64 of a whole
  `.npy` file, read by the small header parser `decode_npy`, never by pickle.

Every decoder treats its input as hostile: each size is computed from the
declared shape and the length of the base64 text, and compared with the
caller's cap (`max_bytes`) and with each other, before a single byte of the
result is allocated. Anything malformed raises `WireFormatError`, a
`ValueError`, naming the field. Every decoder returns a canonical
`[rows, layers, topk]` array (see `torch_r3.compact_routes`) whose ids have been
range-checked once (`torch_r3.check_expert_ids`): never negative, and below
`num_experts` when the caller knows it.

The text is a `str` or bytes (a `memoryview` of a response body, as the client
passes it, is read in place). After the checks, each decoder hands it to the
chunked kernel (`torch_r3.rollout._base64`: pybase64, else strict `binascii`), which
decodes, range-checks and narrows a chunk at a time straight into the result:
it holds the result and one chunk. A payload the kernel refuses goes to the
decoder's reference path, the decode of torch_r3 0.1.0 (the whole decoded
payload, up to `max_bytes`, then its canonical copy), which names the problem.

This module needs NumPy only; it never imports aiohttp.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3._checks import check_at_least
from torch_r3.errors import WireFormatError
from torch_r3.rollout import _base64
from torch_r3.rollout._npy import DEFAULT_MAX_ROUTE_BYTES, MAX_HEADER, check_size, decode_npy, npy_layout
from torch_r3.rollout._sglang_payload import meta_info, whole_rows
from torch_r3.routes import CANONICAL_DTYPES, check_expert_ids, compact_routes

# `decode_npy` (the `.npy` reader of `torch_r3.rollout._npy`, re-exported here) and
# `base64_decoded_length` are the decoders' own parsers, kept unprefixed for the
# fuzz tests that attack them directly; not offered to users. `WireFormatError`
# lives in `torch_r3.errors`; it is importable from here as it always was.
__all__ = [
    "WireFormatError",
    "decode_routes",
    "decode_sglang_routes",
    "decode_vllm_routes",
    "encode_routes",
]

_DTYPES_BY_NAME = {dtype.name: dtype for dtype in CANONICAL_DTYPES}
_REQUIRED_KEYS = ("data", "shape", "dtype")
# SGLang sends int32 unless it advertises a narrower dtype.
_SGLANG_DTYPES: dict[str, np.dtype] = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
# Base64 text decoded per step: a multiple of 4 characters, so every chunk but
# the last is whole quanta without padding. 4 MiB of text -> 3 MiB of bytes:
# the transient chunk stays small next to the result, which is written once.
_CHUNK_CHARS = 4 << 20
_STRICT = sys.version_info >= (3, 11)  # binascii strict_mode


def encode_routes(array: Any) -> dict[str, Any]:
    """Encode one trajectory's routes as the wire envelope, compacting them first.

    Args:
        array: A NumPy array, a `torch.Tensor` on any device, or a tensor-like
            object with `.detach().cpu().numpy()`, `[rows, layers, topk]` of any
            integer dtype (see `torch_r3.compact_routes`).

    Returns:
        `{"data": str, "shape": [rows, layers, topk], "dtype": str}`, ready for
        `json.dumps`; `dtype` is the narrowest canonical dtype.

    Raises:
        TypeError: `array` is not an integer array, tensor or tensor-like.
        ValueError: `array` is not 3-D, or holds a negative or too large id.

    Examples:
        >>> import numpy as np
        >>> encode_routes(np.array([[[3, 1]], [[0, 7]]]))
        {'data': 'AwEABw==', 'shape': [2, 1, 2], 'dtype': 'uint8'}
    """
    routes = compact_routes(array, health=None)  # encoding only: the sender checked them
    if routes.dtype.byteorder == ">" or (routes.dtype.byteorder == "=" and sys.byteorder == "big"):
        routes = routes.astype(routes.dtype.newbyteorder("<"))  # pragma: no cover - big-endian hosts
    return {
        "data": base64.b64encode(routes.reshape(-1).view(np.uint8).data).decode("ascii"),
        "shape": [int(d) for d in routes.shape],
        "dtype": routes.dtype.name,
    }


def decode_routes(
    envelope: Any,
    *,
    name: str = "routed_experts",
    max_bytes: int = DEFAULT_MAX_ROUTE_BYTES,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
) -> np.ndarray:
    """Decode our own wire envelope into a route array, bounded before allocating.

    The declared shape and dtype give the byte count; it is compared with
    `max_bytes` and with the length of the base64 text before the result is
    allocated, once, at its final size, and the text is decoded straight into
    it. A zero-row envelope must still agree with `num_layers` and `topk` when
    they are given.

    Args:
        envelope: The `{"data", "shape", "dtype"}` mapping as parsed from JSON.
            Dims may be Python or NumPy integers; `bool` and `float` are refused.
        name: What to call the value in error messages (e.g. a field or sample).
        max_bytes: Largest decoded payload accepted, in bytes.
        num_layers: Layers per row the model has, when known.
        topk: Experts per token the model has, when known.
        num_experts: Routed experts per layer, when known: every id must be
            below it. Negative ids are refused in any case.

    Returns:
        A new, writable, C-contiguous array `[rows, layers, topk]` of the
        envelope's canonical dtype.

    Raises:
        WireFormatError: `envelope` is not such a mapping (list-form routes
            included), a key is missing, a field has the wrong type or value,
            the payload is over `max_bytes`, the base64 is invalid or its byte
            count is not `prod(shape) * itemsize`, the row shape disagrees with
            `num_layers`/`topk`, or an id is out of range.

    Examples:
        >>> decode_routes({"data": "AwEABw==", "shape": [2, 1, 2], "dtype": "uint8"}).tolist()
        [[[3, 1]], [[0, 7]]]
    """
    _check_cap(max_bytes, name)
    _check_num_experts(num_experts, name)
    if not isinstance(envelope, Mapping):
        if isinstance(envelope, (list, tuple)):
            raise WireFormatError(
                f"{name}: list-form routes are not accepted; expected the envelope "
                '{"data": <base64>, "shape": [rows, layers, topk], "dtype": <str>}'
            )
        raise WireFormatError(
            f"{name}: expected an envelope mapping with keys data/shape/dtype, got {type(envelope).__name__}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in envelope]
    if missing:
        raise WireFormatError(
            f"{name}: envelope is missing required key(s) {missing}; expected keys {list(_REQUIRED_KEYS)}"
        )
    dtype = _check_dtype(envelope["dtype"], name)
    shape = _check_shape(envelope["shape"], f"{name}.shape")
    _check_row_shape(shape, num_layers, topk, name)
    data = envelope["data"]
    if isinstance(data, (list, tuple)):
        raise WireFormatError(f"{name}.data: list-form routes are not accepted; expected a base64 string")
    nbytes = math.prod(shape) * dtype.itemsize
    described = f"shape {list(shape)} dtype {dtype.name}"
    if nbytes == 0:
        # Zero rows hold no data, but NumPy still refuses a shape whose other
        # dims overflow; a row larger than the cap cannot be valid anyway.
        check_size(shape[1] * shape[2] * dtype.itemsize, max_bytes, name, "a row of shape", list(shape[1:]), dtype.name)
    check_size(nbytes, max_bytes, name, described)
    _check_b64_length(data, nbytes, f"{name}.data", described)
    fast = _base64.decode_compact(data, shape=shape, wire=dtype.newbyteorder("<"), keep=True, num_experts=num_experts)
    if fast is not None:
        return fast
    # The reference path: it decodes what the kernel refused, and names the problem.
    out = np.empty(shape, dtype=dtype.newbyteorder("<"))
    _b64decode_into(data, out, f"{name}.data")
    return _checked_ids(_to_native(out), num_experts, name)


def decode_sglang_routes(
    value: Any,
    *,
    num_layers: int,
    topk: int,
    dtype: str | None = None,
    num_tokens: int | None = None,
    num_experts: int | None = None,
    max_bytes: int = DEFAULT_MAX_ROUTE_BYTES,
    name: str = "routed_experts",
) -> np.ndarray:
    """Decode SGLang's `routed_experts` and compact it to a canonical route array.

    SGLang (`--enable-return-routed-experts`, request field
    `"return_routed_experts": true`) returns the routes of its `/generate`
    call in `meta_info["routed_experts"]`: base64 of the raw bytes of a
    C-order little-endian array of logical shape
    `[tokens, num_hidden_layers, num_experts_per_tok]`, `int32` unless
    `meta_info["routed_experts_dtype"]` advertises `uint8` or `uint16`. The
    layer and top-k counts are not in the payload, so the caller gives them.

    Args:
        value: The base64 string (or bytes), or a mapping holding it: SGLang's
            `meta_info`, or a whole `/generate` response with `meta_info`.
        num_layers: Layers per row (the model's `num_hidden_layers`).
        topk: Experts per token (the model's `num_experts_per_tok`).
        dtype: The advertised element dtype (`"int32"`, `"uint16"`, `"uint8"`);
            when `None`, read from `routed_experts_dtype` in the mapping, else
            `int32`.
        num_tokens: When given, the exact row count expected.
        num_experts: Routed experts per layer, when known: every id must be below it.
        max_bytes: Largest decoded payload accepted, in bytes.
        name: What to call the value in error messages.

    Returns:
        A new array `[tokens, num_layers, topk]` of the narrowest canonical
        dtype (wider advertised dtypes are narrowed by value, never wrapped).

    Raises:
        TypeError: a count is not an `int`.
        ValueError: a count is not positive.
        WireFormatError: the payload is missing or not base64 text, the dtype
            is not one SGLang sends, the payload is over `max_bytes`, the byte
            count is not a whole number of rows (or not `num_tokens` rows), or
            an id is out of range.

    Examples:
        >>> import base64, numpy as np
        >>> raw = base64.b64encode(np.arange(8, dtype="<i4").tobytes()).decode()
        >>> decode_sglang_routes({"meta_info": {"routed_experts": raw}}, num_layers=2, topk=2).shape
        (2, 2, 2)
    """
    if not _plain_counts(max_bytes, num_experts, num_layers, topk):
        _check_model_counts(num_layers, topk, name)
        _check_cap(max_bytes, name)
        _check_num_experts(num_experts, name)
    if num_tokens is not None:
        _check_int_arg(num_tokens, "num_tokens", name, minimum=0)
    data = meta_info(value, name)
    if type(data) is dict or isinstance(data, Mapping):
        if "routed_experts" not in data:
            raise WireFormatError(
                f"{name}: no 'routed_experts' key in meta_info (was the request sent with return_routed_experts=True?)"
            )
        advertised = data.get("routed_experts_dtype")
        if dtype is None:
            dtype = advertised
        elif advertised is not None and advertised != dtype:
            raise WireFormatError(
                f"{name}: meta_info advertises routed_experts_dtype {advertised!r}, but dtype={dtype!r} was given"
            )
        data = data["routed_experts"]
    if dtype is None:
        dtype = "int32"
    wire_dtype = _SGLANG_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if wire_dtype is None:
        raise WireFormatError(f"{name}: routed_experts_dtype must be one of {sorted(_SGLANG_DTYPES)}, got {dtype!r}")
    if isinstance(data, (list, tuple)):
        raise WireFormatError(f"{name}: list-form routes are not accepted; expected SGLang's base64 string")
    row_bytes = int(num_layers) * int(topk) * wire_dtype.itemsize
    nbytes = base64_decoded_length(data, name=name)
    check_size(nbytes, max_bytes, name, dtype, "routes")
    rows = whole_rows(nbytes, row_bytes, {"num_layers": num_layers, "topk": topk}, num_tokens, name, dtype)
    shape = (rows, int(num_layers), int(topk))
    fast = _base64.decode_compact(data, shape=shape, wire=wire_dtype, num_experts=num_experts)
    if fast is not None:
        return fast
    # The reference path: it decodes what the kernel refused, and names the problem.
    wide = np.empty(shape, dtype=wire_dtype)
    _b64decode_into(data, wide, name)
    # Narrowing int32 / uint16 is the one value scan the contract allows, done
    # here on the receiving edge because the sender did not.
    return _canonical(_to_native(wide), num_experts, name)


def decode_vllm_routes(
    value: Any,
    *,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
    max_bytes: int = DEFAULT_MAX_ROUTE_BYTES,
    name: str = "routed_experts",
) -> np.ndarray:
    """Decode vLLM's `routed_experts`: base64 of a `.npy` file, read without pickle.

    vLLM (`--enable-return-routed-experts`) puts the routes of each choice of
    `/inference/v1/generate` in `choices[i].routed_experts` as the base64 text
    of a `.npy` file holding `[tokens, num_hidden_layers, num_experts_per_tok]`
    of `uint8` (up to 256 experts) or `uint16`, in every release since 0.22 (any
    integer dtype, `int32` included, is accepted). The
    file is parsed by `decode_npy`; `uint16` ids are widened to `int16` or
    `int32` by value, never wrapped.

    Args:
        value: The base64 text (`str` or bytes).
        num_layers: Layers per row the model has, when known. With `topk`, a
            flat 1-D array is reshaped to `[tokens, num_layers, topk]`.
        topk: Experts per token the model has, when known.
        num_experts: Routed experts per layer, when known: every id must be below it.
        max_bytes: Largest array data accepted, in bytes.
        name: What to call the value in error messages.

    Returns:
        A new array `[tokens, layers, topk]` of the narrowest canonical dtype.

    Raises:
        TypeError: a count is not an `int`.
        ValueError: a count is not positive.
        WireFormatError: `value` is `null` or not base64 text, the file is not
            a valid `.npy` of integers, its data is over `max_bytes`, its shape
            is not `[tokens, layers, topk]` (or disagrees with `num_layers` /
            `topk`), or an id is out of range.

    Examples:
        >>> import base64, io, numpy as np
        >>> buf = io.BytesIO()
        >>> np.save(buf, np.array([[[3, 1]], [[0, 7]]], np.uint16), allow_pickle=False)
        >>> decode_vllm_routes(base64.b64encode(buf.getvalue()).decode()).dtype
        dtype('uint8')
    """
    if (num_layers is None) != (topk is None):
        raise ValueError(f"{name}: give both num_layers and topk, or neither")
    if not _plain_counts(max_bytes, num_experts, *((1, 1) if num_layers is None else (num_layers, topk))):
        if num_layers is not None:
            _check_model_counts(num_layers, topk, name)
        _check_cap(max_bytes, name)
        _check_num_experts(num_experts, name)
    if value is None:
        raise WireFormatError(
            f"{name}: is null (server started without --enable-return-routed-experts, or the request was aborted)"
        )
    nbytes = base64_decoded_length(value, name=name)
    check_size(nbytes, max_bytes + 10 + MAX_HEADER, name, "a .npy file")
    fast = _decode_npy_routes(value, nbytes, num_layers, topk, num_experts, max_bytes, name)
    if fast is not None:
        return fast
    # The reference path: it decodes what the kernel refused, and names the problem.
    raw = np.empty(nbytes, dtype=np.uint8)
    _b64decode_into(value, raw, name)
    array = decode_npy(raw, max_bytes=max_bytes, name=name)
    return _canonical(array.reshape(_vllm_shape(array.shape, num_layers, topk, name)), num_experts, name)


def _decode_npy_routes(
    value: Any,
    nbytes: int,
    num_layers: int | None,
    topk: int | None,
    num_experts: int | None,
    max_bytes: int,
    name: str,
) -> np.ndarray | None:
    """The fast path of `decode_vllm_routes`: the header from the first quanta, the data by the kernel."""
    if not isinstance(value, str):
        value = memoryview(value).cast("B")  # lengths and slices in bytes, whatever view was given
    head_chars = min(len(value), -(-(12 + MAX_HEADER) // 3) * 4)
    head = _base64.decode_bytes(value[:head_chars])
    if head is None or len(head) != (head_chars // 4 * 3 if head_chars < len(value) else nbytes):
        return None  # not base64, or padding inside the text
    dtype, fortran, shape, offset = npy_layout(head, nbytes, max_bytes, name)
    if fortran and sum(d > 1 for d in shape) > 1:
        return None  # a Fortran-order array: the reference path transposes it
    rows = _vllm_shape(shape, num_layers, topk, name)
    whole = head if head_chars == len(value) else None  # the head is the whole file: not decoded twice
    return _base64.decode_compact(value, shape=rows, wire=dtype, start=offset, num_experts=num_experts, raw=whole)


def _vllm_shape(shape: tuple[int, ...], num_layers: int | None, topk: int | None, name: str) -> tuple[int, int, int]:
    """The `[tokens, layers, topk]` shape of a `.npy` array of `shape`, checked."""
    if len(shape) == 3 and shape[1] == num_layers and shape[2] == topk:
        return (shape[0], shape[1], shape[2])  # the rows the model has (counts the caller's checks passed): no more
    if len(shape) == 1 and num_layers is not None and topk is not None:
        row = int(num_layers) * int(topk)
        if shape[0] % row:
            raise WireFormatError(f"{name}: {shape[0]} flat ids are not a whole number of [{num_layers}, {topk}] rows")
        shape = (shape[0] // row, int(num_layers), int(topk))
    if len(shape) != 3:
        raise WireFormatError(f"{name}: expected a .npy array [tokens, layers, topk], got shape {shape}")
    _check_row_shape(shape, num_layers, topk, name)
    if 0 in shape[1:]:
        raise WireFormatError(f"{name}: layers and topk must be > 0, got shape {shape}")
    return (shape[0], shape[1], shape[2])


def base64_decoded_length(text: Any, *, name: str = "data") -> int:
    """The byte count padded base64 text decodes to, from its length alone.

    Nothing is decoded and nothing is allocated, so a receiver can compare the
    result with a declared size and a cap first. The characters themselves are
    checked later, by the decode.

    Args:
        text: Base64 text as `str` (ASCII) or bytes.
        name: What to call the value in error messages.

    Returns:
        The decoded byte count.

    Raises:
        WireFormatError: `text` is not a string or bytes, is not ASCII, or its
            length is not a multiple of 4.

    Examples:
        >>> base64_decoded_length("AwEABw=="), base64_decoded_length(b"AAAA")
        (4, 3)
    """
    if isinstance(text, str):
        if not text.isascii():
            raise WireFormatError(f"{name}: invalid base64 (non-ASCII characters)")
        pad = text[-2:].count("=")
    elif isinstance(text, (bytes, bytearray, memoryview)):
        text = memoryview(text).cast("B")
        pad = bytes(text[-2:]).count(b"=")
    else:
        raise WireFormatError(f"{name}: expected a base64 string, got {type(text).__name__}")
    if len(text) % 4:
        raise WireFormatError(f"{name}: invalid base64 (length {len(text)} is not a multiple of 4)")
    return len(text) // 4 * 3 - pad


def _plain_counts(max_bytes: Any, num_experts: Any, num_layers: Any, topk: Any) -> bool:
    """Whether the caller's counts are the plain ints every client call passes (then the checks below pass)."""
    return (
        type(max_bytes) is int
        and type(num_layers) is int
        and type(topk) is int
        and max_bytes >= 0
        and num_layers >= 1
        and topk >= 1
        and (num_experts is None or (type(num_experts) is int and num_experts >= 1))
    )


def _check_cap(max_bytes: Any, name: str) -> None:
    _check_int_arg(max_bytes, "max_bytes", name, minimum=0)


def _check_int_arg(value: Any, what: str, name: str, *, minimum: int) -> None:
    # Caller arguments, not wire data: the plain TypeError/ValueError. A plain int in range
    # (every call the client makes) is let through before the message is even formatted.
    if type(value) is not int or value < minimum:
        check_at_least(value, f"{name}: {what}", minimum)


def _check_model_counts(num_layers: Any, topk: Any, name: str) -> None:
    _check_int_arg(num_layers, "num_layers", name, minimum=1)
    _check_int_arg(topk, "topk", name, minimum=1)


def _check_dtype(value: Any, name: str) -> np.dtype:
    dtype = _DTYPES_BY_NAME.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise WireFormatError(
            f"{name}.dtype: expected one of the canonical dtypes {sorted(_DTYPES_BY_NAME)}, got {value!r}"
        )
    return dtype


def _check_shape(value: Any, what: str) -> tuple[int, int, int]:
    if not isinstance(value, (list, tuple)):
        raise WireFormatError(f"{what}: expected a list [rows, layers, topk], got {type(value).__name__}")
    if len(value) != 3:
        raise WireFormatError(f"{what}: expected 3 dims [rows, layers, topk], got {len(value)}")
    dims = []
    for i, dim in enumerate(value):
        # bool is an int subclass; a float dim (even 2.0) means a broken sender.
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
            raise WireFormatError(f"{what}[{i}]: expected an int, got {type(dim).__name__} {dim!r:.40}")
        if dim < 0:
            raise WireFormatError(f"{what}[{i}]: expected a non-negative int, got {dim}")
        dims.append(int(dim))
    if dims[1] == 0 or dims[2] == 0:
        raise WireFormatError(f"{what}: layers and topk must be > 0, got {dims}")
    return (dims[0], dims[1], dims[2])


def _check_row_shape(shape: tuple[int, ...], num_layers: Any, topk: Any, name: str) -> None:
    """Rows must be `[num_layers, topk]` when the caller knows them, zero rows included."""
    for field, known, got in (("num_layers", num_layers, shape[1]), ("topk", topk, shape[2])):
        if known is not None:
            _check_int_arg(known, field, name, minimum=1)
            if got != known:
                raise WireFormatError(
                    f"{name}: rows of [{shape[1]}, {shape[2]}] (layers, topk), but the model has {field}={known}"
                )


def _check_b64_length(data: Any, nbytes: int, what: str, described: str) -> None:
    got = base64_decoded_length(data, name=what)
    if got != nbytes:
        raise WireFormatError(f"{what}: base64 decodes to {got} bytes, but {described} needs {nbytes}")


def _b64decode_into(data: Any, out: np.ndarray, what: str) -> None:
    """Decode base64 `data` into `out`'s buffer, whose size the caller has checked."""
    target = out.reshape(-1).view(np.uint8).data
    pos = 0
    try:
        for start in range(0, len(data), _CHUNK_CHARS):
            # binascii has no decode-into; each transient chunk is bounded, and
            # the result buffer was allocated once at its final size.
            chunk = data[start : start + _CHUNK_CHARS]
            if _STRICT:
                # strict_mode is Python 3.11+ (`_STRICT`); mypy checks against 3.10's signature
                raw = binascii.a2b_base64(chunk, strict_mode=True)  # type: ignore[call-arg]
            else:  # pragma: no cover - Python 3.10
                raw = base64.b64decode(chunk, validate=True)
            if pos + len(raw) > out.nbytes:
                raise ValueError("more bytes than its length promises")
            target[pos : pos + len(raw)] = raw
            pos += len(raw)
    except (binascii.Error, ValueError) as exc:
        raise WireFormatError(f"{what}: invalid base64 ({exc})") from None
    if pos != out.nbytes:  # padding inside the text, e.g. "AA==AAAA"
        raise WireFormatError(f"{what}: invalid base64 (decoded {pos} bytes, expected {out.nbytes})")


def _check_num_experts(num_experts: Any, name: str) -> None:
    if num_experts is not None:
        _check_int_arg(num_experts, "num_experts", name, minimum=1)


def _canonical(array: np.ndarray, num_experts: int | None, name: str) -> np.ndarray:
    """Compact a decoded server array to the narrowest canonical dtype, range-checked."""
    try:
        # The servers do not compact, so the receiver does: compact_routes'
        # one min/max scan also refuses negative ids, ids >= 2**31 and ids
        # >= num_experts, and writes a fresh array that owns its buffer.
        return compact_routes(array, name=name, num_experts=num_experts, health=None)  # the client checks
    except ValueError as exc:
        raise WireFormatError(str(exc)) from None


def _checked_ids(routes: np.ndarray, num_experts: int | None, name: str) -> np.ndarray:
    # num_experts was checked on entry, so a ValueError here is about the data.
    try:
        return check_expert_ids(routes, num_experts, name=name)
    except ValueError as exc:
        raise WireFormatError(str(exc)) from None


def _to_native(array: np.ndarray) -> np.ndarray:
    if array.dtype.isnative:
        return array.view(array.dtype.newbyteorder("="))
    return array.byteswap(inplace=True).view(array.dtype.newbyteorder("="))  # pragma: no cover - big-endian hosts
