"""`IndexerSelections`: the compact form round-trips, is as small as documented, and refuses non-selections."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.reference_selections import expected_nbytes, random_capture, sorted_rows
from torch_r3.indexer import IndexerSelections, SelectionEncoder
from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.selections_wire import decode_sglang_indexer_topk


@pytest.mark.parametrize("style", ["uniform", "local"])
def test_round_trip_gives_each_row_sorted_with_the_fill_last(style):
    rng = np.random.default_rng(1)
    dense = random_capture(rng, 300, 3, 16, style=style)
    sel = IndexerSelections.from_dense(dense)
    assert sel.shape == (300, 3, 16)
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(dense))


def test_size_is_the_smaller_of_gaps_and_bitmap_per_row():
    rng = np.random.default_rng(2)
    # topk 4 over 600 rows: early rows are cheaper as bitmaps, late ones as gaps with exceptions.
    dense = random_capture(rng, 600, 2, 4)
    sel = IndexerSelections.from_dense(dense)
    assert sel.nbytes == expected_nbytes(dense)
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(dense))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 120),
    layers=st.integers(1, 3),
    topk=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    style=st.sampled_from(["uniform", "local"]),
)
def test_any_capture_round_trips_at_the_documented_size(rows, layers, topk, seed, style):
    dense = random_capture(np.random.default_rng(seed), rows, layers, topk, style=style)
    sel = IndexerSelections.from_dense(dense)
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(dense))
    assert sel.nbytes == expected_nbytes(dense)


def test_rows_that_see_at_most_topk_positions_store_nothing():
    dense = random_capture(np.random.default_rng(0), 64, 2, 64)
    sel = IndexerSelections.from_dense(dense)
    assert sel.nbytes == 2  # the layer map only
    np.testing.assert_array_equal(sel.to_dense(), dense)


def test_a_layer_equal_to_the_one_before_is_stored_once_and_a_late_difference_unshares_it():
    rng = np.random.default_rng(3)
    dense = random_capture(rng, 200, 4, 8, share=(1, 3))
    sel = IndexerSelections.from_dense(dense)
    assert sel.layer_source == (0, 0, 2, 2)
    assert sel.stored_layers == (0, 2)
    late = dense.copy()
    late[150:, 3] = random_capture(rng, 200, 1, 8)[150:, 0]
    # Fed in chunks, so layer 3 is shared for the first chunks and must take over layer 2's code.
    enc = SelectionEncoder(rows=200, num_layers=4, index_topk=8)
    for lo in range(0, 200, 40):
        enc.add(late[lo : lo + 40])
    sel = enc.finish()
    assert sel.layer_source == (0, 0, 2, 3)
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(late))


def test_write_layer_shifts_positions_but_not_the_fill():
    dense = random_capture(np.random.default_rng(4), 40, 1, 8)
    sel = IndexerSelections.from_dense(dense)
    out = np.empty((40, 8), dtype=np.int16)
    sel.write_layer(0, out, offset=100)
    ref = sorted_rows(dense)[:, 0]
    np.testing.assert_array_equal(out, np.where(ref == -1, -1, ref + 100))


def test_pickles_for_dataloader_workers_and_ray():
    dense = random_capture(np.random.default_rng(5), 50, 2, 8)
    sel = pickle.loads(pickle.dumps(IndexerSelections.from_dense(dense)))
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(dense))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.__setitem__((20, 1, 3), d[20, 1, 4]), "layer 1, query position 20 selects a position twice"),
        (lambda d: d.__setitem__((20, 0, 0), 21), "layer 0, query position 20 selects position 21, after the query"),
        (lambda d: d.__setitem__((30, 0, 2), -3), "layer 0, query position 30 holds -3"),
        (lambda d: d.__setitem__((5, 0, 7), 6), "layer 0, query position 5 sees 6 <= index_topk=8 positions"),
        (lambda d: d.__setitem__((5, 1, 0), -1), "layer 1, query position 5 sees 6"),
    ],
)
def test_a_row_that_is_not_a_selection_is_refused_naming_layer_and_position(edit, message):
    dense = random_capture(np.random.default_rng(6), 40, 2, 8)
    edit(dense)
    with pytest.raises(ValueError, match=message):
        IndexerSelections.from_dense(dense)


def test_non_integer_and_misshapen_input_is_refused():
    with pytest.raises(TypeError, match="integer dtype"):
        IndexerSelections.from_dense(np.zeros((3, 1, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[rows, layers, index_topk\]"):
        IndexerSelections.from_dense(np.zeros((3, 2), dtype=np.int32))


def _b64(dense):
    return base64.b64encode(np.ascontiguousarray(dense, dtype="<i4").tobytes()).decode()


def test_sglang_payload_decodes_to_the_same_selections_in_bounded_steps(monkeypatch):
    dense = random_capture(np.random.default_rng(7), 90, 3, 8, share=(2,))
    import torch_r3.rollout.selections_wire as wire

    monkeypatch.setattr(wire, "_STEP_CHARS", 4 * 37)  # many steps, none aligned to a row
    sel = decode_sglang_indexer_topk({"meta_info": {"indexer_topk": _b64(dense)}}, num_layers=3, index_topk=8)
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(dense))
    assert sel.layer_source == (0, 1, 1)


@pytest.mark.parametrize(
    "payload, kwargs, message",
    [
        ({"meta_info": {}}, {}, "no 'indexer_topk' in meta_info .*--enable-return-indexer-topk"),
        ({"indexer_topk": [1, 2]}, {}, "list-form selections"),
        ({"indexer_topk": "AAA"}, {}, "not a multiple of 4"),
        ({"indexer_topk": base64.b64encode(b"\0" * 12).decode()}, {}, "not a whole number of int32 rows"),
        ("X", {"max_bytes": 10}, "over the cap max_bytes=10"),
        ({"indexer_topk": "AA==" + "A" * 12}, {"index_topk": 1}, "invalid base64"),
        ({"indexer_topk": "!!!!" * 4}, {"index_topk": 1}, "invalid base64"),
    ],
)
def test_a_bad_sglang_payload_is_a_wire_format_error_naming_the_field(payload, kwargs, message):
    if payload == "X":
        payload = {"indexer_topk": base64.b64encode(b"\0" * 16).decode()}
    args = {"num_layers": 1, "index_topk": 2, **kwargs}
    with pytest.raises(WireFormatError, match=message) as info:
        decode_sglang_indexer_topk(payload, **args)
    assert str(info.value).startswith("meta_info.indexer_topk")


def test_sglang_rows_are_checked_and_counted():
    dense = random_capture(np.random.default_rng(8), 20, 1, 4)
    with pytest.raises(WireFormatError, match="expected 21 rows"):
        decode_sglang_indexer_topk(_b64(dense), num_layers=1, index_topk=4, num_tokens=21)
    dense[10, 0, 0] = 11
    with pytest.raises(WireFormatError, match="query position 10 selects position 11"):
        decode_sglang_indexer_topk(_b64(dense), num_layers=1, index_topk=4)


def test_the_cap_is_checked_before_any_decoding():
    # 3 GiB of promised bytes in a text that is not even valid: refused by its length alone.
    class Huge(str):
        def __len__(self):
            return 4 << 30

    with pytest.raises(WireFormatError, match="over the cap"):
        decode_sglang_indexer_topk(Huge("AAAA"), num_layers=1, index_topk=2, max_bytes=1 << 20)
