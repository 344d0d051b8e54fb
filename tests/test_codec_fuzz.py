"""Fuzzing the wire decoders: whatever arrives, the only failure is `WireFormatError`,
and no decoder allocates by what a payload declares, only by what it carries, up to the cap."""

from __future__ import annotations

import base64
import io
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from torch_r3.rollout.codec import (
    WireFormatError,
    base64_decoded_length,
    decode_npy,
    decode_routes,
    decode_sglang_routes,
    decode_vllm_routes,
)
from torch_r3.routes import CANONICAL_DTYPES

CAP = 1 << 16
# What a decoder may hold at once: the payload (<= CAP), the canonical result
# (<= 2 * CAP: uint16 ids >= 2**15 widen to int32) and bookkeeping (exception
# messages, the parsed .npy header, one base64 chunk of these small inputs).
PEAK_LIMIT = 3 * CAP + (1 << 20)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
dims = st.one_of(
    st.integers(min_value=0, max_value=8),
    st.integers(min_value=-5, max_value=10**15),
    st.sampled_from([np.int64(3), np.uint8(2), np.int32(-1), 2.0, True, None, "3"]),
)
base64_text = st.one_of(
    st.binary(max_size=256).map(lambda b: base64.b64encode(b).decode()),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=64),
    st.text(max_size=32),
    st.binary(max_size=64),
)

route_arrays = st.builds(
    lambda rows, layers, topk, dtype, low, high, seed: (
        np.random.default_rng(seed).integers(low, high, size=(rows, layers, topk)).astype(dtype)
    ),
    rows=st.integers(0, 6),
    layers=st.sampled_from([1, 2, 2, 3, 0]),
    topk=st.sampled_from([1, 2, 2, 0]),
    dtype=st.sampled_from(["u1", "<i2", "<i4", "u1", "<i2", "<i4", "<u2", ">u2", ">i4", "<i8", "i1"]),
    low=st.sampled_from([0, 0, 0, -2]),
    high=st.sampled_from([4, 300, 70_000]),
    seed=st.integers(0, 2**32 - 1),
)


def _mutate(payload: bytes, cut: int, extra: bytes) -> bytes:
    """Nearly valid: truncated by `cut` bytes (when > 0) and/or extended by `extra`."""
    return (payload[: len(payload) - cut] if cut else payload) + extra


def _real_envelope(array: np.ndarray, cut: int, extra: bytes, shape_delta: int) -> dict:
    dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    raw = _mutate(array.astype(dtype).tobytes(), cut, extra)
    shape = list(array.shape)
    shape[0] += shape_delta
    return {"data": base64.b64encode(raw).decode(), "shape": shape, "dtype": array.dtype.name}


def _saved(array: np.ndarray, fortran: bool) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(array) if fortran else array, allow_pickle=False)
    return buf.getvalue()


near_valid_envelopes = st.builds(
    _real_envelope,
    route_arrays,
    cut=st.sampled_from([0, 0, 0, 1, 3]),
    extra=st.sampled_from([b"", b"", b"", b"\x00"]),
    shape_delta=st.sampled_from([0, 0, 0, 1, 10**12]),
)
envelopes = st.one_of(
    near_valid_envelopes,
    st.fixed_dictionaries(
        {
            "data": st.one_of(base64_text, json_values),
            "shape": st.one_of(st.lists(dims, min_size=0, max_size=4), json_values),
            "dtype": st.one_of(st.sampled_from(["uint8", "int16", "int32", "uint16", "int64", "float32"]), json_values),
        }
    ),
    json_values,
)


def _npy_file(descr: str, fortran: object, shape: object, data: bytes, version: int) -> bytes:
    header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode("utf-8")
    size = len(header).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + header + data


npy_files = st.one_of(
    st.builds(
        _mutate,
        st.builds(_saved, route_arrays, fortran=st.booleans()),
        cut=st.sampled_from([0, 0, 0, 1, 2, 40]),
        extra=st.sampled_from([b"", b"", b"\x00", b"\x00\x01"]),
    ),
    st.builds(
        _npy_file,
        descr=st.one_of(
            st.sampled_from(["|u1", "<u2", ">u2", "<i2", "<i4", "<i8", "|b1", "<f4", "|O", "<U3", "<V2"]),
            st.text(max_size=6),
        ),
        fortran=st.sampled_from([False, True, 0, None]),
        shape=st.one_of(
            st.tuples(dims.filter(lambda d: isinstance(d, int))),
            st.lists(st.integers(-2, 10**12), max_size=4).map(tuple),
            json_values,
        ),
        data=st.binary(max_size=512),
        version=st.sampled_from([1, 2, 3]),
    ),
    st.binary(max_size=512),
    st.binary(max_size=64).map(lambda tail: b"\x93NUMPY" + tail),
)


def _decode_within_bounds(decode, *args, **kwargs):
    # Success or refusal is tallied for --hypothesis-show-statistics.
    """Run one decode; it must return a canonical 3-D array or raise WireFormatError, within PEAK_LIMIT."""
    tracemalloc.start()
    try:
        result = decode(*args, **kwargs)
    except WireFormatError:
        result = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"{decode.__name__} peaked at {peak} bytes"
    event("decoded" if result is not None else "refused")
    return result


def _assert_canonical(result):
    if result is not None:
        assert isinstance(result, np.ndarray) and result.dtype in CANONICAL_DTYPES and result.ndim == 3
        assert result.shape[1] > 0 and result.shape[2] > 0
        if result.size and result.dtype.kind == "i":
            assert result.min() >= 0  # the range check ran


@FUZZ
@given(
    envelope=envelopes,
    num_layers=st.sampled_from([None, 1, 3]),
    topk=st.sampled_from([None, 2]),
    num_experts=st.sampled_from([None, 1, 300]),
)
def test_decode_routes_raises_only_wire_format_errors_within_the_cap(envelope, num_layers, topk, num_experts):
    result = _decode_within_bounds(
        decode_routes, envelope, max_bytes=CAP, num_layers=num_layers, topk=topk, num_experts=num_experts
    )
    _assert_canonical(result)
    if result is not None and num_layers is not None:
        assert result.shape[1] == num_layers
    if result is not None and num_experts is not None and result.size:
        assert result.max() < num_experts


@FUZZ
@given(envelope=near_valid_envelopes)
def test_a_nearly_valid_envelope_decodes_to_its_bytes_or_is_refused(envelope):
    result = _decode_within_bounds(decode_routes, envelope, max_bytes=CAP)
    _assert_canonical(result)
    if result is not None:
        # Independent reference: the stdlib's base64 and NumPy's frombuffer.
        raw = np.frombuffer(base64.b64decode(envelope["data"]), dtype=np.dtype(envelope["dtype"]).newbyteorder("<"))
        assert list(result.shape) == envelope["shape"] and result.dtype.name == envelope["dtype"]
        np.testing.assert_array_equal(result.reshape(-1), raw)


@FUZZ
@given(
    value=st.one_of(
        route_arrays.map(lambda a: base64.b64encode(a.astype("<i4").tobytes()).decode()),
        base64_text,
        json_values,
        st.fixed_dictionaries(
            {
                "routed_experts": base64_text,
                "routed_experts_dtype": st.one_of(
                    st.none(), st.sampled_from(["uint8", "uint16", "int32"]), json_values
                ),
            }
        ),
    ),
    num_layers=st.integers(1, 4),
    topk=st.integers(1, 3),
    dtype=st.sampled_from([None, "uint8", "uint16", "int32"]),
)
def test_decode_sglang_routes_raises_only_wire_format_errors_within_the_cap(value, num_layers, topk, dtype):
    result = _decode_within_bounds(
        decode_sglang_routes, value, num_layers=num_layers, topk=topk, dtype=dtype, max_bytes=CAP
    )
    _assert_canonical(result)
    if result is not None:
        assert result.shape[1:] == (num_layers, topk)


@FUZZ
@given(file=npy_files, known=st.sampled_from([None, (2, 2), (1, 1)]), num_experts=st.sampled_from([None, 5, 70000]))
def test_decode_vllm_routes_raises_only_wire_format_errors_within_the_cap(file, known, num_experts):
    layers, topk = known if known else (None, None)
    text = base64.b64encode(file).decode()
    result = _decode_within_bounds(
        decode_vllm_routes, text, num_layers=layers, topk=topk, num_experts=num_experts, max_bytes=CAP
    )
    _assert_canonical(result)
    if result is not None:
        # Independent reference: NumPy's own reader, safe mode, must agree on the values.
        reference = np.load(io.BytesIO(file), allow_pickle=False)
        np.testing.assert_array_equal(result.reshape(-1), reference.reshape(-1))


@FUZZ
@given(file=npy_files)
def test_decode_npy_raises_only_wire_format_errors_within_the_cap(file):
    tracemalloc.start()
    try:
        result = decode_npy(file, max_bytes=CAP)
    except WireFormatError:
        result = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < PEAK_LIMIT
    if result is not None:
        reference = np.load(io.BytesIO(file), allow_pickle=False)
        assert result.dtype == reference.dtype and result.shape == reference.shape
        np.testing.assert_array_equal(result, reference)


@FUZZ
@given(value=st.one_of(base64_text, json_values))
def test_base64_decoded_length_raises_only_wire_format_errors_and_agrees_with_the_stdlib(value):
    try:
        n = base64_decoded_length(value)
    except WireFormatError:
        return
    try:
        decoded = base64.b64decode(value, validate=True)
    except ValueError:
        return  # a length-only check cannot see bad characters; the decoders can
    assert n == len(decoded)


@pytest.mark.parametrize("rows", [10**9, 10**15])
def test_an_honest_payload_over_the_cap_is_refused_by_every_decoder_before_allocating(rows):
    # Declared sizes far past the cap, carried by a few bytes: nothing is allocated by the declaration.
    small = base64.b64encode(bytes(12)).decode()
    header = {"descr": "<u2", "fortran_order": False, "shape": (rows, 4, 2)}
    npy = base64.b64encode(
        b"\x93NUMPY\x01\x00" + len(repr(header)).to_bytes(2, "little") + repr(header).encode()
    ).decode()
    for decode, args, kwargs in [
        (decode_routes, ({"data": small, "shape": [rows, 4, 2], "dtype": "int32"},), {}),
        (decode_vllm_routes, (npy,), {}),
        (decode_npy, (base64.b64decode(npy),), {}),
    ]:
        tracemalloc.start()
        with pytest.raises(WireFormatError, match="over the cap"):
            decode(*args, max_bytes=CAP, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 1 << 20
