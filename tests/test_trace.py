"""Multi-turn traces: rows arrive per turn, leave as one array, nothing invented."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
import torch

from tests.samples import router_routes
from torch_r3.rollout.codec import decode_routes, decode_sglang_routes, decode_vllm_routes, encode_routes
from torch_r3.rollout.trace import RoutedExpertTrace, TokenMetadataTrace


def _rows(n, value=1, dtype=np.uint8, layers=2, topk=2):
    return np.full((n, layers, topk), value, dtype=dtype)


def test_token_metadata_trace_concatenates_chunks_in_order():
    trace = TokenMetadataTrace()
    chunks = [np.arange(k * 4, dtype=np.uint8).reshape(k, 2, 2) for k in (3, 0, 2)]
    for c in chunks:
        trace.append(c)
    assert trace.rows == 5 and trace.row_shape == (2, 2)
    np.testing.assert_array_equal(trace.finalize(), np.concatenate(chunks))


def test_token_metadata_trace_widens_losslessly_when_a_later_chunk_needs_it():
    trace = TokenMetadataTrace()
    trace.append(np.full((2, 1, 2), 255, dtype=np.uint8))
    trace.append(np.full((1, 1, 2), 40_000, dtype=np.int32))
    trace.append(np.full((1, 1, 2), 300, dtype=np.int16))
    out = trace.finalize()
    assert out.dtype == np.int32
    assert out[:, 0, 0].tolist() == [255, 255, 40_000, 300]


def test_token_metadata_trace_compacts_non_canonical_integer_chunks():
    trace = TokenMetadataTrace()
    trace.append(torch.tensor([[7, 8]], dtype=torch.int64))
    trace.append(np.array([[9, 10]], dtype=np.uint64))
    out = trace.finalize()
    assert out.dtype == np.uint8 and out.tolist() == [[7, 8], [9, 10]]


@pytest.mark.parametrize(
    ("chunk", "kwargs", "error", "words"),
    [
        (np.zeros((2, 3, 2), np.uint8), {}, ValueError, "expected rows of shape (2, 2)"),
        (np.zeros((2, 2, 2), np.uint8), {"expected_rows": 3}, ValueError, "expected 3 rows, got 2"),
        (np.zeros((2, 2, 2), np.float32), {}, TypeError, "integer dtype"),
        ([[[0, 1], [0, 1]]], {}, TypeError, "NumPy array or torch.Tensor"),
        (-np.ones((1, 2, 2), np.int64), {}, ValueError, ">= 0"),
    ],
)
def test_token_metadata_trace_rejects_bad_chunks(chunk, kwargs, error, words):
    trace = TokenMetadataTrace(row_shape=(2, 2), name="sample 5")
    with pytest.raises(error) as info:
        trace.append(chunk, **kwargs)
    assert "sample 5" in str(info.value) and words in str(info.value)
    assert trace.rows == 0


def test_routed_expert_trace_stitches_turns_into_the_whole_conversation():
    # Reference: one routes array for the whole conversation; each turn must
    # deliver exactly rows prompt_start .. P+G-2 of it.
    rng = np.random.default_rng(0)
    turns = [(5, 3), (11, 4), (17, 1)]  # (prompt_len, generated_len); observations between turns
    total = turns[-1][0] + turns[-1][1]
    reference = router_routes(rng, total - 1, 2, 2)
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    for prompt_len, generated_len in turns:
        start = trace.prompt_start
        end = prompt_len + generated_len - 1
        trace.record(prompt_len=prompt_len, generated_len=generated_len, routes=reference[start:end])
        assert trace.prompt_start == end
    np.testing.assert_array_equal(trace.finalize(token_count=total), reference)


def test_synthetic_eos_after_generation_is_an_uncaptured_tail_token():
    trace = RoutedExpertTrace()
    trace.record(prompt_len=4, generated_len=3, routes=_rows(6))
    # The trainer appends an EOS (loss weight 1) the engine never saw: 8 tokens, 6 rows.
    out = trace.finalize(token_count=4 + 3 + 1)
    assert out.shape == (6, 2, 2)  # never padded, never invented


def test_dtype_widens_when_a_later_turn_passes_expert_255():
    trace = RoutedExpertTrace()
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4, 200, np.uint8))
    trace.record(prompt_len=6, generated_len=2, routes=_rows(3, 300, np.int16))
    out = trace.finalize(token_count=8)
    assert out.dtype == np.int16 and out[:, 0, 0].tolist() == [200] * 4 + [300] * 3


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"prompt_len": 6, "generated_len": 3, "routes": _rows(4)}, ValueError, "6 - 3 + 3 - 1 = 5 rows, got 4"),
        ({"prompt_len": 6, "generated_len": 3, "routes": _rows(6)}, ValueError, "6 - 3 + 3 - 1 = 5 rows, got 6"),
        ({"prompt_len": 6, "generated_len": 3, "routes": None}, TypeError, "return_routed_experts=True"),
        ({"prompt_len": 6, "generated_len": 3, "routes": [[[0, 0]] * 2] * 5}, TypeError, "NumPy array or torch.Tensor"),
        ({"prompt_len": 6, "generated_len": 3, "routes": _rows(5, layers=3)}, ValueError, "shape (2, 2), got (3, 2)"),
        ({"prompt_len": 6, "generated_len": 3, "routes": _rows(5).astype(np.float32)}, TypeError, "integer dtype"),
        ({"prompt_len": True, "generated_len": 3, "routes": _rows(5)}, TypeError, "prompt_len must be an int"),
        ({"prompt_len": 6, "generated_len": -1, "routes": _rows(1)}, ValueError, "generated_len must be >= 0"),
        ({"prompt_len": 2, "generated_len": 3, "routes": _rows(1)}, ValueError, "must extend the conversation"),
    ],
)
def test_record_rejects_the_wrong_rows_and_keeps_the_trace_unchanged(kwargs, error, words):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    trace.record(prompt_len=2, generated_len=2, routes=_rows(3))
    with pytest.raises(error) as info:
        trace.record(**kwargs)
    assert "turn 1" in str(info.value) and words in str(info.value)
    assert trace.prompt_start == 3 and trace.turns == 1


def test_finalize_refuses_more_rows_than_tokens():
    trace = RoutedExpertTrace()
    trace.record(prompt_len=4, generated_len=3, routes=_rows(6))
    with pytest.raises(ValueError, match="6 rows captured but the trajectory has only 5 tokens"):
        trace.finalize(token_count=5)
    assert trace.finalize(token_count=6).shape[0] == 6


def test_finalize_without_turns_needs_the_row_shape():
    assert RoutedExpertTrace(num_layers=3, topk=2).finalize(token_count=4).shape == (0, 3, 2)
    with pytest.raises(ValueError, match="row_shape unknown"):
        RoutedExpertTrace().finalize(token_count=4)


# -- Range check where routes enter, zero-row turns, weight versions (issues 10 and 13).


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_record_refuses_negative_ids_in_signed_routes(dtype):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    routes = _rows(3, 1, dtype)
    routes[1, 0, 1] = -7
    with pytest.raises(ValueError, match=r"turn 0: routes: .*found -7 at index \(1, 0, 1\)"):
        trace.record(prompt_len=2, generated_len=2, routes=routes)
    assert trace.prompt_start == 0 and trace.turns == 0


def test_record_refuses_ids_at_or_above_num_experts():
    trace = RoutedExpertTrace(num_layers=2, topk=2, num_experts=8)
    trace.record(prompt_len=2, generated_len=1, routes=_rows(2, 7))
    with pytest.raises(ValueError, match=r"turn 1: routes: .*found 8 at index \(0, 0, 0\) \(num_experts=8\)"):
        trace.record(prompt_len=3, generated_len=1, routes=_rows(1, 8))
    assert trace.prompt_start == 2


def test_a_zero_row_turn_does_not_fix_the_row_shape_of_an_open_trace():
    # An empty turn may claim any [L, K]; before, the trace adopted it and the
    # collator then built a batch of that width.
    trace = RoutedExpertTrace()
    trace.record(prompt_len=0, generated_len=1, routes=np.zeros((0, 100_000, 1000), np.int32))
    trace.record(prompt_len=2, generated_len=2, routes=_rows(3, 5))
    out = trace.finalize(token_count=4)
    assert out.shape == (3, 2, 2) and out.dtype == np.uint8  # the empty int32 turn widened nothing
    assert trace.turns == 2


def test_a_zero_row_turn_must_still_match_a_known_row_shape():
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    with pytest.raises(ValueError, match=r"expected rows of shape \(2, 2\), got \(1000, 1000\)"):
        trace.record(prompt_len=0, generated_len=1, routes=np.zeros((0, 1000, 1000), np.uint8))


def test_turns_from_two_weight_versions_raise_naming_both_turns_and_versions():
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), weight_version="v3")
    trace.record(prompt_len=6, generated_len=1, routes=_rows(2), weight_version="v3")
    with pytest.raises(ValueError) as info:
        trace.record(prompt_len=8, generated_len=2, routes=_rows(3), weight_version="v4")
    message = str(info.value)
    assert "turn 2" in message and "'v4'" in message and "turn 0" in message and "'v3'" in message
    assert "allow_mixed_versions=True" in message
    assert trace.turns == 2 and trace.prompt_start == 6 and trace.weight_versions == ("v3", "v3")


def test_mixed_versions_are_accepted_knowingly_and_exposed():
    trace = RoutedExpertTrace(num_layers=2, topk=2, allow_mixed_versions=True)
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), weight_version=3)
    trace.record(prompt_len=6, generated_len=1, routes=_rows(2), weight_version=None)
    trace.record(prompt_len=8, generated_len=2, routes=_rows(3), weight_version=4)
    assert trace.finalize(token_count=10).shape == (9, 2, 2)
    assert trace.weight_versions == (3, None, 4)


def test_a_turn_without_a_version_never_conflicts():
    trace = RoutedExpertTrace()
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), weight_version=None)
    trace.record(prompt_len=6, generated_len=1, routes=_rows(2), weight_version="default")
    trace.record(prompt_len=8, generated_len=1, routes=_rows(2))
    assert trace.weight_versions == (None, "default", None)


@pytest.mark.parametrize("version", [True, 1.5, b"v1", ["v1"]])
def test_a_weight_version_must_be_a_string_or_an_int(version):
    trace = RoutedExpertTrace()
    with pytest.raises(TypeError, match="weight_version must be a str, an int or None"):
        trace.record(prompt_len=3, generated_len=2, routes=_rows(4), weight_version=version)
    assert trace.turns == 0


# -- The same trace across the three wire formats.


def _sglang_payload(rows: np.ndarray) -> dict:
    return {"routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode()}


def _vllm_payload(rows: np.ndarray) -> str:
    buf = io.BytesIO()
    # vLLM picks uint8 up to 256 experts, else uint16, per the model not the turn.
    np.save(buf, rows.astype(np.uint16), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


_DECODERS = {
    "torch_r3": lambda rows: decode_routes(encode_routes(rows), num_layers=3, topk=2, num_experts=512),
    "sglang": lambda rows: decode_sglang_routes(_sglang_payload(rows), num_layers=3, topk=2, num_experts=512),
    "vllm": lambda rows: decode_vllm_routes(_vllm_payload(rows), num_layers=3, topk=2, num_experts=512),
}


@pytest.mark.parametrize("protocol", sorted(_DECODERS))
def test_a_multi_turn_trace_over_each_wire_format_equals_the_whole_conversation(protocol):
    # Reference: the routes of the whole conversation; turn 2 passes expert 255,
    # so the decoded turns differ in dtype and the result must widen.
    rng = np.random.default_rng(7)
    turns = [(5, 3), (11, 4), (17, 2), (20, 1)]
    total = turns[-1][0] + turns[-1][1]
    reference = router_routes(rng, total - 1, 3, 2, num_experts=200, dtype=np.int64)
    reference[12:15] += 300
    decode = _DECODERS[protocol]
    trace = RoutedExpertTrace(num_layers=3, topk=2, num_experts=512)
    dtypes = []
    for prompt_len, generated_len in turns:
        start = trace.prompt_start  # what the client sends as the start field
        rows = decode(reference[start : prompt_len + generated_len - 1])
        dtypes.append(rows.dtype)
        trace.record(prompt_len=prompt_len, generated_len=generated_len, routes=rows, weight_version="v1")
    assert np.dtype(np.int16) in dtypes and np.dtype(np.uint8) in dtypes
    out = trace.finalize(token_count=total)
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, reference)


def test_trace_docstring_examples_run():
    import doctest

    import torch_r3.rollout.trace

    result = doctest.testmod(torch_r3.rollout.trace, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 8


# -- the trace owns what it records ------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_caller_refilling_one_buffer_per_turn_does_not_rewrite_earlier_turns(kind):
    buffer = np.zeros((4, 2, 2), np.uint8) if kind == "numpy" else torch.zeros((4, 2, 2), dtype=torch.uint8)
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    expected = []
    for turn, prompt_len in enumerate((3, 7, 11)):
        buffer[:] = turn + 1  # the same buffer, refilled for every turn
        expected.append(np.full((4, 2, 2), turn + 1, np.uint8))
        trace.record(prompt_len=prompt_len, generated_len=2, routes=buffer)
    np.testing.assert_array_equal(trace.finalize(token_count=13), np.concatenate(expected))


def test_a_recorded_routes_array_can_be_edited_afterwards_without_changing_the_trace():
    routes = np.arange(16, dtype=np.uint8).reshape(4, 2, 2)
    reference = routes.copy()
    trace = RoutedExpertTrace()
    trace.record(prompt_len=3, generated_len=2, routes=routes)
    routes[:] = 0
    np.testing.assert_array_equal(trace.finalize(token_count=5), reference)


# -- prompt_ids: the positions whose routes are held must keep their tokens ----------


def test_prompt_ids_that_extend_the_conversation_are_accepted():
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), prompt_ids=[1, 2, 3], response_ids=[4, 5])
    trace.record(prompt_len=7, generated_len=1, routes=_rows(3), prompt_ids=[1, 2, 3, 4, 5, 6, 7])
    assert trace.prompt_start == 7


def test_a_re_rendered_history_is_refused_naming_the_first_changed_position():
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), prompt_ids=[1, 2, 3], response_ids=[4, 5])
    # A chat template that re-rendered turn 0 changed token 1: rows 0..3 no longer match.
    with pytest.raises(ValueError, match=r"turn 1: prompt_ids\[1\] = 9.*token 2.*re-render"):
        trace.record(prompt_len=7, generated_len=1, routes=_rows(3), prompt_ids=[1, 9, 3, 4, 5, 6, 7])
    assert trace.turns == 1 and trace.prompt_start == 4  # left as it was


def test_a_changed_generated_token_is_refused_when_response_ids_were_given():
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), prompt_ids=[1, 2, 3], response_ids=[4, 5])
    with pytest.raises(ValueError, match=r"prompt_ids\[3\] = 8"):
        trace.record(prompt_len=7, generated_len=1, routes=_rows(3), prompt_ids=[1, 2, 3, 8, 5, 6, 7])


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"prompt_ids": [1, 2]}, ValueError, "prompt_ids has 2 tokens, but prompt_len is 3"),
        ({"prompt_ids": [1, 2, 3], "response_ids": [4]}, ValueError, "response_ids has 1 tokens, but generated_len"),
        ({"prompt_ids": "abc"}, TypeError, "prompt_ids"),
        ({"prompt_ids": [1, 2.0, 3]}, TypeError, r"prompt_ids\[1\]"),
        ({"response_ids": [4, 5]}, ValueError, "response_ids needs prompt_ids"),
    ],
)
def test_bad_prompt_ids_are_refused(kwargs, error, words):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    with pytest.raises(error, match=words):
        trace.record(prompt_len=3, generated_len=2, routes=_rows(4), **kwargs)
    assert trace.turns == 0


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([1, 2, 3], (1, 2, 3)),  # plain ints: taken whole
        ((1, 2, 3), (1, 2, 3)),
        ([1, np.int64(2), 3], (1, 2, 3)),  # NumPy ints: each read by check_int
        ([1, True, 3], TypeError("prompt_ids[1] must be an int, got bool")),
        ([1, 2.0, 3], TypeError("prompt_ids[1] must be an int, got float")),
        ([np.bool_(True)], TypeError("prompt_ids[0] must be an int, got bool")),
    ],
)
def test_prompt_ids_are_plain_ints_or_named_by_the_first_that_is_not(ids, expected):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    if isinstance(expected, Exception):
        with pytest.raises(type(expected), match=re.escape(f"turn 0: {expected}")):
            trace.record(prompt_len=3, generated_len=2, routes=_rows(4), prompt_ids=ids, response_ids=[4, 5])
        return
    trace.record(prompt_len=3, generated_len=2, routes=_rows(4), prompt_ids=ids, response_ids=[4, 5])
    # The next turn's prompt must start with the ids the first kept: these do, and others do not.
    trace.record(prompt_len=6, generated_len=1, routes=_rows(2), prompt_ids=[*expected, 4, 5, 9])
    assert trace.finalize(7).shape == (6, 2, 2)
