"""The wire codec: round trips, and every malformed envelope is refused by name."""

from __future__ import annotations

import base64
import io
import tracemalloc

import numpy as np
import pytest
import torch

from torch_r3 import check_expert_ids
from torch_r3.rollout.codec import (
    WireFormatError,
    base64_decoded_length,
    decode_npy,
    decode_routes,
    decode_sglang_routes,
    decode_vllm_routes,
    encode_routes,
)
from torch_r3.routes import canonical_dtype_for


def _envelope(array: np.ndarray) -> dict:
    # Independent reference encoder: plain numpy bytes + stdlib base64.
    return {
        "data": base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode(),
        "shape": list(array.shape),
        "dtype": array.dtype.name,
    }


@pytest.mark.parametrize(("high", "dtype"), [(2**8, np.uint8), (2**15, np.int16), (2**31 - 1, np.int32)])
def test_round_trip_compacts_to_the_narrowest_dtype(high, dtype):
    rng = np.random.default_rng(0)
    routes = rng.integers(0, high, size=(7, 3, 2), dtype=np.int64)
    routes[0, 0, 0] = high - 1
    envelope = encode_routes(routes)
    assert envelope["dtype"] == np.dtype(dtype).name
    assert envelope == _envelope(routes.astype(dtype))
    decoded = decode_routes(envelope)
    assert decoded.dtype == dtype and decoded.flags.c_contiguous and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, routes)


def test_encode_accepts_a_torch_tensor():
    routes = torch.tensor([[[5, 1]], [[2, 300]]], dtype=torch.int64)
    assert encode_routes(routes) == _envelope(np.array([[[5, 1]], [[2, 300]]], dtype=np.int16))


def test_zero_rows_round_trip():
    decoded = decode_routes(encode_routes(np.zeros((0, 4, 2), dtype=np.int32)))
    assert decoded.shape == (0, 4, 2) and decoded.dtype == np.uint8


def test_decoded_array_owns_a_writable_buffer_of_exactly_the_payload():
    envelope = _envelope(np.arange(24, dtype=np.uint8).reshape(4, 3, 2))
    decoded = decode_routes(envelope)
    decoded[0, 0, 0] = 99  # writable, and not a view of anything the caller holds
    assert decoded.base is None or decoded.base.nbytes == decoded.nbytes


def test_large_payload_spanning_several_decode_chunks():
    routes = np.random.default_rng(1).integers(0, 2**15, size=(200_000, 4, 8), dtype=np.int16)  # 12.8 MB
    np.testing.assert_array_equal(decode_routes(_envelope(routes)), routes)


GOOD = _envelope(np.arange(12, dtype=np.uint8).reshape(2, 3, 2))


def _with(**changes):
    env = dict(GOOD)
    env.update(changes)
    return env


@pytest.mark.parametrize(
    ("envelope", "error", "words"),
    [
        (_with(data="AAECAwQF$gcICQoL"), WireFormatError, "invalid base64"),
        (_with(data="AAECAwQFBgcICQoL="), WireFormatError, "invalid base64"),
        (_with(data="AAEC AwQFBgcICQoL"), WireFormatError, "invalid base64"),
        (_with(data="AAECAwQFBgcICQo="), WireFormatError, "11 bytes, but shape [2, 3, 2] dtype uint8 needs 12"),
        (_with(data=base64.b64encode(bytes(13)).decode()), WireFormatError, "13 bytes"),
        (_with(dtype="int16"), WireFormatError, "needs 24"),
        (_with(shape=[2, 3, True]), WireFormatError, "shape[2]: expected an int, got bool"),
        (_with(shape=[2.0, 3, 2]), WireFormatError, "shape[0]: expected an int, got float"),
        (_with(shape=[2, np.bool_(True), 2]), WireFormatError, "shape[1]: expected an int, got bool"),
        (_with(shape=[2, 3, None]), WireFormatError, "shape[2]: expected an int, got NoneType"),
        (_with(shape=[2, 0, 2]), WireFormatError, "layers and topk must be > 0"),
        (_with(shape=[-2, 3, 2]), WireFormatError, "shape[0]: expected a non-negative int"),
        (_with(shape=[2, 6]), WireFormatError, "expected 3 dims"),
        (_with(shape="2,3,2"), WireFormatError, "expected a list"),
        (_with(dtype="int64"), WireFormatError, "canonical dtypes"),
        (_with(dtype="uint16"), WireFormatError, "canonical dtypes"),
        (_with(dtype="bogus"), WireFormatError, "canonical dtypes"),
        (_with(dtype=8), WireFormatError, "dtype: expected one of the canonical dtypes"),
        ({"shape": [2, 3, 2], "dtype": "uint8"}, WireFormatError, "missing required key(s) ['data']"),
        ({"data": GOOD["data"]}, WireFormatError, "missing required key(s) ['shape', 'dtype']"),
        (_with(data=[[[0, 1]]]), WireFormatError, "list-form"),
        ([[[0, 1], [2, 3]]], WireFormatError, "list-form"),
        (_with(data=12), WireFormatError, "expected a base64 string"),
        ("AAEC", WireFormatError, "expected an envelope mapping"),
    ],
)
def test_malformed_envelopes_are_refused_with_the_field_named(envelope, error, words):
    # One exception class for every malformed field (before: a mix of TypeError and ValueError).
    with pytest.raises(error) as info:
        decode_routes(envelope, name="sample 3")
    assert str(info.value).startswith("sample 3")
    assert words in str(info.value)


def test_non_ascii_base64_is_refused():
    with pytest.raises(WireFormatError, match="invalid base64"):
        decode_routes(_with(data="AAECAwQFBgcICQo\u00e9"))


# -- SGLang: meta_info["routed_experts"] is base64 of flat little-endian int32
#    [tokens, num_hidden_layers, num_experts_per_tok] (see the module docstring).


def _sglang(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<i4").tobytes()).decode()


def test_sglang_form_decodes_and_compacts():
    routes = np.random.default_rng(2).integers(0, 128, size=(9, 4, 2))
    meta_info = {"routed_experts": _sglang(routes), "finish_reason": {"type": "length"}}
    for value in (meta_info["routed_experts"], meta_info, {"text": "", "meta_info": meta_info}):
        decoded = decode_sglang_routes(value, num_layers=4, topk=2)
        assert decoded.dtype == np.uint8
        np.testing.assert_array_equal(decoded, routes)
    wide = routes.copy()
    wide[0, 0, 0] = 1000
    assert decode_sglang_routes(_sglang(wide), num_layers=4, topk=2, num_tokens=9).dtype == np.int16


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "words"),
    [
        (_sglang(np.zeros((3, 4, 2))), {"num_layers": 5, "topk": 2}, WireFormatError, "whole number of int32 rows"),
        (
            _sglang(np.zeros((3, 4, 2))),
            {"num_layers": 4, "topk": 2, "num_tokens": 4},
            WireFormatError,
            "expected 4 rows",
        ),
        (_sglang(-np.ones((1, 1, 1))), {"num_layers": 1, "topk": 1}, WireFormatError, ">= 0"),
        (_sglang(np.full((1, 1, 1), 8)), {"num_layers": 1, "topk": 1, "num_experts": 8}, WireFormatError, "found 8"),
        ({"meta_info": {}}, {"num_layers": 1, "topk": 1}, WireFormatError, "return_routed_experts"),
        ({"meta_info": []}, {"num_layers": 1, "topk": 1}, WireFormatError, "meta_info to be a mapping"),
        (
            {"routed_experts": "AAAA", "routed_experts_dtype": "int64"},
            {"num_layers": 1, "topk": 1},
            WireFormatError,
            "routed_experts_dtype",
        ),
        (
            {"routed_experts": "AAAA", "routed_experts_dtype": "uint8"},
            {"num_layers": 1, "topk": 1, "dtype": "int32"},
            WireFormatError,
            "advertises",
        ),
        ([0, 1], {"num_layers": 1, "topk": 2}, WireFormatError, "list-form"),
        (None, {"num_layers": 1, "topk": 2}, WireFormatError, "expected a base64 string"),
        ("AAA", {"num_layers": 1, "topk": 1}, WireFormatError, "invalid base64"),
        ("AA$A", {"num_layers": 1, "topk": 1, "dtype": "uint8"}, WireFormatError, "invalid base64"),
        ("AAAA" * 4, {"num_layers": 1, "topk": 1, "max_bytes": 8}, WireFormatError, "over the cap max_bytes=8"),
        ("AAAA", {"num_layers": True, "topk": 1}, TypeError, "num_layers must be an int"),
        ("AAAA", {"num_layers": 1, "topk": 0}, ValueError, "topk must be >= 1"),
        ("AAAA", {"num_layers": 1, "topk": 1, "num_experts": 0}, ValueError, "num_experts must be >= 1"),
    ],
)
def test_sglang_form_errors_are_wire_format_errors_and_bad_arguments_are_not(value, kwargs, error, words):
    with pytest.raises(error) as info:
        decode_sglang_routes(value, **kwargs)
    assert words in str(info.value)
    # Caller mistakes are plain TypeError/ValueError; only the wire data raises WireFormatError.
    assert isinstance(info.value, WireFormatError) == (error is WireFormatError)


# -- Bounded before allocating, one exception class, numpy dims (issue 10).


def _peak_bytes(fn, *args, **kwargs):
    """Run `fn` under tracemalloc (NumPy reports its buffers there) and return (exception, peak bytes)."""
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
        raised = None
    except Exception as exc:
        raised = exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return raised, peak


def test_an_oversized_declared_shape_is_refused_before_anything_is_allocated():
    # 10**6 x 1000 x 1000 int32 = 3.64 TiB declared for 3 bytes of data.
    raised, peak = _peak_bytes(decode_routes, {"data": "AAAA", "shape": [10**6, 1000, 1000], "dtype": "int32"})
    assert isinstance(raised, WireFormatError) and "over the cap" in str(raised)
    assert peak < 1 << 20


def test_a_declared_size_under_the_cap_but_above_the_data_is_refused_before_allocating():
    raised, peak = _peak_bytes(
        decode_routes, {"data": "AAAA", "shape": [1000, 1000, 100], "dtype": "uint8"}, max_bytes=1 << 30
    )
    assert isinstance(raised, WireFormatError) and "base64 decodes to 3 bytes" in str(raised)
    assert peak < 1 << 20


def test_the_cap_is_the_callers_choice():
    envelope = encode_routes(np.ones((4, 2, 2), np.uint8))  # 16 bytes
    assert decode_routes(envelope, max_bytes=16).shape == (4, 2, 2)
    with pytest.raises(WireFormatError, match="16 bytes, over the cap max_bytes=15"):
        decode_routes(envelope, max_bytes=15)


def test_numpy_integer_dims_are_accepted():
    routes = np.arange(6, dtype=np.uint8).reshape(1, 3, 2)
    envelope = _envelope(routes)
    envelope["shape"] = [np.int64(1), np.int32(3), np.uint8(2)]
    np.testing.assert_array_equal(decode_routes(envelope), routes)


def test_every_decoder_error_is_a_value_error_too():
    assert issubclass(WireFormatError, ValueError)


@pytest.mark.parametrize("claimed", [[0, 1000, 1000], [0, 2, 3], [0, 3, 2]])
def test_a_zero_row_envelope_must_agree_with_the_models_layers_and_topk(claimed):
    envelope = {"data": "", "shape": claimed, "dtype": "int32"}
    with pytest.raises(WireFormatError, match="but the model has"):
        decode_routes(envelope, num_layers=2, topk=2)
    assert decode_routes({"data": "", "shape": [0, 2, 2], "dtype": "int32"}, num_layers=2, topk=2).shape == (0, 2, 2)


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_negative_ids_in_signed_envelopes_are_refused_with_their_position(dtype):
    routes = np.zeros((3, 2, 2), dtype=dtype)
    routes[2, 1, 0] = -5
    with pytest.raises(WireFormatError, match=r"found -5 at index \(2, 1, 0\)"):
        decode_routes(_envelope(routes))


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_ids_at_or_above_num_experts_are_refused_when_it_is_known(dtype):
    routes = np.zeros((2, 1, 2), dtype=dtype)
    routes[1, 0, 1] = 64
    assert decode_routes(_envelope(routes), num_experts=65).max() == 64
    with pytest.raises(WireFormatError, match=r"found 64 at index \(1, 0, 1\) \(num_experts=64\)"):
        decode_routes(_envelope(routes), num_experts=64)


def test_check_expert_ids_agrees_with_a_plain_loop():
    rng = np.random.default_rng(3)
    for dtype in (np.uint8, np.int16, np.int32):
        for _ in range(20):
            routes = rng.integers(-3 if dtype != np.uint8 else 0, 20, size=(4, 2, 2)).astype(dtype)
            num_experts = int(rng.integers(1, 25))
            ok = all(0 <= v < num_experts for v in routes.reshape(-1).tolist())
            if ok:
                assert check_expert_ids(routes, num_experts) is routes
            else:
                with pytest.raises(ValueError, match="expert ids must be in"):
                    check_expert_ids(routes, num_experts)


class _DeviceArray:
    """A tensor-like from another framework: only .detach().cpu().numpy()."""

    def __init__(self, array):
        self._array = array

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self._array


def test_encode_routes_accepts_duck_typed_device_arrays():
    routes = np.array([[[5, 1]], [[2, 300]]], dtype=np.int64)
    assert encode_routes(_DeviceArray(routes)) == _envelope(routes.astype(np.int16))


def test_a_duck_typed_array_whose_numpy_is_not_an_array_is_refused():
    with pytest.raises(TypeError, match="returned list, not a NumPy array"):
        encode_routes(_DeviceArray([[[1]]]))


@pytest.mark.parametrize("n", range(13))
def test_base64_decoded_length_matches_the_stdlib_decode(n):
    text = base64.b64encode(bytes(range(n))).decode()
    assert base64_decoded_length(text) == len(base64.b64decode(text)) == n
    assert base64_decoded_length(text.encode()) == n


@pytest.mark.parametrize(
    ("text", "words"), [("AAA", "multiple of 4"), ("AAA\u00e9", "non-ASCII"), (12, "expected a base64 string")]
)
def test_base64_decoded_length_refuses_what_cannot_be_base64(text, words):
    with pytest.raises(WireFormatError, match=words):
        base64_decoded_length(text, name="meta_info.routed_experts")


# -- SGLang: the advertised narrower dtype.


@pytest.mark.parametrize(("wire", "high"), [("uint8", 256), ("uint16", 2**16), ("int32", 2**31 - 1)])
def test_sglang_advertised_dtype_is_decoded_and_widened_never_wrapped(wire, high):
    rng = np.random.default_rng(4)
    routes = rng.integers(0, high, size=(5, 3, 2), dtype=np.int64)
    routes[0, 0, 0] = high - 1
    raw = base64.b64encode(routes.astype(np.dtype(wire).newbyteorder("<")).tobytes()).decode()
    decoded = decode_sglang_routes({"routed_experts": raw, "routed_experts_dtype": wire}, num_layers=3, topk=2)
    assert decoded.dtype == canonical_dtype_for(high - 1)
    np.testing.assert_array_equal(decoded, routes)  # value-equal: nothing wrapped
    np.testing.assert_array_equal(decode_sglang_routes(raw, num_layers=3, topk=2, dtype=wire), routes)


# -- vLLM: base64 of a .npy file.


def _npy(array: np.ndarray, **kwargs) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False, **kwargs)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("dtype", ["<u2", "|u1", "<i4", "<i8", ">u2", "|i1"])
def test_vllm_npy_decodes_like_numpy_load_to_the_narrowest_canonical_dtype(dtype):
    rng = np.random.default_rng(5)
    high = min(np.iinfo(np.dtype(dtype)).max, 40_000)
    routes = rng.integers(0, high, size=(6, 4, 2)).astype(dtype)
    text = _npy(routes)
    reference = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
    decoded = decode_vllm_routes(text, num_layers=4, topk=2)
    assert decoded.dtype == canonical_dtype_for(int(reference.max()))
    assert decoded.flags.c_contiguous and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, reference)


def test_vllm_uint16_ids_above_int16_are_widened_to_int32_not_wrapped():
    routes = np.array([[[65535, 0]], [[40000, 1]]], dtype=np.uint16)
    decoded = decode_vllm_routes(_npy(routes))
    assert decoded.dtype == np.int32 and decoded[:, 0, 0].tolist() == [65535, 40000]


def test_vllm_fortran_order_and_flat_payloads_decode_to_the_same_rows():
    routes = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    np.testing.assert_array_equal(decode_vllm_routes(_npy(np.asfortranarray(routes))), routes)
    np.testing.assert_array_equal(decode_vllm_routes(_npy(routes.reshape(-1)), num_layers=3, topk=2), routes)


def _npy_raw(header: str, data: bytes = b"", version: int = 1) -> str:
    head = header.encode("latin1")
    size = len(head).to_bytes(2 if version == 1 else 4, "little")
    return base64.b64encode(b"\x93NUMPY" + bytes([version, 0]) + size + head + data).decode()


@pytest.mark.parametrize(
    ("text", "kwargs", "words"),
    [
        (None, {}, "is null"),
        (_npy(np.zeros((2, 3, 2), np.uint8)), {"num_layers": 3, "topk": 3}, "but the model has topk=3"),
        (_npy(np.zeros((0, 9, 9), np.uint8)), {"num_layers": 3, "topk": 2}, "but the model has num_layers=3"),
        (_npy(np.zeros((2, 6), np.uint8)), {}, "expected a .npy array [tokens, layers, topk]"),
        (_npy(np.zeros(7, np.uint8)), {"num_layers": 3, "topk": 2}, "not a whole number"),
        (_npy(np.zeros((2, 0, 2), np.uint8)), {}, "layers and topk must be > 0"),
        (_npy(np.zeros((2, 1, 1), np.float32)), {}, "integer dtype"),
        (_npy(np.zeros((2, 1, 1), bool)), {}, "integer dtype"),
        (_npy(-np.ones((2, 1, 1), np.int16)), {}, ">= 0"),
        (_npy(np.full((2, 1, 1), 300, np.uint16)), {"num_experts": 256}, "found 300"),
        (_npy_raw("{'descr': '|O', 'fortran_order': False, 'shape': (1, 1, 1), }"), {}, "integer dtype"),
        (_npy_raw("{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (1,), }"), {}, "integer dtype"),
        (
            _npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 1), }", b"\x00"),
            {},
            "declares 2 data bytes",
        ),
        (_npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 1), }", b"\x00" * 3), {}, "but 3 follow"),
        (_npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1000000, 1000, 1000), }"), {}, "over the cap"),
        (
            _npy_raw("{'descr': '<u2', 'fortran_order': 0, 'shape': (1, 1, 1), }", b"\x00\x00"),
            {},
            "fortran_order must be a bool",
        ),
        (
            _npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1, True, 1), }", b"\x00\x00"),
            {},
            "shape must be a tuple",
        ),
        (
            _npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1, -1, 1), }", b"\x00\x00"),
            {},
            "shape must be a tuple",
        ),
        (_npy_raw("{'descr': '<u2', 'shape': (1, 1, 1)}", b"\x00\x00"), {}, "exactly descr"),
        (_npy_raw("__import__('os').system('true')"), {}, "not a Python literal"),
        (_npy_raw("(" * 300 + ")" * 300), {}, "not a Python literal"),
        (
            _npy_raw("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 1), }", b"\x00\x00", version=9),
            {},
            "format version 9",
        ),
        (_npy_raw("{'descr'"), {}, "not a Python literal"),
        (base64.b64encode(b"\x93NUMPY\x01\x00\xff\xff{").decode(), {}, "too long or truncated"),
        (base64.b64encode(b"PK\x03\x04 a zip, not npy").decode(), {}, "missing the \\x93NUMPY magic"),
        ("not base64!", {}, "invalid base64"),
    ],
)
def test_malformed_vllm_payloads_are_wire_format_errors(text, kwargs, words):
    with pytest.raises(WireFormatError) as info:
        decode_vllm_routes(text, name="choices[0].routed_experts", **kwargs)
    assert str(info.value).startswith("choices[0].routed_experts") and words in str(info.value)


def test_an_oversized_npy_declaration_is_refused_before_allocating():
    text = _npy_raw("{'descr': '<i4', 'fortran_order': False, 'shape': (1000000, 1000, 1000), }")
    raised, peak = _peak_bytes(decode_vllm_routes, text)
    assert isinstance(raised, WireFormatError) and "over the cap" in str(raised)
    assert peak < 1 << 20


def test_decode_npy_is_a_read_only_view_that_matches_numpy_load():
    rng = np.random.default_rng(6)
    for version in ((1, 0), (2, 0), (3, 0)):
        buf = io.BytesIO()
        array = rng.integers(0, 1000, size=(3, 5)).astype("<i2")
        np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
        decoded = decode_npy(buf.getvalue())
        np.testing.assert_array_equal(decoded, np.load(io.BytesIO(buf.getvalue()), allow_pickle=False))
        assert decoded.dtype == array.dtype and not decoded.flags.writeable


def test_codec_docstring_examples_run():
    import doctest

    import torch_r3.rollout.codec

    result = doctest.testmod(torch_r3.rollout.codec, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 6


# -- item 16: overflowing zero-row shapes and over-deep .npy headers are wire errors --------


def _npy_with_header(shape_text: str, data: bytes = b"") -> bytes:
    header = ("{'descr': '|u1', 'fortran_order': False, 'shape': " + shape_text + ", }").encode() + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ([0, 2**62, 2**62], "uint8"),
        ([0, 2**40, 2**40], "int32"),
        ([0, 2**64, 1], "uint8"),
        ([0, 2**31, 2**31], "int16"),
    ],
)
def test_a_zero_row_envelope_with_overflowing_dims_is_a_wire_format_error(shape, dtype):
    with pytest.raises(WireFormatError, match=r"routed_experts: a row of shape"):
        decode_routes({"data": "", "shape": shape, "dtype": dtype})


def test_a_zero_row_envelope_with_a_row_over_the_cap_is_refused_but_one_under_it_decodes():
    with pytest.raises(WireFormatError, match="over the cap max_bytes=100"):
        decode_routes({"data": "", "shape": [0, 10, 11], "dtype": "uint8"}, max_bytes=100)
    assert decode_routes({"data": "", "shape": [0, 10, 10], "dtype": "uint8"}, max_bytes=100).shape == (0, 10, 10)


@pytest.mark.parametrize("dims", [65, 200])
def test_a_npy_header_of_more_than_64_dims_is_a_wire_format_error(dims):
    raw = _npy_with_header("(" + "1," * dims + ")", b"\x00")
    with pytest.raises(WireFormatError, match=f"{dims} dims"):
        decode_npy(raw)
    with pytest.raises(WireFormatError):
        decode_vllm_routes(base64.b64encode(raw).decode())


@pytest.mark.parametrize("shape_text", [f"(0, {2**62}, {2**62})", f"({2**64}, 0)", f"(0, {2**63})"])
def test_a_zero_size_npy_with_overflowing_dims_is_a_wire_format_error(shape_text):
    with pytest.raises(WireFormatError, match="npy"):
        decode_npy(_npy_with_header(shape_text))
