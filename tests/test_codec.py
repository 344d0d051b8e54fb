"""The wire codec: round trips, and every malformed envelope is refused by name."""

from __future__ import annotations

import base64
import subprocess
import sys

import numpy as np
import pytest
import torch

from torch_r3.codec import decode_routes, decode_sglang_routes, encode_routes


def _envelope(array: np.ndarray) -> dict:
    # Independent reference encoder: plain numpy bytes + stdlib base64.
    return {"data": base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode(), "shape": list(array.shape), "dtype": array.dtype.name}


@pytest.mark.parametrize(
    ("high", "dtype"), [(2**8, np.uint8), (2**15, np.int16), (2**31 - 1, np.int32)]
)
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
        (_with(data="AAECAwQF$gcICQoL"), ValueError, "invalid base64"),
        (_with(data="AAECAwQFBgcICQoL="), ValueError, "invalid base64"),
        (_with(data="AAEC AwQFBgcICQoL"), ValueError, "invalid base64"),
        (_with(data="AAECAwQFBgcICQo="), ValueError, "11 bytes, but shape [2, 3, 2] dtype uint8 needs 12"),
        (_with(data=base64.b64encode(bytes(13)).decode()), ValueError, "13 bytes"),
        (_with(dtype="int16"), ValueError, "needs 24"),
        (_with(shape=[2, 3, True]), TypeError, "shape[2]: expected an int, got bool"),
        (_with(shape=[2.0, 3, 2]), TypeError, "shape[0]: expected an int, got float"),
        (_with(shape=[-2, 3, 2]), ValueError, "shape[0]: expected a non-negative int"),
        (_with(shape=[2, 6]), ValueError, "expected 3 dims"),
        (_with(shape="2,3,2"), TypeError, "expected a list"),
        (_with(dtype="int64"), ValueError, "canonical dtypes"),
        (_with(dtype="uint16"), ValueError, "canonical dtypes"),
        (_with(dtype="bogus"), ValueError, "canonical dtypes"),
        (_with(dtype=8), TypeError, "dtype: expected a string"),
        ({"shape": [2, 3, 2], "dtype": "uint8"}, ValueError, "missing required key(s) ['data']"),
        ({"data": GOOD["data"]}, ValueError, "missing required key(s) ['shape', 'dtype']"),
        (_with(data=[[[0, 1]]]), TypeError, "list-form"),
        ([[[0, 1], [2, 3]]], TypeError, "list-form"),
        (_with(data=12), TypeError, "expected a base64 string"),
        ("AAEC", TypeError, "expected an envelope mapping"),
    ],
)
def test_malformed_envelopes_are_refused_with_the_field_named(envelope, error, words):
    with pytest.raises(error) as info:
        decode_routes(envelope, name="sample 3")
    assert str(info.value).startswith("sample 3")
    assert words in str(info.value)


def test_non_ascii_base64_is_refused():
    with pytest.raises(ValueError, match="invalid base64"):
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
        (_sglang(np.zeros((3, 4, 2))), {"num_layers": 5, "topk": 2}, ValueError, "whole number of int32 rows"),
        (_sglang(np.zeros((3, 4, 2))), {"num_layers": 4, "topk": 2, "num_tokens": 4}, ValueError, "expected 4 rows"),
        (_sglang(-np.ones((1, 1, 1))), {"num_layers": 1, "topk": 1}, ValueError, ">= 0"),
        ({"meta_info": {}}, {"num_layers": 1, "topk": 1}, ValueError, "return_routed_experts"),
        ([0, 1], {"num_layers": 1, "topk": 2}, TypeError, "list-form"),
        ("AAA", {"num_layers": 1, "topk": 1}, ValueError, "invalid base64"),
        ("AAAA", {"num_layers": True, "topk": 1}, TypeError, "num_layers must be an int"),
        ("AAAA", {"num_layers": 1, "topk": 0}, ValueError, "topk must be > 0"),
    ],
)
def test_sglang_form_errors(value, kwargs, error, words):
    with pytest.raises(error, match=None) as info:
        decode_sglang_routes(value, **kwargs)
    assert words in str(info.value)


def test_import_torch_r3_and_codec_do_not_import_aiohttp():
    code = "import sys, torch_r3, torch_r3.codec, torch_r3.trace; torch_r3.decode_routes; assert 'aiohttp' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
