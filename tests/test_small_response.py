"""The small-response path gives what the large-body path gives: the same answer, or the same error.

A response body under `spans.SMALL_BODY_BYTES` is parsed by `json.loads` whole
(its route text a `str`); a larger one has its route text read in place (a
`memoryview`). The protocols check token ids and log-probs in whole-list passes
(`protocols._lists`) before their per-item loops, `.npy` headers as NumPy
writes them without `ast`, and a payload of one chunk in one decode. Every body
here, valid or broken, is read four ways: small and in place, each with those
shortcuts on, and with all of them off (the per-item loops, `ast.literal_eval`
for every header, the chunked decoder with tiny chunks: the code as it was).
All four must give the same `ParsedResponse` (values, dtypes, the exact floats,
NaN and `-0.0` included) or raise the same exception with the same message.

The bodies are the recorded fixtures of each server, and hypothesis's mutations
of them: a token id, a log-prob, an entry or a route byte replaced by anything
JSON (or a hostile byte stream) can carry.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_r3.errors import WireFormatError
from torch_r3.rollout import _base64, _npy
from torch_r3.rollout.protocols import PROTOCOLS, GenerateCall, RouteLimits, _choices, _openai, fields, sglang, spans

FIXTURES = Path(__file__).parent / "fixtures"
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cases() -> list[tuple[str, dict, GenerateCall, RouteLimits]]:
    """`(server, response, call, limits)` of every recorded generate answer."""
    cases = []
    for server in ("sglang", "vllm"):
        for case in json.loads((FIXTURES / f"{server}_generate.json").read_text()):
            call = GenerateCall(case["call"]["prompt"], {}, True, case["call"]["start"])
            cases.append((server, case["response"], call, RouteLimits(max_bytes=1 << 20, **case["client"])))
    openai = json.loads((FIXTURES / "vllm_openai.json").read_text())
    for case in openai["completions"]:
        call = GenerateCall(case["prompt"], {}, True, case["start"])
        limits = RouteLimits(1 << 20, openai["num_layers"], openai["topk"], case["num_experts"])
        cases.append(("vllm-openai", case["response"], call, limits))
    skyrl = json.loads((FIXTURES / "skyrl_generate.json").read_text())
    for case in skyrl["cases"]:
        call = GenerateCall(case["prompt"], {}, True, case["start"])
        limits = RouteLimits(1 << 20, skyrl["num_layers"], skyrl["topk"], case["num_experts"])
        cases.append(("skyrl", case["response"], call, limits))
    return cases


CASES = _cases()


@contextlib.contextmanager
def _patched(*triples):
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in triples]
    for obj, name, value in triples:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)


def _ways():
    """The four ways to read a body: (name, the settings that make it)."""
    never = 1 << 40
    shortcuts_off = (
        (fields, "all_token_ids", lambda values, end: False),
        (_openai, "all_token_ids", lambda values, end: False),  # the prompt echo's shortcut
        (fields, "_plain_span", lambda *a: False),  # a weight-version span taken without the per-field checks
        (fields, "plain_logprobs", lambda values, **kw: None),
        (fields, "entry_logprobs", lambda *a, **kw: None),
        (sglang, "sglang_logprobs", lambda *a: None),
        (_choices, "entry_logprobs", lambda *a, **kw: None),
        (_npy, "_as_written", lambda text: None),
        (_npy, "_parse_header", _npy._parse_header.__wrapped__),  # no header cache: every header parsed anew
        (_base64, "CHUNK_CHARS", 32),
    )
    return {
        "small": ((spans, "SMALL_BODY_BYTES", never),),
        "in place": ((spans, "SMALL_BODY_BYTES", 0),),
        "small, as it was": ((spans, "SMALL_BODY_BYTES", never), *shortcuts_off),
        "in place, as it was": ((spans, "SMALL_BODY_BYTES", 0), *shortcuts_off),
    }


def _exact(values):
    return None if values is None else tuple(map(repr, values))  # NaN, -0.0 and 1e-300 as themselves


def outcome(server: str, body: bytes, call: GenerateCall, limits: RouteLimits):
    protocol = PROTOCOLS[server]
    try:
        tree = spans.parse_body(bytearray(body), protocol.route_text_paths)
    except (ValueError, RecursionError) as exc:
        return ("not JSON", type(exc), str(exc))
    try:
        got = protocol.parse_response(tree, call, limits)
    except (TypeError, ValueError, OverflowError) as exc:
        return ("refused", type(exc), str(exc))
    routes = got.routed_experts
    return (
        got.response_ids,
        _exact(got.response_logprobs),
        got.finish_reason,
        None if routes is None else (routes.dtype, routes.shape, routes.tobytes(), routes.flags.c_contiguous),
        got.weight_version,
        got.weight_versions,
    )


def every_way(server, body, call, limits):
    results = {}
    for name, triples in _ways().items():
        with _patched(*triples):
            results[name] = outcome(server, body, call, limits)
    first = results["small"]
    for name, got in results.items():
        assert got == first, f"{name}: {got!r:.300}\nsmall: {first!r:.300}"
    return first


@pytest.mark.parametrize(("server", "response", "call", "limits"), CASES)
def test_every_recorded_answer_reads_the_same_every_way(server, response, call, limits):
    got = every_way(server, json.dumps(response).encode(), call, limits)
    assert got[0] != "refused" and got[0] != "not JSON", got


def test_the_small_path_is_json_loads_and_the_large_one_leaves_views():
    server, response, call, limits = CASES[0]
    body = bytearray(json.dumps(response).encode())
    assert len(body) < spans.SMALL_BODY_BYTES
    assert spans.parse_body(body, PROTOCOLS[server].route_text_paths) == json.loads(body)
    padded = copy.deepcopy(response)
    padded["text"] = "x" * spans.SMALL_BODY_BYTES
    tree = spans.parse_body(bytearray(json.dumps(padded).encode()), PROTOCOLS[server].route_text_paths)
    assert isinstance(tree["meta_info"]["routed_experts"], memoryview)


json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2**63 - 1, 2**63, -1, 11, 147]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, -1.5, 1e-300, -1e308, float("-inf"), float("nan")]),
    st.text(max_size=6),
    st.lists(st.integers(-2, 300), max_size=3),
    st.dictionaries(st.sampled_from(["logprob", "token_id", "x"]), st.integers(-1, 200) | st.floats(), max_size=3),
)


def _containers(node):
    """Every non-empty list and object of a parsed answer, the route payload's own included."""
    if isinstance(node, (list, dict)) and node:
        yield node
    for value in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
        yield from _containers(value)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_a_value_replaced_reads_the_same_every_way(case, data):
    server, response, call, limits = case
    response = copy.deepcopy(response)
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from(list(_containers(response))))
        key = data.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
        target[key] = data.draw(json_values)
    body = json.dumps(response, allow_nan=True, ensure_ascii=data.draw(st.booleans())).encode()
    every_way(server, body, call, limits)


HOSTILE = [b"\xe9", "é".encode(), b"\x00", b"\x1f", b"\\/", b"\\u0041", b'"', b"=", b"A", b"==", b" ", b"\x7f", b"\x80"]


def _route_text(response: dict) -> str | None:
    if "meta_info" in response:
        return response["meta_info"].get("routed_experts")
    routes = response["choices"][0].get("routed_experts")
    return routes.get("data") if isinstance(routes, dict) else routes  # SkyRL's envelope holds the text in `data`


@FUZZ
@given(case=st.sampled_from([c for c in CASES if _route_text(c[1])]), data=st.data())
def test_a_body_with_hostile_bytes_reads_the_same_every_way(case, data):
    server, response, call, limits = case
    body = json.dumps(response).encode()
    text = _route_text(response)
    first = body.index(text.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        # Mostly inside the route text, where the shortcuts are; sometimes anywhere.
        anywhere = data.draw(st.booleans()) and data.draw(st.booleans())
        at = data.draw(st.integers(0, len(body))) if anywhere else first + data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 2))
        body = body[:at] + data.draw(st.sampled_from(HOSTILE)) + body[at + cut :]
    every_way(server, body, call, limits)


@FUZZ
@given(
    ids=st.lists(st.integers(0, 2**63 - 1) | st.sampled_from([True, -1, 2**63, 1.0, None, "7"]), max_size=8),
    values=st.lists(
        st.floats(allow_nan=True, allow_infinity=True)
        | st.sampled_from([None, 0, -3, True, "x", -0.0, 0.5, 1.0, 5e-324, -5e-324]),
        max_size=8,
    ),
)
def test_token_ids_and_logprobs_take_or_refuse_what_the_per_item_loop_does(ids, values):
    # The whole-list checks alone, against the loops they stand in front of.
    def loop(fn, *args):
        try:
            return ("ok", _exact(fn(*args)) if fn is not fields.token_ids else fn(*args))
        except ValueError as exc:
            return ("refused", str(exc))

    choice = {"logprobs": {"token_logprobs": values}}
    fast = (loop(fields.token_ids, ids, "ids"), loop(fields.completion_logprobs, choice, len(values)))
    with _patched(*_ways()["small, as it was"][1:-2]):
        slow = (loop(fields.token_ids, ids, "ids"), loop(fields.completion_logprobs, choice, len(values)))
    assert fast == slow
    if fast[1][0] == "ok":
        assert all((v is None and math.isnan(float(r))) or float(r) == v for v, r in zip(values, fast[1][1]))


def test_npy_headers_as_numpy_writes_them_are_read_as_ast_reads_them():
    for shape in [(), (0,), (5,), (95, 4, 4), (0, 3, 2), (7, 1), (2**40, 2)]:
        for descr in ["|u1", "<u2", "<i4", "<i8", ">u2", "|i1"]:
            for fortran in (False, True):
                header = {"descr": descr, "fortran_order": fortran, "shape": shape}
                text = repr(header).rstrip("}") + ", }" + " " * 20 + "\n"  # NumPy's form: a trailing ", }"
                assert _npy._as_written(text) == eval(text)  # the test's own literal
    for odd in ["{'descr': '|u1', 'fortran_order': False, 'shape': (3), }", "{'descr': '|u1', 'shape': (3,), }"]:
        assert _npy._as_written(odd) is None  # not as NumPy writes it: left to ast


def test_a_cached_npy_header_still_has_every_size_checked_and_a_refused_one_is_refused_again():
    def npy(array):
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        return buf.getvalue()

    _npy._parse_header.cache_clear()
    array = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    for _ in range(2):  # the second read is served by the cache
        np.testing.assert_array_equal(_npy.decode_npy(npy(array)), np.load(io.BytesIO(npy(array))))
    assert _npy._parse_header.cache_info().hits >= 1
    short = npy(array)[:-2]  # the cached header, two data bytes short
    for _ in range(2):
        with pytest.raises(WireFormatError, match="declares 48 data bytes"):
            _npy.decode_npy(short)
    with pytest.raises(WireFormatError, match="over the cap"):
        _npy.decode_npy(npy(array), max_bytes=47)
    bad = npy(array).replace(b"'<u2'", b"'<f2'")  # a float dtype: refused each time, never cached
    for _ in range(2):
        with pytest.raises(WireFormatError, match="integer dtype"):
            _npy.decode_npy(bad)
    assert _npy._parse_header.cache_info().currsize == 1


@pytest.mark.parametrize("tokens", [1, 40, 400])
def test_a_larger_answer_of_each_server_reads_the_same_every_way(tokens):
    rng = np.random.default_rng(tokens)
    for server, response, call, limits in CASES[:1] + CASES[6:7]:
        response = copy.deepcopy(response)
        generated = rng.integers(0, 150, tokens).tolist()
        rows = len(call.prompt) + tokens - 1
        routes = rng.integers(0, limits.num_experts, (rows, limits.num_layers, limits.topk))
        if server == "sglang":
            response["output_ids"] = generated
            meta = response["meta_info"]
            meta["output_token_logprobs"] = [[-float(x), t, None] for x, t in zip(rng.random(tokens), generated)]
            meta["routed_experts"] = _b64(routes.astype("<i4").tobytes())
            meta.pop("routed_experts_dtype", None)
            meta.pop("weight_versions", None)
        else:
            choice = response["choices"][0]
            choice["token_ids"] = generated
            choice["logprobs"] = {
                "content": [{"token_id": t, "logprob": -float(x)} for x, t in zip(rng.random(tokens), generated)]
            }
            choice["routed_experts"] = _b64(_npy_file(routes.astype(np.uint8)))
            choice.pop("weight_versions", None)
        got = every_way(server, json.dumps(response).encode(), GenerateCall(call.prompt, {}, True, 0), limits)
        assert got[3][2] == routes.astype(np.uint8).tobytes(), server


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()


def _npy_file(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("value", "kind", "ok"),
    [
        ([1], list, True),
        (True, int, False),
        (True, bool, True),
        (True, (int, float), False),
        (3, (int, float), True),
        ("stop", (dict, str), True),
        (1.0, int, False),
        ({"a": 1}, list, False),
    ],
)
def test_a_field_of_the_one_type_asked_for_is_taken_as_isinstance_takes_it(value, kind, ok):
    # The exact-type shortcut against the rule it stands in front of: isinstance, with a bool only where asked.
    kinds = kind if isinstance(kind, tuple) else (kind,)
    assert ok == (isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds))
    if ok:
        assert fields.get_field({"k": value}, "k", "x", kind) is value
    else:
        with pytest.raises(WireFormatError, match=r"^x\.k: expected "):
            fields.get_field({"k": value}, "k", "x", kind)


@pytest.mark.parametrize(
    "entries",
    [
        [[-0.5, 7, None], [-1.0, 8]],
        [[-0.5, 7, None], [-1.0]],
        [[-0.5, True, None], [-1.0, 8, None]],
        [[-0.5, 7.0, None], [-1.0, 8, None]],
        [[-0.5, 7, None], [-1.0, 9, None]],
        [[None, 7, "a"], [-1e-300, 8, "b"]],
        [[0.5, 7, None], [-1.0, 8, None]],
        [[-0.5, 7, None], (-1.0, 8, None)],
    ],
)
def test_sglang_entries_read_by_columns_give_what_the_per_entry_loop_gives(entries):
    meta = {"output_token_logprobs": entries}
    ids = (7, 8)

    def read():
        try:
            return ("ok", _exact(sglang._logprobs(meta, ids)))
        except WireFormatError as exc:
            return ("refused", str(exc))

    fast = read()
    with _patched((sglang, "sglang_logprobs", lambda *a: None)):
        assert read() == fast


_SPAN_VALUES = st.sampled_from([0, 1, 2, 3, 5, -1, True, 1.0, None, "1"])


@FUZZ
@given(
    items=st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "version": st.sampled_from(["v1", "", 7, None, True]),
                "start": _SPAN_VALUES,
                "end": _SPAN_VALUES,
            },
        )
        | st.sampled_from([None, [], "span", 3]),
        max_size=4,
    ),
    generated=st.integers(0, 4),
)
def test_weight_spans_take_or_refuse_what_the_per_field_checks_do(items, generated):
    def read():
        try:
            return ("ok", fields.weight_spans(items, "w", generated))
        except WireFormatError as exc:
            return ("refused", str(exc))

    fast = read()
    with _patched((fields, "_plain_span", lambda *a: False)):
        assert read() == fast
