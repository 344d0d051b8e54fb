"""`parse_body` is `json.loads`, with each route string at a path left as a view of the body.

The reference is `json.loads` itself: on every body, valid or not, `parse_body`
returns what it returns (with views where the route strings were, holding the
same text) or raises the same kind of error. Bodies are built to trip a
locator that trusts the key: the key inside other strings, escaped route text,
duplicated keys, the key at a path nobody asked for, truncated bodies.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from torch_r3.rollout.codec import WireFormatError, decode_sglang_routes
from torch_r3.rollout.protocols import PROTOCOLS, spans
from torch_r3.rollout.protocols.spans import MAX_SPANS, parse_body, route_text_bytes

SGLANG = (("meta_info", "routed_experts"),)
CHOICES = (("choices", "*", "routed_experts"),)
ENVELOPE = (("choices", "*", "routed_experts", "data"),)


@pytest.fixture(autouse=True, params=[3, spans.SCAN_BYTES], ids=["3-byte scans", "default scans"])
def every_body_is_read_in_place(monkeypatch, request):
    """These bodies are tiny: read them as large ones are, views and all (below the size, it is json.loads),
    and scan them in pieces of a few bytes too, so that a piece ends everywhere: in the text, on its quote."""
    monkeypatch.setattr(spans, "SMALL_BODY_BYTES", 0)
    monkeypatch.setattr(spans, "SCAN_BYTES", request.param)


def with_text(tree):
    """`tree` with every view turned back into the `str` `json.loads` would have given."""
    if isinstance(tree, memoryview):
        return bytes(tree).decode("ascii")
    if isinstance(tree, dict):
        return {k: with_text(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [with_text(v) for v in tree]
    return tree


def views_in(tree) -> int:
    if isinstance(tree, memoryview):
        return 1
    if isinstance(tree, dict):
        return sum(views_in(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(views_in(v) for v in tree)
    return 0


def same_as_json_loads(body: bytes, paths) -> int:
    """Assert `parse_body(body)` agrees with `json.loads(body)`; the number of views it left."""
    try:
        expected = json.loads(body)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            parse_body(bytearray(body), paths)
        return 0
    got = parse_body(bytearray(body), paths)
    assert with_text(got) == expected
    return views_in(got)


def test_an_sglang_body_keeps_its_route_text_as_a_read_only_view():
    body = bytearray(b'{"output_ids": [1, 2], "meta_info": {"routed_experts": "AAAAAQ==", "id": "x"}}')
    tree = parse_body(body, SGLANG)
    view = tree["meta_info"]["routed_experts"]
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == b"AAAAAQ=="
    assert view.obj is body  # no copy: a view of the body itself
    assert tree["output_ids"] == [1, 2] and tree["meta_info"]["id"] == "x"


def test_every_choice_and_the_envelope_text_are_views():
    body = json.dumps({"choices": [{"routed_experts": "AAAA"}, {"routed_experts": "BBBB"}, {"routed_experts": None}]})
    tree = parse_body(body.encode(), CHOICES)
    assert [bytes(c["routed_experts"]) for c in tree["choices"][:2]] == [b"AAAA", b"BBBB"]
    assert tree["choices"][2]["routed_experts"] is None
    assert route_text_bytes(tree, CHOICES) == 8
    envelope = json.dumps({"choices": [{"routed_experts": {"data": "AAAA", "shape": [1, 1, 3], "dtype": "uint8"}}]})
    tree = parse_body(envelope.encode(), ENVELOPE)
    assert isinstance(tree["choices"][0]["routed_experts"]["data"], memoryview)


@pytest.mark.parametrize(
    "body",
    [
        # the key inside another string: its quotes are escaped there
        b'{"text": "\\"routed_experts\\": \\"AAAA\\"", "meta_info": {"routed_experts": "BBBB"}}',
        # route text with an escape (a JSON-legal "\\/"): left to json.loads, which unescapes it
        b'{"meta_info": {"routed_experts": "AA\\/A"}}',
        # the key twice in one object: json.loads keeps the last
        b'{"meta_info": {"routed_experts": "AAAA", "routed_experts": "BBBB"}}',
        # the key at a path nobody asked for, before and after the real one
        b'{"routed_experts": "CCCC", "meta_info": {"routed_experts": "BBBB"}, "x": {"routed_experts": "DD"}}',
        # a key ending in the route key, and the key as a value
        b'{"not_routed_experts": "AAAA", "k": "routed_experts", "meta_info": {"routed_experts": "BBBB"}}',
        # whitespace JSON allows around the colon
        b'{"meta_info": {"routed_experts" \n\t:\r "BBBB"}}',
        # not a string value
        b'{"meta_info": {"routed_experts": ["AAAA"]}}',
        b'{"meta_info": {"routed_experts": null}}',
        # broken bodies: json.loads's own error
        b'{"meta_info": {"routed_experts": "AAAA"',
        b'{"meta_info": {"routed_experts": "AAAA}}',
        b'{"meta_info": {"routed_experts": "AAAA"}} trailing',
        b'{"meta_info": {"routed_experts": "AAAA"}, "x": "\xff"}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_a_hostile_or_odd_body_parses_as_json_loads_parses_it(body):
    same_as_json_loads(body, SGLANG)


CONTROL = [b"\t", b"\n", b"\r", b"\x00", b"\x1f", b"\x7f"]  # \x7f is no control character to JSON


@pytest.mark.parametrize("char", CONTROL)
@pytest.mark.parametrize(
    ("template", "paths"),
    [
        (b'{"meta_info": {"routed_experts": "AA#AA"}}', SGLANG),  # the route text at its path
        (b'{"routed_experts": "AA#AA", "meta_info": {"routed_experts": "BBBB"}}', SGLANG),  # the key elsewhere
        (b'{"meta_info": {"routed_experts": "#"}}', SGLANG),  # the character alone
        (b'{"choices": [{"routed_experts": "AAAA"}, {"routed_experts": "BB#"}]}', CHOICES),
        (b'{"choices": [{"routed_experts": {"data": "#AAAA", "shape": [1], "dtype": "uint8"}}]}', ENVELOPE),
        (b'{"data": "x#y", "choices": [{"routed_experts": {"data": "AAAA"}}]}', ENVELOPE),
    ],
)
def test_a_raw_control_character_in_a_string_is_refused_as_json_loads_refuses_it(template, paths, char):
    body = template.replace(b"#", char)
    try:
        expected = json.loads(body)
    except json.JSONDecodeError as exc:
        with pytest.raises(json.JSONDecodeError) as info:
            parse_body(bytearray(body), paths)
        assert (str(info.value), info.value.pos) == (str(exc), exc.pos)  # the same message, the same place
    else:
        assert char == b"\x7f"  # the one byte here JSON takes raw
        assert with_text(parse_body(bytearray(body), paths)) == expected


@pytest.mark.parametrize("text", ["AA\xffAA".encode("latin-1"), "AAé=".encode(), "AAAA\x80".encode("latin-1")])
def test_non_ascii_route_text_is_left_to_json_loads_so_every_view_is_ascii(text):
    # Invalid UTF-8 is json.loads's own error; valid UTF-8 is a str, which the decoder refuses
    # as it refuses the same text from json.loads: no view ever holds a byte from 0x80.
    body = b'{"meta_info": {"routed_experts": "' + text + b'"}}'
    assert same_as_json_loads(body, SGLANG) == 0
    try:
        meta = json.loads(body)["meta_info"]
    except UnicodeDecodeError:
        return
    with pytest.raises(WireFormatError, match="routed_experts: invalid base64 .non-ASCII characters."):
        decode_sglang_routes(meta, num_layers=1, topk=1)


def test_only_the_route_string_at_the_path_becomes_a_view():
    body = b'{"routed_experts": "CCCC", "meta_info": {"routed_experts": "BBBB"}}'
    tree = parse_body(body, SGLANG)
    assert isinstance(tree["meta_info"]["routed_experts"], memoryview)
    assert tree["routed_experts"] == "CCCC"  # read the ordinary way, as a str


def test_more_route_strings_than_max_spans_are_parsed_as_json():
    body = json.dumps({"choices": [{"routed_experts": "AAAA"} for _ in range(MAX_SPANS + 3)]}).encode()
    assert same_as_json_loads(body, CHOICES) == MAX_SPANS


def test_a_path_must_end_in_a_plain_key():
    with pytest.raises(ValueError, match="plain key"):
        parse_body(b"{}", (("meta_info", "routed.experts"),))


def test_each_protocols_route_text_lies_under_a_payload_path_it_drops():
    # What the client keeps as `raw` must hold no view of the body.
    # Megatron's server sends routes as JSON lists, not base64 text: it is the one protocol without text paths.
    assert [name for name, p in PROTOCOLS.items() if not p.route_text_paths] == ["megatron"]
    for protocol in PROTOCOLS.values():
        for text_path in protocol.route_text_paths:
            assert any(text_path[: len(p)] == p for p in protocol.route_payload_paths), protocol.name


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12))
keys = st.sampled_from(["routed_experts", "meta_info", "choices", "data", "text", 'routed_experts"', "x\\"])
json_values = st.recursive(
    json_scalars | st.sampled_from(["AAAA", "routed_experts", '"routed_experts": "AAAA"']),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys | st.text(max_size=6), inner, max_size=3),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(tree=json_values, paths=st.sampled_from([SGLANG, CHOICES, ENVELOPE]), cut=st.integers(0, 3))
def test_any_json_body_parses_as_json_loads_parses_it(tree, paths, cut):
    body = json.dumps(tree, ensure_ascii=False).encode()
    same_as_json_loads(body[: len(body) - cut] if cut else body, paths)


@settings(max_examples=300, deadline=None)
@given(
    tree=json_values,
    paths=st.sampled_from([SGLANG, CHOICES, ENVELOPE]),
    at=st.integers(0),
    char=st.sampled_from(CONTROL),
)
def test_any_json_body_with_a_raw_control_character_parses_as_json_loads_parses_it(tree, paths, at, char):
    body = json.dumps(tree, ensure_ascii=False).encode()
    at %= len(body) + 1
    same_as_json_loads(body[:at] + char + body[at:], paths)
