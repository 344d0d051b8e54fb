"""The fast wire path against the reference decoder, bit for bit.

Every valid payload of every dtype and shape decodes to the same array (values,
dtype, shape) through the pybase64 kernel, the strict-binascii fallback and the
reference decoder (`TORCH_R3_BASE64=reference`, the decoder of torch_r3 0.1), and
that array equals an independent reference built from the standard library's
base64, NumPy's own `.npy` reader and `compact_routes`. Chunk sizes are made tiny
so that every payload spans many chunks, and a chunk boundary falls everywhere
(inside a `.npy` header, mid-quantum at the data's start, mid-element). Payloads
arrive as a `str`, as `bytes` and as a `memoryview` of a body, as the client hands them.
Every nearly valid payload that one decoder refuses, each refuses, with a `WireFormatError`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_r3.rollout import _base64
from torch_r3.rollout.codec import WireFormatError, decode_routes, decode_sglang_routes, decode_vllm_routes
from torch_r3.routes import compact_routes

DECODERS = ("pybase64", "binascii", "reference")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def forced(name: str, chunk_chars: int):
    old_env, old_chunk = os.environ.get(_base64.ENV_DECODER), _base64.CHUNK_CHARS
    os.environ[_base64.ENV_DECODER] = name
    _base64.CHUNK_CHARS = chunk_chars
    try:
        assert _base64.decoder() == name
        yield
    finally:
        _base64.CHUNK_CHARS = old_chunk
        if old_env is None:
            del os.environ[_base64.ENV_DECODER]
        else:
            os.environ[_base64.ENV_DECODER] = old_env


def as_form(text: str, form: str):
    if form == "str":
        return text
    if form == "bytes":
        return text.encode()
    body = bytearray(b'{"x": "' + text.encode() + b'"}')  # a view into a body, as parse_body leaves it
    return memoryview(body)[7 : 7 + len(text)].toreadonly()


def outcomes(decode, text: str, form: str, chunk_chars: int, **kwargs):
    """What each decoder makes of one payload: an array, or the WireFormatError it raised."""
    results = {}
    for name in DECODERS:
        with forced(name, chunk_chars):
            try:
                results[name] = decode(as_form(text, form), **kwargs)
            except WireFormatError as exc:
                results[name] = exc
    return results


def assert_same_array(results, expected):
    for name, got in results.items():
        assert isinstance(got, np.ndarray), f"{name} refused a valid payload: {got}"
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert got.flags.c_contiguous and got.flags.writeable, name
        assert got.tobytes() == expected.tobytes(), name


def assert_all_refuse(results, field: str):
    for name, got in results.items():
        assert isinstance(got, WireFormatError), f"{name} accepted what another decoder refused"
        assert field in str(got), name


arrays = st.builds(
    lambda rows, layers, topk, high, seed: np.random.default_rng(seed).integers(0, high, (rows, layers, topk)),
    rows=st.integers(0, 40),
    layers=st.integers(1, 5),
    topk=st.integers(1, 4),
    high=st.sampled_from([1, 8, 256, 257, 300, 2**15, 2**15 + 5, 70_000]),
    seed=st.integers(0, 2**32 - 1),
)
chunks = st.sampled_from([32, 64, 96, 160, 1 << 18])
forms = st.sampled_from(["str", "bytes", "view"])


def reference_sglang(text: str, wire: str, layers: int, topk: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.dtype(wire).newbyteorder("<"))
    return compact_routes(flat.reshape(-1, layers, topk), health=None)


@SETTINGS
@given(array=arrays, wire=st.sampled_from(["int32", "uint16", "uint8"]), chunk=chunks, form=forms)
def test_sglang_bodies_decode_bit_for_bit_on_every_path(array, wire, chunk, form):
    if wire == "uint16":
        array = array % 2**16
    if wire == "uint8":
        array = array % 2**8
    text = base64.b64encode(array.astype(np.dtype(wire).newbyteorder("<")).tobytes()).decode()
    layers, topk = array.shape[1:]
    results = outcomes(decode_sglang_routes, text, form, chunk, num_layers=layers, topk=topk, dtype=wire)
    assert_same_array(results, reference_sglang(text, wire, layers, topk))
    if array.size:
        # The same payload with a bound just above its largest id, and just at it.
        bound = int(array.max()) + 1
        kwargs = {"num_layers": layers, "topk": topk, "dtype": wire}
        assert_same_array(
            outcomes(decode_sglang_routes, text, form, chunk, num_experts=bound, **kwargs), results["reference"]
        )
        if bound > 1:
            refused = outcomes(decode_sglang_routes, text, form, chunk, num_experts=bound - 1, **kwargs)
            assert_all_refuse(refused, "routed_experts")


def saved(array: np.ndarray, descr: str, fortran: bool) -> bytes:
    buf = io.BytesIO()
    data = array.astype(np.dtype(descr))
    np.save(buf, np.asfortranarray(data) if fortran else data, allow_pickle=False)
    return buf.getvalue()


@SETTINGS
@given(
    array=arrays,
    descr=st.sampled_from(["|u1", "<u2", "<i2", "<i4", "<u4", "<i8", ">u2", ">i4"]),
    fortran=st.booleans(),
    flat=st.booleans(),
    chunk=chunks,
    form=forms,
)
def test_vllm_npy_files_decode_bit_for_bit_on_every_path(array, descr, fortran, flat, chunk, form):
    kind, size = np.dtype(descr).kind, np.dtype(descr).itemsize
    array = array % min(2 ** (8 * size - (kind == "i")), 2**31)
    layers, topk = array.shape[1:]
    stored = array.reshape(-1) if flat else array
    text = base64.b64encode(saved(stored, descr, fortran)).decode()
    known = {"num_layers": layers, "topk": topk} if flat else {}
    results = outcomes(decode_vllm_routes, text, form, chunk, **known)
    reference = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    assert_same_array(results, compact_routes(reference.reshape(array.shape), health=None))


@SETTINGS
@given(array=arrays, dtype=st.sampled_from(["uint8", "int16", "int32"]), chunk=chunks, form=forms)
def test_envelopes_decode_bit_for_bit_on_every_path(array, dtype, chunk, form):
    array = array % {"uint8": 2**8, "int16": 2**15, "int32": 2**31}[dtype]
    text = base64.b64encode(array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()
    decode = lambda data, **kw: decode_routes({"data": data, "shape": list(array.shape), "dtype": dtype}, **kw)  # noqa: E731
    results = outcomes(decode, text, form, chunk)
    assert_same_array(results, array.astype(dtype))  # the envelope's dtype is kept, not narrowed


def corrupt(text: str, how: str, at: int) -> str:
    at = at % max(1, len(text))
    if how == "bad char":
        return text[:at] + "*" + text[at + 1 :]
    if how == "padding inside":
        quantum = at // 4 * 4
        return text[:quantum] + "AA==" + text[quantum + 4 :] if quantum + 4 < len(text) else text[:-4] + "A=A="
    if how == "url-safe":
        return text[:at] + "-" + text[at + 1 :]
    if how == "whitespace":
        return text[:at] + "\n" + text[at + 1 :]
    return text[:at] + "\\" + text[at + 1 :]


@SETTINGS
@given(
    array=arrays.filter(lambda a: a.size > 0),
    server=st.sampled_from(["sglang", "vllm", "envelope"]),
    how=st.sampled_from(["bad char", "padding inside", "url-safe", "whitespace", "backslash"]),
    at=st.integers(0, 10**6),
    chunk=chunks,
    form=forms,
)
def test_a_corrupted_payload_is_refused_by_every_path(array, server, how, at, chunk, form):
    array = array % 256
    if server == "vllm":
        text = base64.b64encode(saved(array, "|u1", False)).decode()
        decode, kwargs = decode_vllm_routes, {}
    elif server == "sglang":
        text = base64.b64encode(array.astype("<i4").tobytes()).decode()
        decode, kwargs = decode_sglang_routes, {"num_layers": array.shape[1], "topk": array.shape[2]}
    else:
        text = base64.b64encode(array.astype("u1").tobytes()).decode()
        shape = list(array.shape)
        decode, kwargs = (lambda d, **kw: decode_routes({"data": d, "shape": shape, "dtype": "uint8"}, **kw)), {}
    assert_all_refuse(outcomes(decode, corrupt(text, how, at), form, chunk, **kwargs), "routed_experts")


@pytest.mark.parametrize(
    "wire,ids,dtype", [("<i4", [3, 255], "uint8"), ("<i4", [256, 0], "int16"), ("<u2", [40000, 1], "int32")]
)
def test_a_wider_id_late_in_the_payload_widens_the_whole_result(wire, ids, dtype):
    # Many chunks of small ids, then one wide id in the last chunk: the kernel starts over one dtype wider.
    array = np.zeros((500, 2, 2), dtype=wire)
    array[-1, -1, :] = ids
    text = base64.b64encode(array.tobytes()).decode()
    results = outcomes(decode_sglang_routes, text, "view", 32, num_layers=2, topk=2, dtype=np.dtype(wire).name)
    assert_same_array(results, array.astype(dtype))


def test_negative_ids_and_ids_past_int32_are_refused_with_the_reference_message():
    for wire, bad in (("<i4", -1), ("<u4", 2**31)):
        array = np.zeros((3, 1, 2), dtype=wire)
        array[1, 0, 1] = bad
        text = base64.b64encode(saved(array, wire, False)).decode()
        results = outcomes(decode_vllm_routes, text, "view", 32)
        assert_all_refuse(results, "routed_experts")
        assert len({str(exc) for exc in results.values()}) == 1  # the reference path names it, for every decoder


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_body_to_routes_holds_no_more_than_the_output_one_chunk_and_the_parsed_rest(server):
    # The documented bound: on top of the body, the compact output, one decoded chunk (with
    # its text when the input is a str; a view here) and the rest of the body, parsed.
    import json
    import tracemalloc

    from torch_r3.rollout.protocols import PROTOCOLS
    from torch_r3.rollout.protocols.spans import parse_body

    routes = np.random.default_rng(0).integers(0, 256, (20_000, 61, 8))  # 39 MB of int32
    if server == "sglang":
        text = base64.b64encode(routes.astype("<i4").tobytes()).decode()
        body = bytearray(json.dumps({"output_ids": [1, 2], "meta_info": {"routed_experts": text}}).encode())
    else:
        text = base64.b64encode(saved(routes, "<u2", False)).decode()
        body = bytearray(json.dumps({"choices": [{"token_ids": [1, 2], "routed_experts": text}]}).encode())
    del text
    tracemalloc.start()
    tree = parse_body(body, PROTOCOLS[server].route_text_paths)
    if server == "sglang":
        out = decode_sglang_routes(tree["meta_info"], num_layers=61, topk=8)
    else:
        out = decode_vllm_routes(tree["choices"][0]["routed_experts"], num_layers=61, topk=8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.dtype == np.uint8 and np.array_equal(out, routes)
    chunk = _base64.CHUNK_CHARS // 4 * 3 + 64 * 1024  # one decoded chunk, and its transient views and header
    assert peak <= out.nbytes + chunk + 64 * 1024, f"{peak} bytes above the body, output {out.nbytes}"
