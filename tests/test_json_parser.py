"""`torch_r3.rollout._json.loads` is `json.loads`: the same value, of the same types, or the same error.

orjson reads the bodies it can read exactly; the reference here is the standard
library itself, on the same bytes. Values are compared by type and, for floats,
by their bits (so `-0.0`, `nan` and `inf` count), and dicts by their key order.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_r3.rollout import _json


def same(a, b) -> bool:
    """`a` and `b` are equal values of the same types all the way down (floats by their bits)."""
    stack = [(a, b)]  # a walk, not a recursion: bodies nest deeper than Python's stack
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if not ((math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))):
                return False
        elif isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack += [(x[k], y[k]) for k in x]
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack += list(zip(x, y))
        elif x != y:
            return False
    return True


def outcome(parse, body):
    try:
        return "value", parse(body)
    except (ValueError, RecursionError) as e:
        return "error", (type(e), str(e))


def assert_as_json_loads(body: bytes | bytearray) -> None:
    got, want = outcome(_json.loads, body), outcome(json.loads, body)
    assert got[0] == want[0], (body[:200], got, want)
    if want[0] == "value":
        assert same(got[1], want[1]), (body[:200], got[1], want[1])
    else:
        assert got[1] == want[1]


needs_orjson = pytest.mark.skipif(_json.parser() != "orjson", reason="orjson is not installed here (client extra)")

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
documents = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents, compact=st.booleans(), ascii_only=st.booleans())
def test_any_document_json_dumps_writes_reads_as_json_loads_reads_it(doc, compact, ascii_only):
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(doc, separators=separators, ensure_ascii=ascii_only)
    assert_as_json_loads(text.encode("utf-8", "surrogatepass"))


number = st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][-+]?[0-9]{1,3})?", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(numbers=st.lists(number, min_size=1, max_size=8))
def test_every_number_literal_reads_to_the_same_int_or_the_same_float_bits(numbers):
    # 20-odd significant digits, exponents up to 999 (past the float range: orjson refuses those)
    assert_as_json_loads(("[" + ", ".join(numbers) + "]").encode())


@pytest.mark.parametrize(
    "body",
    [
        b"[999999999999999999, -999999999999999999]",  # 18 digits: orjson reads them as ints
        b"[9223372036854775807, -9223372036854775808, 18446744073709551615]",  # 19-20 digits: json.loads
        b"[-0.0012345678901234567, 0.00012345678901234567890123, 1.5e-7, 12.000000000000000000001]",
        b"[-9223372036854775809, 18446744073709551616, 123456789012345678901234567890]",  # past 64 bits
        b'{"id": "chatcmpl-12345678901234567890", "n": 1}',  # a long run inside a string: json.loads, same value
        b"[NaN, Infinity, -Infinity, 1e400, -1e400, 1e-400]",
        b'["\\ud800", "\\udfff", "\\ud83d\\ude00"]',  # lone surrogates, a pair
        b'{"a": 1, "a": 2, "b": 3, "a": 4}',  # repeated keys: the last value, at the first key's place
        b'["\\u0000", "\\/", "\\"", "caf\xc3\xa9"]',
        b"\xef\xbb\xbf[1]",  # a UTF-8 byte-order mark
        '{"a": [1, 2]}'.encode("utf-16"),
        '{"a": [1, 2]}'.encode("utf-32-le"),
        b'["\xed\xa0\x80"]',  # a UTF-8-encoded surrogate: json.loads reads it (surrogatepass)
        b"[" * 3000 + b"]" * 3000,  # deeper than orjson's limit and than json.loads's recursion
        b"[" * 500 + b"]" * 500,
        b" \t\n\r{}\n",
    ],
)
def test_what_orjson_would_change_or_refuse_reads_as_json_loads_reads_it(body):
    assert_as_json_loads(body)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b'{"a": 1,}',
        b"[1] [2]",
        b'{"a": "b\x01"}',  # a raw control character in a string
        b'["\\x41"]',
        b"[01]",
        b"[1.]",
        b'["\xff"]',  # not UTF-8
        b"{'a': 1}",
        b"[tru]",
    ],
)
def test_a_body_that_is_not_json_raises_what_json_loads_raises(body):
    assert outcome(json.loads, body)[0] == "error"
    assert_as_json_loads(body)
    assert_as_json_loads(bytearray(body))


@needs_orjson
def test_orjson_reads_a_plain_body_and_json_loads_one_with_a_long_digit_run(monkeypatch):
    calls = []
    real = _json._FAST

    def counted(body):
        calls.append(bytes(body))
        return real(body)

    monkeypatch.setattr(_json, "_FAST", counted)
    plain = b'{"ids": [' + b", ".join(b"9" * 18 for _ in range(3)) + b'], "logprob": -1.5}'
    assert same(_json.loads(plain), json.loads(plain))
    assert calls == [plain]
    long_ints = [
        b'{"ids": [' + b"9" * (_json.MAX_PLAIN_DIGITS + 1) + b"]}",
        b'{"ids": [-' + b"9" * (_json.MAX_PLAIN_DIGITS + 1) + b"]}",
        b"1" * (_json.MAX_PLAIN_DIGITS + 1),  # at the body's start
        b"[" + b"1" * 30 + b".5, 1" + b"2" * 25 + b"e3]",  # a float's long integer part: json.loads too
        b"[-0.0012345678901234567, 0.1234567890123456789012, 12345678901234567890]",  # after fractions
    ]
    for body in long_ints:
        assert same(_json.loads(body), json.loads(body))
    assert calls == [plain]  # not handed to orjson
    # A fraction's digits follow the point: log-probs as Python and pydantic write them stay with orjson.
    logprobs = json.dumps({"logprobs": [-0.0012345678901234567, -0.0009876543210987653, -0.5]}).encode()
    assert b"0012345678901234567" in logprobs
    assert same(_json.loads(logprobs), json.loads(logprobs))
    assert calls == [plain, logprobs]


@needs_orjson
def test_the_environment_forces_the_standard_library_parser():
    code = "from torch_r3.rollout import _json; print(_json.parser())"
    env = {**os.environ, _json.ENV_JSON: "json"}
    forced = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert forced.stdout.strip() == "json"
    env.pop(_json.ENV_JSON)
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.strip() == "orjson"
